"""The index report's fixed text quotes only what the run or its sources measured."""

from __future__ import annotations

from bench.index_report import LIMITS


def test_the_limits_quote_no_unsourced_figure_of_another_indexer() -> None:
    # it said "Dynamo's Rust indexer is quoted at ~65 bytes per block", from no source, and per
    # block where this report counts bytes per entry (one block held by one worker)
    assert "Dynamo" not in LIMITS
    assert "bytes per block" not in LIMITS
