"""`kvroute bench SUITE`: each suite lives in its own module under `bench/`.

Suite modules expose `add_arguments(parser)` and `run(args) -> int` and write their report to
`docs/benchmarks/`. They load lazily, so one suite's heavy imports cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Protocol

__all__ = ["add_arguments", "run", "write_markdown"]


class _Suite(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# suite -> (module, one-line help)
SUITES: dict[str, tuple[str, str]] = {
    "routing": ("bench.routing_bench", "routing quality per policy on a reference fleet"),
    "index": ("bench.index_bench", "indexer ingest rate, query latency, memory per entry"),
    "proxy": ("bench.proxy_bench", "router overhead over calling a worker directly"),
    "decode": ("bench.decode_bench", "KV-event payload decode throughput"),
    "soak": ("bench.soak_bench", "router and worker memory under long mixed traffic"),
    "cluster": ("bench.cluster_bench", "router replicas on NATS: propagation, warm start"),
    "tokenize": ("bench.tokenize_bench", "long-prompt tokenizing on the loop or on a thread"),
}


def _load(module: str) -> _Suite | None:
    try:
        suite: _Suite = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    return suite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one sub-verb per installed suite."""
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, (module, help_text) in SUITES.items():
        suite = _load(module)
        if suite is None:
            continue
        suite_parser = sub.add_parser(name, help=help_text, description=help_text)
        suite.add_arguments(suite_parser)
        _say_defaults(suite_parser)
        suite_parser.set_defaults(_suite_module=module)


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """Append its default to the help of every option that has one and does not say it yet
    (before, no suite's help showed one: `--page-size PAGE_SIZE`, with no word of 16). None
    (worked out at run time, which the help then says) and a flag's False say nothing."""
    for action in parser._actions:
        help_text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or "default" in help_text
        ):
            continue
        action.help = f"{help_text} (default %(default)s)" if help_text else "default %(default)s"


def run(args: argparse.Namespace) -> int:
    """Run the chosen suite."""
    suite = _load(args._suite_module)
    assert suite is not None
    return suite.run(args)


def write_markdown(report: str, output: Path | str) -> None:
    """Write a suite's markdown report to `output` (its folder made if missing) and print it."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    print(report)
