"""A worker's entry edited in the config file reaches the cluster; an admin change stands.

QA (s7): an operator moved worker w0 to another server in the config file every replica reads,
and restarted one replica: it kept the old URL, as the cluster's fleet record had it, and so did
the other; a reload changed nothing (`workers_changed: []`), restarting every replica neither,
and no line said why. A file whose entry for a worker differs both from the cluster's record
and from the file the record came from was edited since: a replica starting with it writes it
(when its file is the newer of the two), and every replica moves the worker. A record that wins
over the file (an admin change made since, or another replica's newer file) is said, at start
and at each reload, with how to change it. Real nats-server, real config files, two replicas.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.cluster.server import NatsServer
from router.config import load_config
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.cluster.conftest import admin, workers
from tests.router.conftest import TOKEN, eventually

_LOGGER = "router.cluster.fleet_state"


def _write(
    path: Path, nats_url: str, fleet: list[tuple[str, str]], *, at: float, w0: str = ""
) -> None:
    """A replica's config file naming `fleet` ((id, url)), modified at `at` (a file saved
    later than another is newer: the edit); `w0`: more lines of worker w0."""
    lines = [
        "[listen]",
        'host = "127.0.0.1"',
        "port = 0",
        "[admin]",
        f'token = "{TOKEN}"',
        "[health]",
        "interval_s = 0.2",
        "timeout_s = 0.5",
        "[cluster]",
        f'url = "{nats_url}"',
        "heartbeat_interval_s = 0.1",
        "heartbeat_timeout_s = 0.5",
        "startup_timeout_s = 5.0",
        "snapshot_interval_s = 0.0",
    ]
    for worker_id, url in fleet:
        lines += ["[[workers]]", f'id = "{worker_id}"', f'url = "{url}"']
        if worker_id == "w0" and w0:
            lines.append(w0)
    path.write_text("\n".join(lines) + "\n")
    os.utime(path, (at, at))


def _replica(path: Path) -> RouterService:
    """A replica of the file at `path`, reloading it as `kvroute serve` does."""
    source = ConfigSource(str(path), lambda: load_config(path, reloading=True))
    return RouterService(load_config(path), config_source=source)


async def _urls(session: aiohttp.ClientSession, router: RouterService) -> dict[str, str]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"]: w["url"] for w in listed["workers"]}


async def _agree(
    session: aiohttp.ClientSession, routers: list[RouterService], want: dict[str, str], what: str
) -> None:
    async def agreed() -> bool:
        return all([await _urls(session, r) == want for r in routers])

    await eventually(agreed, what=what)


def _said(caplog: pytest.LogCaptureFixture, words: str, logger: str = _LOGGER) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.levelno >= logging.WARNING and words in r.getMessage()
    ]


async def test_a_worker_moved_in_the_file_moves_on_every_replica_when_one_restarts(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "router.toml"
    async with workers(3) as (old, new, w1), aiohttp.ClientSession() as session:
        _write(path, nats_server.url, [("w0", old.url), ("w1", w1.url)], at=1_000_000.0)
        b = await _replica(path).__aenter__()
        try:
            async with _replica(path) as a:
                await _agree(session, [a, b], {"w0": old.url, "w1": w1.url}, "the first fleet")
            # the operator's edit: w0 on another server, the file saved after the first one
            _write(path, nats_server.url, [("w0", new.url), ("w1", w1.url)], at=2_000_000.0)
            moved = {"w0": new.url, "w1": w1.url}
            async with _replica(path) as a:
                await _agree(session, [a, b], moved, "both replicas to move w0 (a restarted)")
            said = _said(caplog, "worker w0 changed in")
            assert said == [
                f"cluster: worker w0 changed in {path} since the cluster's record (url "
                f"{old.url} -> {new.url}): written to the shared fleet, every replica applies it"
            ], said
        finally:
            await b.__aexit__(None, None, None)
        # every replica restarted: the file is the cluster's word now, and nothing is said
        caplog.clear()
        async with _replica(path) as a, _replica(path) as b:
            await _agree(session, [a, b], moved, "both restarted replicas to keep w0 moved")
            status, answer = await admin(session, a, "POST", "/reload")
            assert status == 200, answer
            assert answer["workers_changed"] == [] and answer["kept_by_cluster"] == {}
        assert not _said(caplog, "w0", logger="router.cluster.fleet_state"), caplog.text


async def test_an_admin_change_stands_over_an_unchanged_file_and_is_said(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "router.toml"
    async with workers(3) as (old, new, w1), aiohttp.ClientSession() as session:
        _write(path, nats_server.url, [("w0", old.url), ("w1", w1.url)], at=1_000_000.0)
        moved = {"w0": new.url, "w1": w1.url}
        urls = old.url, new.url
        async with _replica(path) as b:
            assert b.cluster is not None
            writer = b.cluster.replica
            async with _replica(path) as a:
                # w0 moved through the admin API: the file (unchanged) says otherwise
                assert (await admin(session, b, "DELETE", "/workers/w0"))[0] == 200
                status, _ = await admin(
                    session, b, "POST", "/workers", {"url": new.url, "id": "w0"}
                )
                # (202: its discovery outlasted the add's wait, on a loaded machine: CI)
                assert status in (201, 202)
                await _agree(session, [a, b], moved, "both replicas to take the admin's move")
            async with _replica(path) as a:
                await _agree(session, [a, b], moved, "a restarted to keep the admin's move")
                status, answer = await admin(session, a, "POST", "/reload")
                assert status == 200, answer
                assert answer["workers_changed"] == [] and list(answer["kept_by_cluster"]) == [
                    "w0"
                ], answer
                assert "an admin change" in answer["kept_by_cluster"]["w0"]
                # an edit of the worker's entry is the operator's word again, on every replica
                model = 'model = "kvroute/reference-byte-lm"'
                _write(path, nats_server.url, [("w0", old.url), ("w1", w1.url)], at=3e6, w0=model)
                status, answer = await admin(session, a, "POST", "/reload")
                assert status == 200 and answer["workers_changed"] == ["w0"], answer
                back = {"w0": old.url, "w1": w1.url}
                await _agree(session, [a, b], back, "both replicas to take the edited entry")
    said = _said(caplog, "worker w0 of")
    assert len(said) == 1, said
    assert said[0] == (
        f"cluster: worker w0 of {path} (url {urls[0]}; the cluster's: url {urls[1]}) is not "
        f"applied: the cluster's record stands: replica {writer} "
        "changed it through the admin API after this entry of the file was written into the "
        "fleet; to use the file's entry, edit it and reload (SIGHUP or POST /admin/reload), or "
        "change the worker through the admin API (DELETE, then POST /admin/workers)"
    )
    reload_said = _said(caplog, "config reload: worker w0", logger="router.http.reload")
    assert (
        len(reload_said) == 1 and "is not applied: runs as the cluster's record" in (reload_said[0])
    ), reload_said


async def test_a_replica_with_an_older_file_keeps_the_newer_files_worker(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas on two hosts, one file copy each: the copy edited later wins, whichever
    replica starts last. Before, the record of whichever started first won, silently."""
    caplog.set_level(logging.INFO)
    stale, edited = tmp_path / "host-b.toml", tmp_path / "host-a.toml"
    async with workers(3) as (old, new, w1), aiohttp.ClientSession() as session:
        _write(stale, nats_server.url, [("w0", old.url), ("w1", w1.url)], at=1_000_000.0)
        _write(edited, nats_server.url, [("w0", new.url), ("w1", w1.url)], at=2_000_000.0)
        moved: dict[str, Any] = {"w0": new.url, "w1": w1.url}
        async with _replica(stale) as b:
            async with _replica(edited) as a:
                await _agree(session, [a, b], moved, "the edited file's w0 on both replicas")
                assert a.cluster is not None
                writer = a.cluster.replica
            async with _replica(stale) as b2:
                await _agree(session, [b, b2], moved, "the stale file's restart to keep it")
    said = _said(caplog, "worker w0 of")
    assert (
        len(said) == 1
        and (
            f"the cluster's record stands: it came from the config file of replica {writer}, "
            "edited after this one; bring this file up to date"
        )
        in said[0]
    ), said
