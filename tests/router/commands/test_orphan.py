"""A `--processes` child whose parent died ends itself, even when its own stop hangs.

QA: a child whose NATS was down could not finish its shutdown (a lost cancellation,
`router.cluster.tasks`); its parent kills such a child after 75 s, but one whose parent had
been SIGKILLed served on, orphaned. The parent's watch (`router.commands.orphan`) now ends the
process that long after its parent is gone. Real processes: a parent, and a child that ignores
SIGTERM (a stop that never ends), whose parent is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

_CHILD = textwrap.dedent(
    """
    import logging, signal, time
    from router.commands.orphan import watch_parent

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # its stop never ends
    watch_parent(lambda: print("told to stop", flush=True), grace_s=0.5)
    print("watching", flush=True)
    time.sleep(60)
    """
)

_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    out = open(sys.argv[2], "wb")
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=out, stderr=out)
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not reaped yet, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(what: str, check: object, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {what}")


def test_an_orphan_whose_stop_hangs_ends_itself(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD, str(log)],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
        start_new_session=True,
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        _wait("the child watching", lambda: b"watching" in log.read_bytes(), 20.0)
        parent.kill()
        parent.wait()
        _wait("the orphan's end", lambda: not _alive(child), 5.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
    said = log.read_text()
    assert "told to stop" in said, said
    assert f"WARNING router.commands.orphan: parent process {parent.pid} gone" in said, said
    assert "still stopping 0.5 s later: exiting now" in said, said
