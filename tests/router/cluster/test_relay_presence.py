"""A replica fed by the relay trusts its streams only while the relay is known alive to it.

NATS tells a subscriber nothing of a publisher's death, and a stream's heartbeats come every
`heartbeat_interval_s`: before, a replica went on predicting the relay's last records until
their silence ran past `heartbeat_timeout_s` (3 s), whatever happened meanwhile. QA (two
replicas, the defaults 1 s / 3 s, the worker flushed right after the cut): NATS killed, 8 false
hits of 34 answers, though both replicas had logged that they lost NATS; the relay killed, 16 of
34, then the false-hit watch read the dead relay's records back (under 3 s old: trusted) and
restored the flushed prompts, and left the worker unfollowed for a minute, blaming "sockets"
the replica does not have. Here, against a real nats-server, relay and reference worker:
- the replica's own connection dropping makes every fed stream STALE at once;
- a killed relay's streams go STALE within its presence bound (0.75 s at these defaults),
  and records read back after that trust nothing by their age;
- the false-hit watch names the relay, escalates nothing for a relay not heard, and a
  quarantine ends once another relay process writes the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from router.cluster.server import NatsServer
from router.config import IndexerSection, RouterConfig
from router.service import RouterService
from tests.router.cluster.conftest import CuttableLink, cluster, workers
from tests.router.cluster.test_relay import (
    follower_config,
    generate,
    index_prompt,
    predicted,
    relay_config,
)
from tests.router.conftest import Fleet, eventually
from workers.worker import ReferenceWorker

# the shipped heartbeats: the relay says its presence every 0.25 s, gone after 0.75 s
DEFAULTS: dict[str, Any] = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 3.0}


def _replica(worker: ReferenceWorker, nats_url: str, **indexer: Any) -> RouterConfig:
    return follower_config(
        worker,
        nats_url,
        "a",
        cluster=cluster(nats_url, replica_id="a", **DEFAULTS),
        indexer=IndexerSection(pending_ttl_s=0.5, **indexer),
    )


def _state(service: RouterService) -> str:
    return {s.stream: str(s.state) for s in service.indexer.streams()}.get("w0#dp0", "")


async def _flush(session: aiohttp.ClientSession, worker: ReferenceWorker) -> None:
    async with session.post(worker.url + "/flush_cache") as resp:
        assert resp.status == 200


@contextlib.asynccontextmanager
async def _relay_process(
    worker: ReferenceWorker, nats_url: str, tmp_path: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`kvroute relay` of `worker`, its own process (killed with SIGKILL: no last word)."""
    config = tmp_path / "relay.json"
    config.write_bytes(msgspec.json.encode(relay_config(worker, nats_url, cluster=DEFAULTS)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.commands.cli", "relay", "--config", str(config),
        "--port", "0", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGKILL)
    await proc.wait()


async def _checked(service: RouterService, *, wait: bool = True) -> None:
    """A streak of false hits on w0, as the false-hit watch hands it over, acted on (`wait`:
    until the check ended; a quarantine's lasts as long as it does)."""
    supervisor = service.supervisor
    supervisor.mispredicted("w0", 304, 0)
    check = supervisor._checks.get("w0")
    assert check is not None, "the streak was not acted on"
    if wait:
        await asyncio.wait_for(asyncio.shield(check), timeout=20)


def _warnings(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and words in r.getMessage()
    ]


async def test_a_replica_that_loses_nats_predicts_nothing_of_the_relays_streams_at_once(
    nats_server: NatsServer,
) -> None:
    """Only this replica's link to NATS is cut (the relay keeps writing): its streams go
    STALE at once, not after 3 s of silence; once NATS answers again the stream reads what it
    missed (the flush) and is trusted again only at a record written after the relay was
    heard again."""
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        CuttableLink(nats_server.port) as link,
        RouterService(relay_config(w0, nats_server.url, cluster=DEFAULTS), relay=True),
        RouterService(_replica(w0, link.url)) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        await index_prompt(fleet, session)
        await eventually(lambda: _async(_state(a) == "synced"), what="the stream trusted")
        await link.cut()
        cut_at = time.monotonic()
        await _flush(session, w0)

        async def blind() -> bool:
            return _state(a) == "stale" and await predicted(fleet) == 0

        # the disconnect is said at once (ms); 3 s would be the relay's silence
        await eventually(blind, timeout_s=1.0, what="the stream to predict nothing at once")
        assert time.monotonic() - cut_at < 1.5
        await link.open()

        async def trusted_again() -> bool:
            return _state(a) == "synced"

        # meanwhile the flushed prompt is never predicted again
        deadline = time.monotonic() + 20
        while not await trusted_again():
            assert await predicted(fleet) == 0, "the flushed prompt was predicted"
            assert time.monotonic() < deadline, "the stream was not trusted again"
            await asyncio.sleep(0.02)
        assert await predicted(fleet) == 0
        # and hits come back
        await generate(session, a.url)
        await eventually(lambda: _holds(fleet), what="the prompt predicted again")


async def _async(value: bool) -> bool:
    return value


async def _holds(fleet: Fleet) -> bool:
    return await predicted(fleet) >= 64


async def test_a_killed_relays_streams_go_stale_within_its_presence_bound(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay killed, the worker flushed: the replica predicts nothing within the relay's
    presence bound (0.75 s), not its heartbeat timeout (3 s). The false-hit watch then reads
    the dead relay's records back: trusted by nothing, and said as the relay's silence, not a
    fault of sockets; a second streak leaves the worker followed (no quarantine), and the
    relay started again brings the hits back at once."""
    caplog.set_level(logging.INFO)
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        _relay_process(w0, nats_server.url, tmp_path) as proc,
        RouterService(_replica(w0, nats_server.url, stale_after_s=30.0)) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        await index_prompt(fleet, session)
        await eventually(lambda: _async(_state(a) == "synced"), what="the stream trusted")
        await asyncio.sleep(0.5)  # presences flowing
        await _kill(proc)
        killed_at = time.monotonic()
        await _flush(session, w0)

        async def blind() -> bool:
            return _state(a) == "stale" and await predicted(fleet) == 0

        await eventually(blind, timeout_s=2.0, what="the stream to predict nothing")
        # the bound is 0.75 s after the last presence; 3 s was the heartbeats' silence
        assert time.monotonic() - killed_at < 1.5
        assert _warnings(caplog, "has not said it is alive")
        # the false-hit watch: the streams read anew from the dead relay's records
        await _checked(a)
        await eventually(
            lambda: _async(a.indexer.has_worker("w0")), what="w0 followed again after the read"
        )
        await asyncio.sleep(1.0)  # its records read back (with ages well under 3 s)
        assert _state(a) == "stale" and await predicted(fleet) == 0
        said = _warnings(caplog, "reused far fewer tokens")
        assert said and "is not heard alive" in said[-1], said
        # again soon after: the relay's silence is no sign of a wrong process
        await _checked(a)
        entry = a.planner.pool.get("w0")
        assert entry.unfollowed_until is None
        assert not _warnings(caplog, "not followed for"), _warnings(caplog, "not followed")
        async with _relay_process(w0, nats_server.url, tmp_path):
            await generate(session, a.url)
            await eventually(
                lambda: _holds(fleet), timeout_s=15, what="hits again with the relay back"
            )


async def test_a_quarantine_of_a_fed_worker_ends_when_another_relay_process_writes_it(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A live relay's records keep mispredicting (twice): the worker is left unfollowed, said
    as the relay's doing; a restarted relay subscribes anew, so the quarantine ends once it is
    heard, not after its 60 s."""
    caplog.set_level(logging.INFO)
    async with (
        workers(1) as (w0,),
        aiohttp.ClientSession() as session,
        RouterService(_replica(w0, nats_server.url, stale_after_s=30.0)) as a,
    ):
        fleet = Fleet(a, {"w0": w0}, session)
        async with RouterService(relay_config(w0, nats_server.url, cluster=DEFAULTS), relay=True):
            await index_prompt(fleet, session)
            await eventually(lambda: _async(_state(a) == "synced"), what="the stream trusted")
            await _checked(a)
            await eventually(
                lambda: _async(_state(a) == "synced"),
                timeout_s=15,
                what="the stream read anew and trusted",
            )
            first = _warnings(caplog, "reused far fewer tokens")
            assert first and "read anew from the relay (epoch" in first[-1], first
            await _checked(a, wait=False)
            entry = a.planner.pool.get("w0")

            async def quarantined() -> bool:
                return entry.unfollowed_until is not None and len(
                    _warnings(caplog, "reused far fewer tokens")
                ) > len(first)

            await eventually(quarantined, what="the quarantine, said")
            second = _warnings(caplog, "reused far fewer tokens")[-1]
            assert "the relay's records of it keep disagreeing" in second, second
            assert "until another relay process writes it" in second, second
            assert "sockets reach" not in second, second
        restarted_at = time.monotonic()
        async with RouterService(relay_config(w0, nats_server.url, cluster=DEFAULTS), relay=True):

            async def followed() -> bool:
                return entry.unfollowed_until is None and a.indexer.has_worker("w0")

            await eventually(followed, timeout_s=15, what="the quarantine to end")
            assert time.monotonic() - restarted_at < 15  # not the quarantine's 60 s
            await generate(session, a.url)
            await eventually(lambda: _holds(fleet), timeout_s=15, what="hits again")
