"""The `kvroute` command line: one verb per job, each implemented in its own module.

Verb modules expose `add_arguments(parser)` and `run(args) -> int`; they are imported only
when their verb runs, so `kvroute --help` stays fast and a verb's heavy imports (plotting,
embedded workers) cost nothing elsewhere.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol

__all__ = ["main"]


class _Verb(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# verb -> (module, one-line help)
_VERBS: dict[str, tuple[str, str]] = {
    "up": ("router.commands.up", "run an embedded fleet of reference workers and the router"),
    "serve": ("router.commands.serve", "run the router in front of an existing fleet (--config)"),
    "worker": ("workers.command", "run one reference worker"),
    "record": ("router.commands.record", "record KV-event streams to a file"),
    "replay": ("router.commands.replay", "replay a recorded file into an index or a PUB socket"),
    "bench": ("bench.command", "run benchmarks and write reports to docs/benchmarks/"),
}


def _load(module: str) -> _Verb | None:
    try:
        verb: _Verb = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    return verb


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, _Verb]]:
    """The top-level parser with every verb that is installed."""
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-aware, cache_salt-namespace-safe router for SGLang and vLLM fleets.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    loaded: dict[str, _Verb] = {}
    for name, (module, help_text) in _VERBS.items():
        verb = _load(module)
        if verb is None:
            continue
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        verb.add_arguments(verb_parser)
        loaded[name] = verb
    return parser, loaded


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvroute` console script."""
    parser, verbs = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        return verbs[args.verb].run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
