"""A decision names its worker's server besides its id: replicas that take an id swap in one
after another apply each other's decisions where they were meant."""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import nats
from nats.aio.msg import Msg

from indexer.namespace import Namespace
from indexer.service import IndexerService, StreamConfig
from router.cluster.outbox import Outbox
from router.cluster.peers import Peers
from router.cluster.server import NatsServer
from router.cluster.wire import (
    Batch,
    Begin,
    Decision,
    Pending,
    Shadow,
    batch_decoder,
    encoder,
)
from router.config import BreakerConfig, RouterConfig, WorkerConfig
from router.http.reload import ConfigSource
from router.routing.load import LoadTracker
from router.routing.pool import WorkerPool
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import eventually

NS = Namespace("m", None, "salt")


def _body(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "cache_salt": "tenant-a", "sampling_params": {"max_new_tokens": 2}}


async def _pending(
    session: aiohttp.ClientSession, router: RouterService, prompt: str
) -> dict[str, int]:
    """The pending tokens of `prompt` per worker id, as `router` would route it."""
    status, plan = await admin(session, router, "POST", "/route?endpoint=/generate", _body(prompt))
    assert status == 200, plan
    return {c["worker"]: c["pending_tokens"] for c in plan["candidates"]}


async def _urls(session: aiohttp.ClientSession, router: RouterService) -> dict[str, str]:
    status, listed = await admin(session, router, "GET", "/workers")
    assert status == 200, listed
    return {w["id"]: w["url"] for w in listed["workers"]}


async def test_a_decision_made_before_an_id_swap_marks_the_server_it_meant(
    nats_server: NatsServer,
) -> None:
    """The QA run: replica a swapped the ids of two workers while b routed fresh prompts. A
    decision b made under the old ids reached a after its swap, and a marked the prompt
    pending on the id, now the other server, which held none of it: a predicted it a hit, and
    sent the prompt's siblings there, until the mark's TTL. The decision names the server now:
    a marks the one meant, under its id there."""
    async with workers(2) as (s1, s2), aiohttp.ClientSession() as session:
        before = [("wA", s1.url), ("wB", s2.url)]
        file: dict[str, RouterConfig] = {"a": replica_config(before, nats_server.url, "a")}
        source = ConfigSource("a.toml", lambda: file["a"])
        listener = await nats.connect(nats_server.url)
        heard: list[Batch] = []

        async def got(msg: Msg) -> None:
            heard.append(batch_decoder.decode(msg.data))

        try:
            await listener.subscribe("kvroute.replica.b", cb=got)
            async with (
                RouterService(file["a"], config_source=source) as a,
                RouterService(replica_config(before, nats_server.url, "b")) as b,
            ):
                prompt = "a prompt routed by b just before a swaps the ids " * 4
                async with session.post(b.url + "/generate", json=_body(prompt)) as resp:
                    assert resp.status == 200, await resp.text()
                    meant = resp.headers["x-kvroute-worker"]
                other = "wB" if meant == "wA" else "wA"

                async def decided() -> bool:
                    return any(isinstance(d, Pending) for h in heard for d in h.decisions)

                await eventually(decided, what="b's decision on NATS")
                (late,) = [d for h in heard for d in h.decisions if isinstance(d, Pending)]
                assert late.worker == meant
                swapped: Any = replica_config(
                    [("wA", s2.url), ("wB", s1.url)], nats_server.url, "a"
                )
                file["a"] = msgspec.structs.replace(swapped, cluster=file["a"].cluster)
                status, answer = await admin(session, a, "POST", "/reload")
                assert status == 200, answer
                urls = await _urls(session, a)
                assert (urls["wA"], urls["wB"]) == (s2.url, s1.url), urls

                async def b_swapped() -> bool:
                    return await _urls(session, b) == urls

                await eventually(b_swapped, what="b to take the swap in")
                assert a.cluster is not None
                assert a.cluster.peers.misaddressed == 0
                # b's decision reaches a only now (it left b before a swapped): sent again, as
                # from a third replica (b would take its own name for a twin's)
                late_batch = Batch("c", time.time(), [late])
                await listener.publish("kvroute.replica.c", encoder.encode(late_batch))

                async def arrived() -> bool:  # a pending mark alone: no routing decision
                    assert a.cluster is not None
                    return a.cluster.peers.misaddressed > 0

                await eventually(arrived, what="the late decision applied on a")
                # the id it named is the other server here now, which holds none of the prompt
                # (before: 192 tokens pending there, and a sibling sent there for a hit)
                assert (await _pending(session, a, prompt))[meant] == 0
                assert a.cluster.peers.misaddressed == 1
                async with session.post(a.url + "/generate", json=_body(prompt + "?")) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvroute-worker"] == other  # the server holding it
        finally:
            await listener.close()


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def _receiver(
    servers: dict[str, str],
) -> AsyncIterator[tuple[WorkerPool, Peers, str, str]]:
    """A replica's receiving side for workers wA and wB at `servers`: its pool, its `Peers`
    and the stream ids of wA and wB in its index."""
    async with IndexerService() as indexer:
        pool = WorkerPool(BreakerConfig())
        for worker, url in servers.items():
            pool.add(WorkerConfig(url=url, id=worker))
            await indexer.add_worker(worker, [StreamConfig(endpoint=_endpoint(), block_size=16)])
        peers = Peers("me", indexer, LoadTracker(), 5.0, clock=lambda: 0.0, servers=pool)
        (on_a,), (on_b,) = indexer.stream_ids("wA"), indexer.stream_ids("wB")
        yield pool, peers, on_a, on_b


