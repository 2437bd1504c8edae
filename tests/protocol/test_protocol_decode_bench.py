"""`kvroute bench decode` runs end to end and writes its report (a smoke test, not a timing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import decode_bench


def test_decode_bench_writes_report(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_bench.add_arguments(parser)
    output = tmp_path / "decode.md"
    args = parser.parse_args(
        ["--seconds", "0.03", "--events-per-batch", "4", "--output", str(output)]
    )
    assert decode_bench.run(args) == 0
    report = output.read_text(encoding="utf-8")
    assert "| array |" in report
    assert "| map |" in report


def test_decode_bench_refuses_bad_options(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_bench.add_arguments(parser)
    args = parser.parse_args(["--seconds", "0", "--output", str(tmp_path / "x.md")])
    assert decode_bench.run(args) == 2
    assert not (tmp_path / "x.md").exists()
