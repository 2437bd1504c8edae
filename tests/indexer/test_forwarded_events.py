"""A worker whose KV events reach the router through an XSUB/XPUB forwarder, its replay socket
direct: restarts, and events that come from another worker's PUB.

The router's SUB is connected to the forwarder, which stays up while the worker behind it
restarts: the SUB never sees the process go. The replay DEALER is connected to the worker's
process itself, and its connection dropping is the restart candidate
(`indexer.stream.restart_candidates`'s `_replay_link`). And events that come from another
publisher than the replay socket's (`events` on another worker's PUB, the forwarder re-pointed)
make the two disagree: nothing is predicted until they agree (`_disagree`). Real reference
workers, stopped and started again on the same ports; a real forwarder
(`tests.indexer.forwarder`). No idle probe runs within a test (`PROBE_S`): what finds a restart
here is not a probe that happens to fall in the right moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.namespace import Namespace
from indexer.service import IndexerService
from indexer.stats import StreamState
from tests.indexer.forwarder import Forwarder
from workers.cache import Namespace as CacheNamespace
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

MODEL = "m"
WORKER = "w"
PROBE_S = 30.0  # far beyond any test: no idle probe finds what is tested here
SETTINGS = IndexerConfig(probe_interval_s=PROBE_S, replay_timeout_s=1.0)


def tokens(tag: str) -> list[int]:
    """A prompt of 80 tokens (5 pages of 16) that shares no page with another tag's."""
    text = (f"[{tag}] " + "lorem ipsum dolor sit amet " * 4).encode()[:80]
    return [3 + byte for byte in text]


class Restartable:
    """A reference worker that stops and starts again on the same ports (a restart)."""

    def __init__(self, dp_size: int = 1) -> None:
        self.config = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=dp_size)
        self.worker: ReferenceWorker | None = None

    async def start(self) -> ReferenceWorker:
        worker = await ReferenceWorker(self.config).__aenter__()
        kv = worker.kv_events
        port = int(worker.url.rpartition(":")[2])
        self.config = msgspec.structs.replace(
            self.config,
            port=port,
            events_port=kv.endpoint_port_base,
            replay_port=kv.replay_endpoint_port_base,
        )
        self.worker = worker
        return worker

    async def stop(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            await worker.__aexit__(None, None, None)

    @property
    def live(self) -> ReferenceWorker:
        assert self.worker is not None
        return self.worker

    def next_seq(self, rank: int = 0) -> int:
        return self.live.ranks[rank].publisher.next_seq

    def holds(self, prompt: list[int]) -> list[int]:
        """What each rank caches of `prompt`, from the worker itself."""
        return self.live.match(CacheNamespace(cache_salt=None), prompt)


async def generate(
    session: aiohttp.ClientSession, worker: ReferenceWorker, prompt: list[int], rank: int = 0
) -> None:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 1},
        "routed_dp_rank": rank,
    }
    async with session.post(f"{worker.url}/generate", json=body) as response:
        assert response.status == 200, await response.text()


def predicted(svc: IndexerService, prompt: list[int]) -> list[int]:
    """The tokens of `prompt` the index predicts on each rank of the worker."""
    return [r.matched_tokens for r in svc.query(Namespace(MODEL, None, None), prompt)[WORKER].ranks]