async def test_a_peers_decision_goes_to_the_server_it_names_under_its_id_here() -> None:
    """Each way an id and a server can disagree between sender and receiver: the pending mark
    follows the server (to its id here, or nowhere), the shadow is applied only where the id
    names the server it was made for; a sender from before the field is taken at its word."""
    servers = {"wA": "http://127.0.0.1:1", "wB": "http://127.0.0.1:2"}
    async with _receiver(servers) as (pool, peers, on_a, on_b):
        keyed = Namespace("m", None, "salt", "view-1")
        number = itertools.count(1)

        def marked(worker: str, server: str) -> set[str]:
            """The streams a peer's pending mark naming (worker, server) lands on here."""
            n = next(number)
            pending = Pending(worker, None, NS, list(range(n, n + 64)), n, server=server)
            peers.apply(Batch("b", time.time(), [pending, Begin(n, worker, None, 64)]))
            return {stream for stream, _ in peers._peers["b"].tickets[n].pending}

        def shadowed(worker: str, server: str) -> set[str]:
            """The streams a peer's shadow naming (worker, server) lands on here."""
            n = next(number)
            shadow = Shadow(worker, None, keyed, list(range(n, n + 64)), 60.0, n, server)
            peers.apply(Batch("b", time.time(), [Begin(n, worker, None, 64), shadow]))
            return {mark[0] for mark in peers._peers["b"].tickets[n].shadows}

        assert marked("wB", servers["wB"]) == {on_b}  # both know wB as that server
        assert marked("wB", "") == {on_b}  # a sender from before the field
        assert marked("wB", servers["wA"]) == {on_a}  # the sender's wB is wA's server here
        assert marked("wC", servers["wA"]) == {on_a}  # an id not known here yet (a rename)
        assert marked("wB", "http://127.0.0.1:3") == set()  # a server not in the fleet here
        assert shadowed("wB", servers["wB"]) == {on_b}
        assert shadowed("wB", "") == {on_b}
        # the sender's wB is wA's server here: there (a shadow only hides; one not applied
        # trusts the pages it covers)
        assert shadowed("wB", servers["wA"]) == {on_a}
        assert peers.misaddressed == 4
        # a shadow kept to send again keeps the server it was made for, whatever the id names
        # by then
        outbox = Outbox(server_of=pool.server_of)
        outbox.sending = True
        outbox.shadowed(keyed, [1, 2, 3], "wB", None)
        pool.remove("wB")
        outbox.take()
        outbox.resend_shadows()
        assert [(d.worker, d.server) for d in outbox.take() if isinstance(d, Shadow)] == [
            ("wB", servers["wB"])
        ]


