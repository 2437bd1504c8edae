"""`kvroute bench index` runs end to end at a tiny scale and writes its report."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import index_bench


def test_index_bench_smoke(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    index_bench.add_arguments(parser)
    out = tmp_path / "index.md"
    tiny = ["--batches", "30", "--streams", "4", "--docs-per-stream", "2", "--pool", "6"]
    args = parser.parse_args([*tiny, "--seconds", "0.05", "--output", str(out)])
    assert index_bench.run(args) == 0
    text = out.read_text()
    assert "block ops/s" in text and "p99 us" in text and "bytes/entry" in text
