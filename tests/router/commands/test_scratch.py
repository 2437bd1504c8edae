"""`kvroute up`'s scratch directory (the replicas' config, the JetStream store with salts in
clear) does not outlive it: removed on a clean stop, by its watchdog after a kill -9, and by
the next `up` when even the watchdog could not."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from router.commands.scratch import MARKER, PREFIX, scratch_directory, sweep_stale
from tests.router.commands.test_router_up_cli import _read_until

SALT = "SECRET-SALT-ALPHA"


@pytest.fixture
def temp_root(tmp_path: Path) -> Iterator[Path]:
    """tempfile's directory, here, for the test (another run's scratch is not ours to see)."""
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path)
    try:
        yield tmp_path
    finally:
        tempfile.tempdir = before


def _leftovers(root: Path) -> list[Path]:
    return sorted(root.glob("kvroute-*"))


def _holding(root: Path, secret: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in found.read_text().split()] if found.exists() else []


async def test_a_kill_9_of_up_leaves_no_salt_nor_config_in_the_temp_directory(
    tmp_path: Path,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli",
        "up", "--workers", "1", "--replicas", "2", "--router-port", "0",
        "--worker-port-base", "0", "--time-scale", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    orphans: list[int] = []
    try:
        line = await asyncio.wait_for(_read_until(proc.stdout, "replica processes", lines), 60)
        url = line.split("listening on ")[1].split()[0]
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/admin/namespaces/evict", json={"cache_salt": SALT}) as resp,
        ):
            assert resp.status == 200, await resp.text()
        async with asyncio.timeout(20):  # the eviction reaches the store: what is at stake
            while not _holding(tmp_path, SALT.encode()):  # noqa: ASYNC110 (other processes)
                await asyncio.sleep(0.1)
        orphans = _children(proc.pid)  # the replicas: a kill -9 leaves them to this test
        proc.kill()
        await proc.wait()
        for _ in range(200):  # the nats-server's end, then the watchdog's rm
            if not _leftovers(tmp_path):
                break
            await asyncio.sleep(0.1)
        assert _holding(tmp_path, SALT.encode()) == []
        assert _leftovers(tmp_path) == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _scratch(root: Path, name: str, marker: str | None) -> Path:
    path = root / (PREFIX + name)
    path.mkdir()
    (path / "router.json").write_text("{}")
    if marker is not None:
        (path / MARKER).write_text(marker)
    return path


def test_the_next_up_sweeps_only_its_own_kind_whose_owner_is_gone(temp_root: Path) -> None:
    dead = _scratch(temp_root, "dead", f"{_dead_pid()} 12345\n")
    # the pid runs, but a process started later than the marker's holds it: reused
    reused = _scratch(temp_root, "reused", f"{os.getpid()} 1\n")
    alive = _scratch(temp_root, "alive", f"{os.getppid()} \n")  # no start time known: alive
    unmarked = _scratch(temp_root, "unmarked", None)
    garbled = _scratch(temp_root, "garbled", "not a pid\n")
    other = temp_root / "kvroute-nats-x"
    other.mkdir()
    (other / MARKER).write_text(f"{_dead_pid()} 1\n")
    target = _scratch(temp_root, "target", f"{_dead_pid()} 1\n")
    link = temp_root / (PREFIX + "link")
    link.symlink_to(target)
    assert sorted(sweep_stale()) == sorted([dead, reused, target])
    assert sorted(p.name for p in temp_root.iterdir()) == sorted(
        p.name for p in (alive, unmarked, garbled, other, link)
    )
    # and `up` sweeps as it makes its own
    stale = _scratch(temp_root, "stale", f"{_dead_pid()} 1\n")
    with scratch_directory() as path:
        assert not stale.exists()
        assert (path / MARKER).read_text().split()[0] == str(os.getpid())
        assert oct(path.stat().st_mode & 0o777) == "0o700"
    assert not path.exists()