async def test_a_peers_decision_names_its_server_as_its_config_spells_it() -> None:
    """The replicas' configs may spell one worker's host otherwise (`[::1]` for `127.0.0.1`,
    an address for a name). A shadow was applied only where the server was spelled alike, so
    a replica dropped every shadow another sent for such a worker, and trusted the pages they
    covered (a false hit). A shadow now goes where the server may be the one meant; a pending
    mark only where it surely is (one on another server would be a false hit)."""
    servers = {"wA": "http://127.0.0.1:1", "wB": "http://worker-b.svc:2"}
    async with _receiver(servers) as (_, peers, on_a, on_b):
        keyed = Namespace("m", None, "salt", "view-1")
        number = itertools.count(1)

        def applied(worker: str, server: str) -> tuple[set[str], set[str]]:
            """The streams a peer's pending mark and shadow naming (worker, server) land on."""
            n = next(number)
            tokens = list(range(n, n + 64))
            pending = Pending(worker, None, NS, tokens, n, server=server)
            shadow = Shadow(worker, None, keyed, tokens, 60.0, n, server)
            peers.apply(Batch("b", time.time(), [pending, Begin(n, worker, None, 64), shadow]))
            ticket = peers._peers["b"].tickets[n]
            return {s for s, _ in ticket.pending}, {mark[0] for mark in ticket.shadows}

        assert applied("wA", "http://localhost:1") == ({on_a}, {on_a})  # one spelling here
        assert applied("wA", "http://[::1]:1") == ({on_a}, {on_a})  # the loopback too
        assert applied("wB", "http://10.0.0.9:2") == (set(), {on_b})  # its name's address?
        assert applied("wA", "http://10.0.0.9:1") == (set(), set())  # surely another host
        assert applied("wA", "http://127.0.0.1:3") == (set(), set())  # another port


async def test_a_peers_shadow_for_a_server_not_followed_here_yet_waits_for_its_worker() -> None:
    """A shadow naming an id this replica is still registering (in its pool, not followed
    yet), or a server no id is at here yet, is applied by the worker added at that server. A
    server whose host only may be one here keeps it too (when unsure, hide). Before, each was
    dropped (QA: a rename on another replica, 3 of 3, 288 tokens predicted, 0 cached)."""
    servers = {"wA": "http://127.0.0.1:1", "wB": "http://worker-b.svc:2"}
    async with _receiver(servers) as (pool, peers, _, on_b):
        indexer = peers._indexer
        keyed = Namespace("m", None, "salt", "view-1")
        tokens = {n: list(range(n, n + 64)) for n in (1, 2, 3)}

        def shadowed(stream: str, n: int) -> bool:
            made = indexer.index.chain_keys(stream, NS, tokens[n], 8)
            assert made is not None  # (its page size is configured)
            keys = {key for chain in made[1] for key in chain}
            return bool(keys) and keys <= set(indexer._shadowed.shadows(stream) or {})

        pool.add(WorkerConfig(url="http://127.0.0.1:3", id="wC"))  # its registration under way
        sent: list[Decision] = [
            Shadow("wC", None, keyed, tokens[1], 60.0, 1, "http://127.0.0.1:3"),
            Shadow("wD", None, keyed, tokens[2], 60.0, 2, "http://127.0.0.1:4"),  # none there
            Shadow("wB", None, keyed, tokens[3], 60.0, 3, "http://10.0.0.9:2"),  # wB's, maybe
        ]
        peers.apply(Batch("b", time.time(), sent))
        assert shadowed(on_b, 3)
        pool.add(WorkerConfig(url="http://127.0.0.1:4", id="wD"))
        for worker, n in (("wC", 1), ("wD", 2)):
            url = pool.server_of(worker)
            assert url is not None
            await indexer.add_worker(
                worker, [StreamConfig(endpoint=_endpoint(), block_size=16)], url=url
            )
            (stream,) = indexer.stream_ids(worker)
            assert shadowed(stream, n), worker
        assert len(indexer._waiting) == 1  # wB's, kept for the server it may be


def test_a_decision_naming_its_server_is_read_by_a_replica_from_before_the_field() -> None:
    """Fields are appended with defaults: an older replica decodes the decision whole but for
    the server (and takes the id at its word, as before)."""

    class OldPending(msgspec.Struct, tag="pending", array_like=True, frozen=True):
        worker: str
        dp_rank: int | None
        namespace: Namespace
        tokens: list[int]
        ticket: int = 0
        kept_tokens: int = 0
        held_tokens: int = 0
        block_size: int = 0
        keys: list[int] = []

    new = Pending("wB", 1, NS, [1, 2], 7, 3, 4, 16, [9], "http://127.0.0.1:2")
    old = msgspec.msgpack.decode(encoder.encode(new), type=OldPending)
    assert old == OldPending("wB", 1, NS, [1, 2], 7, 3, 4, 16, [9])
    # and an older sender's comes with none: the receiver takes the id as it is
    (decision,) = batch_decoder.decode(encoder.encode(["b", 0.0, [old]])).decisions
    assert isinstance(decision, Pending) and decision.server == ""
