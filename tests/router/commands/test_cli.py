"""`kvroute --help` stays light: the dispatcher imports only the verb on the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# what a help screen must not pay for: the HTTP stack, the benchmarks, ZMQ, template engines
HEAVY = ("aiohttp", "bench", "zmq", "jinja2", "transformers", "workers", "prometheus_client")

_PROBE = """
import json, sys
from router.commands.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})), file=sys.stderr)
"""


def _imported(*argv: str) -> tuple[str, set[str]]:
    # a fresh interpreter on the worktree's code: this process has imported everything already
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout, set(json.loads(done.stderr.strip().splitlines()[-1]))


def test_top_level_help_lists_every_verb_and_imports_none_of_them() -> None:
    out, imported = _imported("--help")
    for verb in ("up", "serve", "worker", "record", "replay", "bench"):
        assert f"    {verb} " in out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_serve_help_defines_its_arguments_without_the_router() -> None:
    out, imported = _imported("serve", "--help")
    assert "--config" in out and "--policy" in out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_a_verb_still_gets_its_arguments() -> None:
    out, _ = _imported("record", "--help")
    assert "--endpoint" in out and "inspect" in out
