"""The `kvroute` command line: one verb per job, each implemented in its own module.

Verb modules expose `add_arguments(parser)` and `run(args) -> int`. Only the verb on the command
line is imported (to add its arguments, then to run it): the top-level parser needs nothing but
the verbs' names and help lines, so `kvroute --help` imports no verb at all, and a verb's heavy
imports (the aiohttp router, embedded workers, plotting) cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import Protocol

__all__ = ["VERBS", "build_parser", "main"]


class _Verb(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "up": ("router.commands.up", "run an embedded fleet of reference workers and the router"),
    "serve": ("router.commands.serve", "run the router in front of an existing fleet (--config)"),
    "indexer": (
        "router.commands.indexer",
        "run the KV index and its query API without the proxy (--config)",
    ),
    "relay": (
        "router.commands.relay",
        "write the workers' KV events to NATS JetStream for replicas to follow (--config)",
    ),
    "worker": ("workers.command", "run one reference worker"),
    "record": ("router.commands.record", "record KV-event streams to a file"),
    "replay": ("router.commands.replay", "replay a recorded file into an index or a PUB socket"),
    "bench": ("bench.command", "run benchmarks and write reports to docs/benchmarks/"),
}

# the verbs that run a router, which a SIGHUP must never end: it is caught from here on, before
# the verb is even imported (`router.commands.hangup`)
_HOLD_SIGHUP = frozenset({"serve", "indexer", "relay", "up"})


def _installed(module: str) -> bool:
    """Whether the verb's package is there, without importing it (find_spec of a submodule
    would import its package)."""
    return importlib.util.find_spec(module.partition(".")[0]) is not None


def _load(module: str) -> _Verb | None:
    try:
        verb: _Verb = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    return verb


def _chosen(argv: Sequence[str]) -> str | None:
    """The verb `argv` asks for: its first word, the top level taking no option but -h."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, _Verb | None]:
    """The top-level parser for `argv`, and the verb it asks for (its arguments added)."""
    parser, _, verb = _build(argv)
    return parser, verb


def _build(
    argv: Sequence[str],
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None, _Verb | None]:
    """`build_parser`, with the chosen verb's own parser (None: no verb, or not installed)."""
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-aware, cache_salt-namespace-safe router for SGLang and vLLM fleets.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    chosen = _chosen(argv)
    verb: _Verb | None = None
    verb_parser: argparse.ArgumentParser | None = None
    for name, (module, help_text) in VERBS.items():
        if name == chosen:
            verb = _load(module)
            if verb is None:
                continue
        elif not _installed(module):
            continue
        added = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen and verb is not None:
            verb.add_arguments(added)
            verb_parser = added
    return parser, verb_parser, verb


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvroute` console script."""
    words = sys.argv[1:] if argv is None else list(argv)
    if _chosen(words) in _HOLD_SIGHUP:
        from router.commands.hangup import hold

        hold()
    parser, verb_parser, verb = _build(words)
    args, extra = parser.parse_known_args(words)
    if extra:
        # said by the verb's parser, with its usage: the top level's (`kvroute [-h] VERB ...`)
        # says nothing of the options the verb does take
        (verb_parser or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    # what was typed, for a verb that must tell a typed option from its default (`kvroute up`'s
    # [fleet] table fills only the options not given)
    args.command_line = tuple(words)
    if args.verb is None or verb is None:
        parser.print_help()
        return 2
    from router.commands.allocator import pin_mmap_threshold

    pin_mmap_threshold()  # before the verb allocates: see the module for the growth it stops
    from router.commands.descriptor_limit import raise_descriptor_limit

    raise_descriptor_limit()  # before any socket: the zmq context and the cap are sized from it
    try:
        return verb.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
