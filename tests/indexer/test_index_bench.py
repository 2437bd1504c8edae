"""`kvroute bench index` runs end to end at a tiny scale and writes its report."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import index_bench, index_workload
from indexer.backend import DEFAULT


def test_index_bench_smoke(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    index_bench.add_arguments(parser)
    out = tmp_path / "index.md"
    tiny = ["--batches", "30", "--streams", "4", "--docs-per-stream", "2", "--pool", "6"]
    args = parser.parse_args([*tiny, "--seconds", "0.05", "--output", str(out)])
    assert index_bench.run(args) == 0
    text = out.read_text()
    assert "block ops/s" in text and "p99 us" in text and "bytes/entry" in text
    assert "`evict_namespace` of one tenant" in text and "`load_index`" in text
    steady = next(line for line in text.splitlines() if "after routing, steady state" in line)
    assert float(steady.rsplit("|", 2)[1].replace(",", "")) > 0  # measured, not left at 0
    # the compiled backend is measured against the python one in the same run
    assert ("vs python backend" in text) == (DEFAULT.name == "native")


def test_index_bench_runs_on_the_python_backend(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    index_bench.add_arguments(parser)
    out = tmp_path / "index.md"
    tiny = ["--batches", "20", "--streams", "2", "--docs-per-stream", "1", "--pool", "2"]
    args = parser.parse_args(
        [*tiny, "--seconds", "0.02", "--backend", "python", "--output", str(out)]
    )
    assert index_bench.run(args) == 0
    text = out.read_text()
    assert "Backend: **python**" in text and "shared, python" in text
    assert "vs python backend" not in text  # no baseline to compare itself against


def test_index_bench_ingests_a_recording(tmp_path: Path) -> None:
    from bench.synthetic_recording import SyntheticWorkload, synthesize_recording

    capture = tmp_path / "capture.kvrec"
    written = synthesize_recording(capture, SyntheticWorkload(streams=3, conversations=20))
    records, sizes = index_workload.read_recording(capture)
    assert len(records) == written and len({r.stream for r in records}) == 3
    result = index_bench.bench_ingest(records, 0.01, sizes)
    assert result.batches == written and result.block_ops > 0 and result.stored > 0
    assert result.decode_apply_ops_s > 0

    parser = argparse.ArgumentParser()
    index_bench.add_arguments(parser)
    out = tmp_path / "index.md"
    tiny = ["--streams", "2", "--docs-per-stream", "1", "--pool", "2", "--seconds", "0.02"]
    args = parser.parse_args([*tiny, "--recording", str(capture), "--output", str(out)])
    assert index_bench.run(args) == 0
    assert str(capture) in out.read_text()