async def until(
    predicate: Callable[[], bool],
    what: str,
    timeout_s: float = 10.0,
    seen: Callable[[], object] | None = None,
) -> None:
    """Wait for `predicate`; on a timeout, say what `seen` shows then."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():  # noqa: ASYNC110 (the service has no event for these)
                await asyncio.sleep(0.01)
    except TimeoutError:
        shown = "" if seen is None else f" (seen: {seen()})"
        raise AssertionError(f"timed out waiting for {what}{shown}") from None


def restarts_and_states(svc: IndexerService) -> list[tuple[int, StreamState]]:
    return [(s.restarts, s.state) for s in sorted(svc.streams(), key=lambda s: s.dp_rank)]


def streams_of(svc: IndexerService) -> list[StreamState]:
    return [s.state for s in sorted(svc.streams(), key=lambda s: s.dp_rank)]


async def forwarded_worker(
    svc: IndexerService,
    worker: Restartable,
    forwarders: list[Forwarder],
    replays: list[str] | None = None,
) -> None:
    """Subscribe `worker`: each rank's events through its forwarder, its replay direct or
    through `replays` (and wait until the subscriptions reached the worker: a batch published
    before is lost)."""
    kv = worker.live.kv_events
    await svc.add_worker(
        WORKER,
        [
            StreamConfig(
                endpoint=fwd.endpoint,
                replay_endpoint=replay,
                block_size=16,
                model=MODEL,
                dp_rank=rank,
                replay_proven=False,  # its advertised event sockets are not these
            )
            for rank, (fwd, replay) in enumerate(
                zip(forwarders, replays or kv.replay_endpoints, strict=True)
            )
        ],
    )
    for fwd in forwarders:
        await fwd.subscribed()


async def test_a_restart_behind_a_forwarder_whose_next_batch_follows_on_is_found(
    ctx: zmq.asyncio.Context,
) -> None:
    """The forwarder's path to the worker is away while the worker restarts: the new
    process's batches up to the dead run's last seq L are lost, and its batch L + 1 arrives
    live. It followed on in seq and was applied; it then was the fence every later probe
    proved against the new process: the dead process's P was predicted for good (QA: 288
    tokens, 0 cached). Its replay connection dropped with the dead process: now the stream
    predicts nothing from then on, and the proof once it is back finds the restart."""
    worker = Restartable()
    await worker.start()
    try:
        async with (
            Forwarder(ctx, worker.live.kv_events.endpoint) as fwd,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd.connected(1)
            await forwarded_worker(svc, worker, [fwd])
            P = tokens("dead")
            for i in range(4):  # the dead run: seqs 0 (startup) .. L
                await generate(session, worker.live, tokens(f"dead-{i}"))
            await generate(session, worker.live, P)
            last = worker.next_seq() - 1
            await until(
                lambda: (
                    svc.streams()[0].last_seq == last and streams_of(svc) == [StreamState.SYNCED]
                ),
                "the dead run applied",
            )
            assert predicted(svc, P) == [80]

            fwd.dropping = True  # its path to the worker is away a moment
            await worker.stop()
            await worker.start()
            await fwd.connected(2)  # the forwarder reaches the new process (and drops)
            i = 0
            while worker.next_seq() < last + 1:  # its batches up to seq L are lost
                await generate(session, worker.live, tokens(f"lost-{i}"))
                i += 1
            # lost in the forwarder, or at the new PUB before the forwarder's subscription
            # reached it (under load): either way the stream never saw them
            assert worker.next_seq() == last + 1
            fwd.dropping = False
            R = tokens("new")
            forwarded = fwd.forwarded
            await generate(session, worker.live, R)  # seq L + 1: follows on the dead run
            await until(lambda: fwd.forwarded > forwarded, "the new batch to be forwarded")
            await until(
                lambda: predicted(svc, R) == [80] and streams_of(svc) == [StreamState.SYNCED],
                "the new process's batch to be predicted",
            )
            assert worker.holds(P) == [0]
            assert predicted(svc, P) == [0]  # the dead process's page is not predicted
            await asyncio.sleep(0.5)
            assert predicted(svc, P) == [0]
            assert svc.streams()[0].restarts >= 1
    finally:
        await worker.stop()


async def test_a_worker_dying_behind_forwarders_predicts_nothing_at_once(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """Two dp ranks, each rank's events through a forwarder: a restart was invisible until
    a new batch or a probe (QA: the first request after a 0.3 s restart matched 288, 0
    cached; both ranks stayed synced ~0.7 s). Each rank's replay connection drops with the
    process: both predict nothing at once, before any batch of the new process, and are
    rebuilt from it once it is back (the quiet rank 1 too). The new process's buffer came by
    replay only, though published to the SUBs' connections (the forwarders outlived the dead
    process): each rank is trusted once a live batch of the new run follows on (the path
    may be deaf: `Repair._undelivered_since`), the quiet rank 1 not yet."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    worker = Restartable(dp_size=2)
    await worker.start()
    try:
        kv = worker.live.kv_events
        async with (
            Forwarder(ctx, kv.endpoints[0]) as fwd0,
            Forwarder(ctx, kv.endpoints[1]) as fwd1,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd0.connected(1)
            await fwd1.connected(1)
            await forwarded_worker(svc, worker, [fwd0, fwd1])
            P = tokens("dead")
            for rank in range(2):
                await generate(session, worker.live, P, rank)
            await until(lambda: predicted(svc, P) == [80, 80], "P on both ranks")

            await worker.stop()
            # nothing of the new process has come (no batch, no probe): the drop alone
            await until(lambda: predicted(svc, P) == [0, 0], "both ranks to predict nothing")
            assert StreamState.SYNCED not in streams_of(svc)
            assert "the replay connection dropped" in caplog.text

            await worker.start()
            unproven = [StreamState.UNVERIFIED] * 2
            await until(
                lambda: (
                    [s.restarts for s in svc.streams()] == [1, 1] and streams_of(svc) == unproven
                ),
                "both ranks rebuilt, unproven until the new process publishes",
                seen=lambda: restarts_and_states(svc),
            )
            await fwd0.connected(2)  # (its subscriptions reach the new process)
            assert worker.holds(P) == [0, 0] and predicted(svc, P) == [0, 0]
            Q = tokens("new")
            await generate(session, worker.live, Q, 0)
            await until(lambda: predicted(svc, Q) == [80, 0], "the new process's batch")
            assert streams_of(svc) == [StreamState.SYNCED, StreamState.UNVERIFIED]
            assert predicted(svc, P) == [0, 0]
    finally:
        await worker.stop()


async def test_a_restart_found_before_the_new_process_is_up_waits_for_its_live_batch(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, but rank 0's proof (asked as rank 1's replay connection dropped) reaches the
    dying process and drops before its answer ends (CI, one run in many): the restart is
    found before the new process is up, and the new process's buffer, read by the retry's
    replay, was trusted whole (`synced`) though nothing showed the forwarder reached the new
    process: the seq its SUB heard last was the dead run's, judged as the new one's. It waits
    for a live batch of the new run, as when the new process's answer finds the restart."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    worker = Restartable(dp_size=2)
    await worker.start()
    kv = worker.live.kv_events
    relay = TcpRelay(int(kv.replay_endpoints[0].rpartition(":")[2]))
    await relay.start()
    try:
        async with (
            Forwarder(ctx, kv.endpoints[0]) as fwd0,
            Forwarder(ctx, kv.endpoints[1]) as fwd1,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd0.connected(1)
            await fwd1.connected(1)
            replays = [f"tcp://127.0.0.1:{relay.port}", kv.replay_endpoints[1]]
            await forwarded_worker(svc, worker, [fwd0, fwd1], replays)
            P = tokens("dead")
            for rank in range(2):
                await generate(session, worker.live, P, rank)
            await until(lambda: predicted(svc, P) == [80, 80], "P on both ranks")

            # rank 0's proof reaches a process that dies unanswering (whichever comes first,
            # the proof or the death: the hop hides the close until the heartbeat drops it)
            relay.swallowing = relay.sticky = True
            await worker.stop()
            cut = "its replay from seq 1 did not answer to its end"
            await until(lambda: cut in caplog.text, "rank 0's proof cut with the process")
            assert [s.restarts for s in svc.streams()] == [1, 0]
            relay.swallowing = relay.sticky = False
            await relay.cut()
            await worker.start()
            unproven = [StreamState.UNVERIFIED] * 2
            await until(
                lambda: (
                    [s.restarts for s in svc.streams()] == [1, 1] and streams_of(svc) == unproven
                ),
                "both ranks rebuilt, unproven until the new process publishes",
                seen=lambda: restarts_and_states(svc),
            )
            await fwd0.connected(2)
            Q = tokens("new")
            await generate(session, worker.live, Q, 0)
            await until(lambda: predicted(svc, Q) == [80, 0], "the new process's batch")
            assert streams_of(svc) == [StreamState.SYNCED, StreamState.UNVERIFIED]
            assert predicted(svc, P) == [0, 0]
    finally:
        await relay.close()
        await worker.stop()


async def test_a_replay_connection_that_drops_without_a_restart_keeps_the_entries(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The replay socket's connection drops and comes back, the worker unchanged (a network
    blip): the stream predicts nothing meanwhile and is proven once it is back, its entries
    kept (the proof's fence is the very batch it applied)."""
    worker = Restartable()
    await worker.start()
    try:
        kv = worker.live.kv_events
        async with (
            Forwarder(ctx, kv.endpoint) as fwd,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd.connected(1)
            # the replay socket through a forwarder of its own: dropped and made again
            # without the worker knowing
            relay = TcpRelay(int(kv.replay_endpoint.rpartition(":")[2]))
            await relay.start()
            try:
                await _relayed_worker(svc, fwd, relay)
                await until(lambda: streams_of(svc) == [StreamState.SYNCED], "the stream")
                P = tokens("kept")
                await generate(session, worker.live, P)
                await until(lambda: predicted(svc, P) == [80], "P predicted")
                caplog.set_level(logging.WARNING, logger="indexer.stream")
                before = svc.streams()[0]
                verified = before.verifications
                await relay.cut()  # the open connections go; new ones are taken again
                await until(lambda: "the replay connection dropped" in caplog.text, "the drop")
                await until(
                    lambda: (
                        svc.streams()[0].verifications > verified
                        and streams_of(svc) == [StreamState.SYNCED]
                    ),
                    "the proof once it is back",
                )
                assert predicted(svc, P) == [80]
                stats = svc.streams()[0]
                assert (stats.restarts, stats.clears) == (before.restarts, before.clears)
            finally:
                await relay.close()
    finally:
        await worker.stop()


class TcpRelay:
    """A loopback TCP relay to `target` whose open connections can be cut. Switches: `held`
    (bytes wait in the relay, both ways, until cleared: a worker that is slow to answer),
    `sticky` (an upstream that closes is not closed downstream: a hop that hides the worker
    going away), `refusing` (new connections are closed at once: the worker unreachable) and
    `swallowing` (what comes from downstream is dropped: a request the worker never reads)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.sticky = False
        self.refusing = False
        self.swallowing = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def held(self) -> bool:
        return not self._flowing.is_set()

    @held.setter
    def held(self, held: bool) -> None:
        if held:
            self._flowing.clear()
        else:
            self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, downstream: bool
        ) -> None:
            try:
                while data := await src.read(65536):
                    if self.swallowing and not downstream:
                        continue
                    await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                if not (downstream and self.sticky):
                    dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, downstream=False), pipe(up_reader, writer, downstream=True)
        )

    async def cut(self) -> None:
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()

    async def close(self) -> None:
        self.held = False
        await self.cut()
        if self._server is not None:
            self._server.close()


async def _never_predicted(
    svc: IndexerService, prompts: list[list[int]], seconds: float
) -> list[tuple[int, list[int]]]:
    """Every (prompt index, prediction) with a token predicted, polled for `seconds`."""
    seen: list[tuple[int, list[int]]] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        seen += [(i, p) for i, prompt in enumerate(prompts) if any(p := predicted(svc, prompt))]
        await asyncio.sleep(0.01)
    return seen


async def test_events_of_another_workers_pub_predict_nothing_and_the_log_says_which(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`events` on another worker's PUB, `replay` right (QA: the router blamed the replay
    socket, "another publisher's", and followed the wrong events: the other worker's prompts
    predicted here for good). The two disagree: the stream predicts nothing, and one ERROR
    names both sockets and, by what the worker advertises, the event socket as the suspect."""
    caplog.set_level(logging.ERROR, logger="indexer.stream")
    own, other = Restartable(), Restartable()
    await own.start()
    await other.start()
    try:
        async with IndexerService(SETTINGS) as svc, aiohttp.ClientSession() as session:
            history = tokens("own-history")
            await generate(session, own.live, history)  # buffered in its replay socket
            mine, theirs = own.live.kv_events, other.live.kv_events
            await svc.add_worker(
                WORKER,
                [
                    StreamConfig(
                        endpoint=theirs.endpoint,  # the typo
                        replay_endpoint=mine.replay_endpoint,
                        block_size=16,
                        model=MODEL,
                        replay_proven=False,  # (its advertised event socket is not this)
                        advertised_endpoint=mine.endpoint,
                        advertised_replay=mine.replay_endpoint,
                    )
                ],
            )
            await asyncio.sleep(0.3)  # the SUB connects (a batch before it is lost)
            prompts = [tokens(f"other-{i}") for i in range(4)]
            for prompt in prompts:
                await generate(session, other.live, prompt)
                await generate(session, own.live, tokens(f"own-{prompts.index(prompt)}"))
            seen = await _never_predicted(svc, [history, *prompts], 1.5)
            assert not seen, seen  # (index 0: this worker's own history)
            assert streams_of(svc) == [StreamState.UNVERIFIED]
            line = caplog.text
            assert (
                f"its event socket {theirs.endpoint} and its replay socket "
                f"{mine.replay_endpoint} disagree about the publisher"
            ) in line
            assert "another publisher's" not in line  # no socket is blamed on the bytes alone
            assert (
                "the replay socket is the one the worker advertises and the event socket is "
                f"not (it advertises {mine.endpoint}): check `events`"
            ) in line
    finally:
        await own.stop()
        await other.stop()


async def test_a_forwarder_repointed_at_another_pub_predicts_nothing_until_it_is_back(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The forwarder the worker's events come through is re-pointed at another worker's PUB
    (QA: that worker's batch at the seq applied showed as an "odd frame", skipped, and its
    next one, following on, was applied: its prompts predicted here). The live stream and the
    replay socket disagree: nothing is predicted; once the forwarder is back on the worker,
    its next batch is one the replay socket gives back, and the stream is rebuilt from it."""
    caplog.set_level(logging.WARNING, logger="indexer.stream")
    own, other = Restartable(), Restartable()
    await own.start()
    await other.start()
    try:
        mine, theirs = own.live.kv_events, other.live.kv_events
        async with (
            Forwarder(ctx, mine.endpoint) as fwd,
            IndexerService(SETTINGS) as svc,
            aiohttp.ClientSession() as session,
        ):
            await fwd.connected(1)
            await svc.add_worker(
                WORKER,
                [
                    StreamConfig(
                        endpoint=fwd.endpoint,
                        replay_endpoint=mine.replay_endpoint,
                        block_size=16,
                        model=MODEL,
                        # the worker advertises these very sockets (a forwarder's address)
                        advertised_endpoint=fwd.endpoint,
                        advertised_replay=mine.replay_endpoint,
                    )
                ],
            )
            await fwd.subscribed()
            P = tokens("own")
            await generate(session, own.live, P)
            await until(lambda: predicted(svc, P) == [80], "P predicted")
            # the other worker has published as many batches as this one: its next one
            # lands on the seq applied last
            while other.next_seq() < own.next_seq() - 1:
                await generate(session, other.live, tokens(f"other-early-{other.next_seq()}"))
            fwd.repoint(theirs.endpoint)
            await fwd.connected(2)
            prompts = [tokens(f"other-{i}") for i in range(4)]
            for prompt in prompts:
                await generate(session, other.live, prompt)
            seen = await _never_predicted(svc, prompts, 1.0)
            assert not seen, seen
            assert predicted(svc, P) == [0]  # this worker's evictions are not heard now
            assert streams_of(svc) == [StreamState.UNVERIFIED]
            assert "both are the sockets the worker advertises" in caplog.text

            fwd.repoint(mine.endpoint)
            await fwd.connected(3)
            await asyncio.sleep(1.0)  # (`_AGREE_EVERY_S` since the last batch asked for)
            W = tokens("own-again")
            await generate(session, own.live, W)
            await until(
                lambda: predicted(svc, W) == [80] and streams_of(svc) == [StreamState.SYNCED],
                "the stream rebuilt once they agree",
            )
            assert "agree again" in caplog.text
            assert predicted(svc, P) == [80]  # rebuilt from the worker's own buffer
            assert not any(any(predicted(svc, prompt)) for prompt in prompts)
    finally:
        await own.stop()
        await other.stop()


# an idle probe often, answered or not within a test: what times out here is a probe
PROBING = IndexerConfig(probe_interval_s=0.3, replay_timeout_s=0.5)


async def _relayed_worker(svc: IndexerService, fwd: Forwarder, relay: TcpRelay) -> None:
    """Subscribe the worker: its events through `fwd`, its replay socket through `relay`."""
    await svc.add_worker(
        WORKER,
        [
            StreamConfig(
                endpoint=fwd.endpoint,
                replay_endpoint=f"tcp://127.0.0.1:{relay.port}",
                block_size=16,
                model=MODEL,
            )
        ],
    )
    await fwd.subscribed()


async def _proven_by_a_probe(svc: IndexerService, P: list[int], last: int) -> None:
    """Wait until `P` (applied at seq `last`) is predicted and a probe answered after it."""
    await until(
        lambda: predicted(svc, P) == [80] and svc.streams()[0].last_seq == last, "P predicted"
    )
    probes = svc.streams()[0].probes
    await until(lambda: svc.streams()[0].probes >= probes + 2, "a probe answered after P")
    assert predicted(svc, P) == [80]


async def _restart_losing_its_first_batches(
    session: aiohttp.ClientSession, worker: Restartable, fwd: Forwarder, relay: TcpRelay
) -> list[int]:
    """Restart the worker, its replay unreachable and its batches up to the dead run's last
    seq lost on the forwarder's path, and publish its next batch, which follows on the dead
    run in seq; the replay reachable again once it was forwarded. Returns that batch's prompt."""
    last = worker.next_seq() - 1
    fwd.dropping = True
    relay.refusing = True
    await worker.stop()
    await worker.start()
    await fwd.connected(2)
    i = 0
    while worker.next_seq() < last + 1:
        await generate(session, worker.live, tokens(f"lost-{i}"))
        i += 1
    assert worker.next_seq() == last + 1
    await asyncio.sleep(0.2)  # (read and dropped by the forwarder, not passed on late)
    fwd.dropping = False
    R = tokens("new")
    forwarded = fwd.forwarded
    await generate(session, worker.live, R)
    await until(lambda: fwd.forwarded > forwarded, "the new batch to be forwarded")
    await asyncio.sleep(0.3)  # taken by the stream (applied, or skipped while a proof is owed)
    relay.refusing = False
    return R


async def _restart_found(
    svc: IndexerService, worker: Restartable, P: list[int], R: list[int]
) -> None:
    await until(
        lambda: (
            predicted(svc, R) == [80]
            and predicted(svc, P) == [0]
            and streams_of(svc) == [StreamState.SYNCED]
        ),
        "the restart found and the new process's batch predicted",
        timeout_s=5.0,
    )
    assert worker.holds(P) == [0]
    await asyncio.sleep(0.5)
    assert predicted(svc, P) == [0]
    assert svc.streams()[0].restarts >= 1


class Hops(msgspec.Struct):
    """A worker behind both hops (`behind_hops`): events through a forwarder, replay through
    a TCP relay, followed by `svc`."""

    worker: Restartable
    fwd: Forwarder
    relay: TcpRelay
    svc: IndexerService
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def behind_hops(
    ctx: zmq.asyncio.Context,
    settings: IndexerConfig,
    *,
    sticky: bool = False,
    worker: Restartable | None = None,
) -> AsyncIterator[Hops]:
    """A restartable worker (`worker`, or one of the defaults) whose events reach a new
    indexer through a forwarder and whose replay socket through a `TcpRelay` (`sticky`:
    keeping our side open while the worker's closes), followed; everything stopped after
    the block."""
    worker = worker or Restartable()
    await worker.start()
    try:
        kv = worker.live.kv_events
        relay = TcpRelay(int(kv.replay_endpoint.rpartition(":")[2]))
        relay.sticky = sticky
        await relay.start()
        try:
            async with (
                Forwarder(ctx, kv.endpoint) as fwd,
                IndexerService(settings) as svc,
                aiohttp.ClientSession() as session,
            ):
                await fwd.connected(1)
                await _relayed_worker(svc, fwd, relay)
                yield Hops(worker, fwd, relay, svc, session)
        finally:
            await relay.close()
    finally:
        await worker.stop()


async def test_a_worker_restarted_while_its_replay_answer_hung_is_found(
    ctx: zmq.asyncio.Context,
) -> None:
    """A worker hangs: a probe's answer times out, its DEALER is reset, and the new
    connection never completes its handshake. The worker is killed and restarted, its first
    batches lost behind the forwarder, its next one following on the dead run's seq. The new
    connection's end was no drop (never made) and the timeout only left the tail unproven:
    that batch followed on, was trusted, and the dead process's P was predicted for good (QA:
    288 tokens, 0 cached). Now the unanswered replay counts as a drop: the proof it owes,
    asked once the replay is back, finds the restart."""
    async with behind_hops(ctx, PROBING) as h:
        P = tokens("dead")
        await generate(h.session, h.worker.live, P)
        await _proven_by_a_probe(h.svc, P, h.worker.next_seq() - 1)
        unanswered = h.svc.streams()[0].unanswered_replays
        h.relay.held = True  # hung: nothing it is sent is answered, no handshake either
        await until(
            lambda: h.svc.streams()[0].unanswered_replays > unanswered, "a probe unanswered"
        )
        await h.relay.cut()  # killed: its connections close
        h.relay.held = False
        R = await _restart_losing_its_first_batches(h.session, h.worker, h.fwd, h.relay)
        await _restart_found(h.svc, h.worker, P, R)


async def test_a_restart_behind_a_replay_hop_that_hides_it_is_found(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay socket is reached through a hop that keeps our side of the connection open
    while the worker restarts behind it (QA: a TCP proxy): the DEALER sees no drop at all,
    and the new process's batch that follows on the dead run's seq is applied as a
    continuation. The next probe's answer does not come (nothing is behind our connection):
    that is a drop now, and the proof it owes asks from the batch the last answered probe
    proved, not the newest one (which the new process would give back): the restart is found.
    Before, the dead process's P was predicted for good."""
    async with behind_hops(ctx, PROBING, sticky=True) as h:
        P = tokens("dead")
        await generate(h.session, h.worker.live, P)
        await _proven_by_a_probe(h.svc, P, h.worker.next_seq() - 1)
        R = await _restart_losing_its_first_batches(h.session, h.worker, h.fwd, h.relay)
        await _restart_found(h.svc, h.worker, P, R)


async def test_a_slow_replay_answer_costs_one_proof_and_keeps_the_entries(
    ctx: zmq.asyncio.Context,
) -> None:
    """A worker that is only slow: a probe's answer times out (a drop now: the stream
    predicts nothing), and once its bytes come the stream is proven in one round trip, its
    entries kept, nothing cleared."""
    async with behind_hops(ctx, PROBING) as h:
        P = tokens("kept")
        await generate(h.session, h.worker.live, P)
        await _proven_by_a_probe(h.svc, P, h.worker.next_seq() - 1)
        before = h.svc.streams()[0]
        h.relay.held = True
        await until(
            lambda: h.svc.streams()[0].unanswered_replays > before.unanswered_replays,
            "a probe unanswered",
        )
        assert predicted(h.svc, P) == [0]
        h.relay.held = False
        await until(
            lambda: predicted(h.svc, P) == [80] and streams_of(h.svc) == [StreamState.SYNCED],
            "proven once its bytes come",
            timeout_s=1.5,
        )
        stats = h.svc.streams()[0]
        assert (stats.restarts, stats.clears) == (before.restarts, before.clears)


async def test_a_replay_outage_longer_than_its_timeout_while_events_flow_is_rebuilt(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay path is away for longer than `replay_timeout_s` while the worker publishes.
    Before, each live batch asked for the proof at once although the replay connection was
    away: it timed out, the stream was cleared as after a restart, the batches after it were
    skipped as the dead run's and the window's end cleared it again: never rebuilt (QA: Q
    predicted 0 with 288 cached, 15 s after the path healed, a restart counted). Now nothing
    is asked while it is away: once back, the proof from the fence brings what was published
    meanwhile, nothing cleared."""
    async with behind_hops(ctx, SETTINGS) as h:
        await until(lambda: streams_of(h.svc) == [StreamState.SYNCED], "the stream")
        P = tokens("before")
        await generate(h.session, h.worker.live, P)
        await until(lambda: predicted(h.svc, P) == [80], "P predicted")
        before = h.svc.streams()[0]
        h.relay.refusing = True
        await h.relay.cut()
        await until(lambda: predicted(h.svc, P) == [0], "the drop seen")
        Q, S = tokens("during"), tokens("later")
        await generate(h.session, h.worker.live, Q)
        await asyncio.sleep(1.5)  # past the replay timeout, events flowing
        await generate(h.session, h.worker.live, S)
        await asyncio.sleep(0.5)
        h.relay.refusing = False
        await until(
            lambda: (
                predicted(h.svc, Q) == [80]
                and predicted(h.svc, S) == [80]
                and streams_of(h.svc) == [StreamState.SYNCED]
            ),
            "rebuilt once the path is back",
            timeout_s=3.0,
        )
        stats = h.svc.streams()[0]
        assert stats.restarts == before.restarts
