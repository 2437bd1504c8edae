"""The scratch directory of `kvroute up --replicas N` / `--relay`, which must not outlive it.

It holds the config the replicas start from (`router.json`: the admin token, the fleet) and
the local nats-server's JetStream store (`nats/`: the fleet's records, and every namespace an
admin evicted, by its salt in clear). A `kill -9` of `up` used to leave both in the temp
directory (`kvroute-up-*`, `kvroute-nats-*`) for good. Now, two layers:

- a watchdog process, started with the directory, holds the read end of a pipe whose write end
  only `up` has: however `up` ends (`kill -9` included), the pipe closes, and the watchdog waits
  for the nats-server (which ends with `up`: SIGTERM at its parent's death) then removes the
  directory. It runs in a session of its own, so a signal to `up`'s process group spares it;
  on a clean stop `up` removes the directory itself and the watchdog exits at once;
- whatever the watchdog could not remove (it was killed too, the machine went down) the next
  `up --replicas` / `--relay` sweeps: a `kvroute-up-*` directory of this user holding this
  module's marker whose owner process is gone (its pid dead, or reused by a process started
  later than the one the marker names). Nothing else is touched: another user's directory,
  one without the marker, or one whose owner still runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MARKER", "PREFIX", "WRITERS", "scratch_directory", "sweep_stale"]

PREFIX = "kvroute-up-"
MARKER = "kvroute-owner"  # "PID START": the owner's pid and its start time (/proc, Linux)
WRITERS = "kvroute-writers"  # pids that write in the directory: removed once they are gone

# the watchdog: stdin's EOF is its owner's end; then the writers' end (at most 10 s), then rm
_WATCHDOG = """
import os, shutil, sys, time
path = sys.argv[1]
sys.stdin.buffer.read()
if not os.path.lexists(path):
    sys.exit(0)
try:
    pids = [int(p) for p in open(os.path.join(path, "kvroute-writers")).read().split()]
except (OSError, ValueError):
    pids = []
end = time.monotonic() + 10.0
for pid in pids:
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except OSError:
            pass
        time.sleep(0.05)
shutil.rmtree(path, ignore_errors=True)
"""


def _start_time(pid: int) -> str:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22); "" where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) may hold spaces and parentheses: fields follow the last ")"
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


def _owner_gone(marker: str) -> bool:
    """Whether the process a marker names has ended (a malformed marker: not ours to judge)."""
    parts = marker.split()
    if not parts or not parts[0].isdigit():
        return False
    pid = int(parts[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's: not ours, then, whatever the marker says
    started = parts[1] if len(parts) > 1 else ""
    # alive: the owner, unless the pid was reused by a later process
    return bool(started) and _start_time(pid) not in ("", started)


def sweep_stale(tmp: Path | None = None) -> list[Path]:
    """Remove the scratch directories left by an `up` that is gone (see the module); returns
    them."""
    root = Path(tmp or tempfile.gettempdir())
    swept: list[Path] = []
    uid = os.getuid()
    for path in root.glob(PREFIX + "*"):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            marker = path / MARKER
            if not stat.S_ISREG(marker.lstat().st_mode):
                continue
            if not _owner_gone(marker.read_text()):
                continue
        except (OSError, UnicodeDecodeError):
            continue  # not a directory of ours (no marker) or gone meanwhile
        shutil.rmtree(path, ignore_errors=True)
        swept.append(path)
    return swept


@contextlib.contextmanager
def scratch_directory() -> Iterator[Path]:
    """A new scratch directory (stale ones swept first), removed on exit, and by the watchdog
    if this process is killed. Write the pids of processes that write in it to `WRITERS`."""
    sweep_stale()
    path = Path(tempfile.mkdtemp(prefix=PREFIX))  # 0700
    pid = os.getpid()
    (path / MARKER).write_text(f"{pid} {_start_time(pid)}\n")
    watchdog = subprocess.Popen(
        [sys.executable, "-I", "-c", _WATCHDOG, str(path)],
        stdin=subprocess.PIPE,  # its write end is close-on-exec: no other child holds it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a signal to this process group spares it
    )
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # its cue: it finds the directory gone and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=5.0)
