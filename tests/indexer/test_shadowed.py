"""Prefixes sent with an `extra_key`: their events look plain, so plain queries do not trust them.

The bookkeeping alone (`ShadowedPrefixes`), then the service over a scripted publisher on real
ZMQ sockets: a prompt shadowed before the stream's block size is known is shadowed once its
first events say the size (the events of that very prompt among them).
"""

from __future__ import annotations

import msgspec
import pytest
import zmq.asyncio

from indexer.config import StreamConfig
from indexer.namespace import Namespace
from indexer.protocol.events import BlockHash, Event, EventBatch, Removed, Stored, TokenId
from indexer.server_stream import server_stream
from indexer.service import IndexerService
from indexer.shadowed import MOVE_GRACE_S, ShadowedPrefixes, trusted_blocks
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_subscriber_zmq import CONFIG, STREAM, WORKER, connect, wait_until

PROMPT: list[TokenId] = list(range(1000, 1000 + 33))  # two 16-token pages and a last token
OTHER: list[TokenId] = list(range(2000, 2000 + 17))


def test_a_shadow_outlives_its_time_while_the_stream_holds_its_key() -> None:
    shadows = ShadowedPrefixes()
    shadows.mark("s", [7], 7, "k", until=10.0)
    shadows.mark("s", [7], 7, "k", until=5.0)  # an earlier time never shortens it
    shadows.mark("s", [8], 8, "k", until=10.0)
    shadows.mark("t", [7], 7, "k", until=10.0)
    assert len(shadows) == 3 and {k: v[0] for k, v in shadows.shadows("s").items()} == {  # type: ignore[union-attr]
        7: 10.0,
        8: 10.0,
    }
    held = {("s", 7)}

    def holds(stream: str, keys: object) -> list[bool]:
        return [(stream, key) in held for key in keys]  # type: ignore[attr-defined]

    assert shadows.sweep(9.0, holds) == 0  # in their time: kept, held or not
    assert shadows.sweep(11.0, holds) == 2  # past it: only the held one stays
    assert list(shadows.shadows("s") or ()) == [7] and shadows.shadows("t") is None
    held.clear()
    assert shadows.sweep(11.0, holds) == 1
    assert not shadows and shadows.shadows("s") is None


def test_a_plain_block_is_trusted_only_beyond_the_extra_keys_that_may_hold_it() -> None:
    """Blocks 1..4 of a plain chain from seed 0; an extra_key prompt shared blocks 1 and 2."""
    shadows = ShadowedPrefixes()
    shadows.mark("s", [1, 2, 9], 9, "a", until=10.0)  # diverges after block 2: tail 9
    table = shadows.shadows("s")
    assert table is not None
    held = {1: 1, 2: 1, 3: 1, 4: 1}
    again: dict[int, int] = {}

    def copies(keys: object, stream: str = "s") -> dict[int, int]:
        again.clear()
        again.update({k: n - 1 for k, n in held.items() if n > 1})
        return again

    chain = [1, 2, 3, 4]
    # block 4 is on no extra_key's chain: every copy of it is plain, so are its ancestors
    assert trusted_blocks(table, 0, chain, copies(chain)) == 4
    # its tail on the chain: blocks 3, 4 may be its copies (output), 1, 2 its prompt's
    shadows.mark("s", [1, 2], 2, "b", until=10.0)
    assert trusted_blocks(table, 0, chain, copies(chain)) == 0
    held[2] = 2  # two copies of block 2, but two extra_keys may hold one each
    assert trusted_blocks(table, 0, chain, copies(chain)) == 0
    held[2] = 3  # a third: the plain one
    assert trusted_blocks(table, 0, chain, copies(chain)) == 2
    held[4] = 2  # beyond b's tail only b may hold one: two copies, one plain
    assert trusted_blocks(table, 0, chain, copies(chain)) == 4
    # the same extra_key again counts once; a prompt with no full block tails the seed
    shadows.mark("s", [1, 2], 2, "b", until=20.0)
    assert trusted_blocks(table, 0, chain, copies(chain)) == 4
    shadows.mark("s", [], 0, "c", until=20.0)
    assert trusted_blocks(table, 0, chain, copies(chain)) == 0  # c may hold a copy of any block
    held[2] = 4
    assert trusted_blocks(table, 0, chain, copies(chain)) == 2


async def test_a_prompt_shadowed_before_the_block_size_is_known(
    ctx: zmq.asyncio.Context,
) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        assert svc.index.block_size(STREAM) is None  # no page stored yet: size unknown
        svc.shadow(Namespace("", None, "t", "view"), PROMPT, WORKER, None, keep_s=60.0)
        # the worker stores that prompt for its extra_key, and another one: the events show
        # both as pages of the salt's plain namespace
        events: list[Event] = [
            Stored(block_hashes=[1, 2], parent=None, token_ids=PROMPT[:32], block_size=16,
                   cache_salt="t"),
            Stored(block_hashes=[3], parent=None, token_ids=OTHER[:16], block_size=16,
                   cache_salt="t"),
        ]  # fmt: skip
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, events)))
        plain = Namespace("", None, "t")
        assert svc.query(plain, PROMPT)[WORKER].matched_tokens == 0  # shadowed
        assert svc.query(plain, OTHER)[WORKER].matched_tokens == 16  # not
        # the request's own namespace never trusted events anyway; another salt has none
        assert svc.query(Namespace("", None, "u"), PROMPT)[WORKER].matched_tokens == 0


async def test_a_shadow_is_on_the_rank_the_request_went_to(ctx: zmq.asyncio.Context) -> None:
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        events: list[Event] = [
            Stored(block_hashes=[1], parent=None, token_ids=PROMPT[:16], block_size=16)
        ]
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, events)))
        plain = Namespace("", None, None)
        assert svc.query(plain, PROMPT)[WORKER].matched_tokens == 16
        svc.shadow(Namespace("", None, None, "view"), PROMPT, WORKER, 3, keep_s=60.0)
        assert svc.query(plain, PROMPT)[WORKER].matched_tokens == 16  # a rank it lacks
        svc.shadow(plain, PROMPT, WORKER, 0, keep_s=60.0)  # no extra_key: nothing to hide
        assert svc.query(plain, PROMPT)[WORKER].matched_tokens == 16
        svc.shadow(Namespace("", None, None, "view"), PROMPT, WORKER, 0, keep_s=60.0)
        assert svc.query(plain, PROMPT)[WORKER].matched_tokens == 0


def test_a_withdrawn_shadow_goes_back_to_what_it_was() -> None:
    """A request with an extra_key that stored nothing takes its shadow back, unless a later
    shadow of the same key extended it."""
    shadows = ShadowedPrefixes()
    first = shadows.mark("s", [7], 7, "k", until=10.0)
    second = shadows.mark("s", [7], 7, "k", until=20.0)
    shadows.withdraw(first)  # extended by `second` since: kept
    assert shadows.shadows("s") == {7: (20.0, frozenset("k"), frozenset("k"))}
    shadows.withdraw(second)  # back to `first`'s
    assert shadows.shadows("s") == {7: (10.0, frozenset("k"), frozenset("k"))}
    shadows.withdraw(first)
    assert shadows.shadows("s") is None and len(shadows) == 0


def test_withdrawing_a_shadow_keeps_a_later_alike_one() -> None:
    """Review: a second request's mark that changed nothing (the same extra_key, an earlier
    time: a peer's resend with what is left of its keep_s) protected nothing, so withdrawing
    the first request's mark dropped the key though the second may have stored its copy."""
    shadows = ShadowedPrefixes()
    first = shadows.mark("s", [7], 7, "k", until=20.0)
    later = shadows.mark("s", [7], 7, "k", until=10.0)
    shadows.withdraw(first)
    assert shadows.shadows("s") == {7: (20.0, frozenset("k"), frozenset("k"))}
    # then the later one: back to the first one's (withdrawn, so kept too long: fails closed)
    shadows.withdraw(later)
    assert shadows.shadows("s") == {7: (20.0, frozenset("k"), frozenset("k"))}


P: list[TokenId] = list(range(3000, 3000 + 65))  # four 16-token pages and a last token
TENANT = Namespace("", None, "t")
VIEW = Namespace("", None, "t", "view")


def _stored(hashes: list[int], tokens: list[TokenId], parent: int | None = None) -> Stored:
    return Stored(
        block_hashes=list[BlockHash](hashes),
        parent=parent,
        token_ids=tokens,
        block_size=16,
        cache_salt="t",
    )


async def _apply(svc: IndexerService, pub: ScriptedPublisher, *events: Event) -> None:
    assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, list(events))))


def _matched(svc: IndexerService, tokens: list[TokenId]) -> int:
    return svc.query(TENANT, tokens)[WORKER].matched_tokens


async def test_an_extra_key_prompt_sharing_only_the_first_page_hides_only_that_page(
    ctx: zmq.asyncio.Context,
) -> None:
    """QA: one extra_key request whose prompt shares only the first page (a chat template's
    header) with a tenant's plain prompts hid all of them on that rank for an hour (predicted
    0, the worker reused 624)."""
    other: list[TokenId] = P[:16] + list(range(4000, 4000 + 33))
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        await _apply(svc, pub, _stored([1, 2, 3, 4], P[:64]))
        assert _matched(svc, P) == 64
        svc.shadow(VIEW, other, WORKER, None, keep_s=60.0)
        # its own subtree: a copy of the first page (the same hash: extra_key is not hashed)
        await _apply(svc, pub, _stored([1, 12, 13], other[:48]))
        assert _matched(svc, P) == 64
        # the plain tree holds the first page (two copies, one extra_key): not the others
        assert _matched(svc, other) == 16


async def test_a_plain_copy_evicted_beside_an_extra_key_copy_predicts_nothing(
    ctx: zmq.asyncio.Context,
) -> None:
    """Two copies of each page (the extra_key's and the plain one), then removals: which copy
    went is not known, so a page is trusted only while more copies than extra_keys remain."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        svc.shadow(VIEW, P, WORKER, None, keep_s=60.0)
        svc.shadow(VIEW, P, WORKER, None, keep_s=60.0)  # the same extra_key: one copy at most
        await _apply(svc, pub, _stored([1, 2, 3, 4], P[:64]))  # the extra_key's
        assert _matched(svc, P) == 0
        await _apply(svc, pub, _stored([1, 2, 3, 4], P[:64]))  # the plain tree's
        assert _matched(svc, P) == 64
        await _apply(svc, pub, Removed(block_hashes=[4]))  # one of the two copies of page 4
        assert svc.index.entries(STREAM) == 4 and _matched(svc, P) == 48
        # the rest of that tree: the other one's copies stay, and may be the extra_key's
        await _apply(svc, pub, Removed(block_hashes=[3, 2, 1]))
        assert svc.index.entries(STREAM) == 4 and _matched(svc, P) == 0
        # the plain tree stores them again: two copies each once more
        await _apply(svc, pub, _stored([1, 2], P[:32]))
        assert _matched(svc, P) == 32
        await _apply(svc, pub, Removed(block_hashes=[4, 3, 2, 1]))
        assert _matched(svc, P) == 0


async def test_the_pages_after_an_extra_key_prompt_stay_hidden(ctx: zmq.asyncio.Context) -> None:
    """The worker stores an extra_key request's output too, pages no shadow names: a plain
    prompt that runs on through them (the conversation's next turn, sent plain) is trusted
    only up to what the plain tree surely holds."""
    prompt = P[:33]  # two pages and a token: the third page is the token and the output
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        svc.shadow(VIEW, prompt, WORKER, None, keep_s=60.0)
        await _apply(svc, pub, _stored([1, 2, 3], P[:48]))  # prompt and output, as its own
        assert _matched(svc, P) == 0
        await _apply(svc, pub, _stored([1, 2], P[:32]))  # a plain request of the prompt
        assert _matched(svc, P) == 32  # not 48: page 3 may be the extra_key's alone
        await _apply(svc, pub, _stored([3], P[32:48], parent=2))  # the plain tree's too
        assert _matched(svc, P) == 48


def test_a_leaving_streams_shadows_wait_for_a_stream_of_its_server() -> None:
    """A worker's id changes, its server's cache does not (a rename, an id swap): the shadows
    are parked for the server's stream and taken by the stream added on it."""
    shadows = ShadowedPrefixes()
    shadows.mark("a", [1, 2], 2, "k", until=10.0)
    shadows.mark("b", [1, 3], 3, "j", until=20.0)
    shadows.park("a", "server-1", now=5.0)
    shadows.park("b", "server-2", now=5.0)
    assert shadows.shadows("a") is None and len(shadows) == 4 and shadows.has_key(3)
    assert shadows.adopt("server-9", "x", now=6.0) == 0 and shadows.shadows("x") is None
    # the swap: each id now follows the other's server
    assert shadows.adopt("server-2", "a", now=6.0) == 2
    assert shadows.adopt("server-1", "b", now=6.0) == 2
    assert shadows.shadows("a") == {
        1: (20.0, frozenset("j"), frozenset()),
        3: (20.0, frozenset("j"), frozenset("j")),
    }
    assert shadows.shadows("b") == {
        1: (10.0, frozenset("k"), frozenset()),
        2: (10.0, frozenset("k"), frozenset("k")),
    }
    # two streams parked for one server join: a key of both is shadowed by both extra_keys
    shadows.park("a", "server-3", now=10.0)
    shadows.park("b", "server-3", now=10.0)
    assert len(shadows) == 3
    shadows.adopt("server-3", "c", now=10.0)
    assert shadows.shadows("c") == {
        1: (20.0, frozenset("jk"), frozenset()),
        2: (10.0, frozenset("k"), frozenset("k")),
        3: (20.0, frozenset("j"), frozenset("j")),
    }


def test_a_moved_shadow_is_kept_a_grace_past_its_time_then_as_any_other() -> None:
    """Past its time a shadow is kept by its stream holding its key: parked, no stream holds
    it; just taken, the new stream's replay has yet to bring it back. Both wait
    `MOVE_GRACE_S` from the move."""
    shadows = ShadowedPrefixes()
    shadows.mark("a", [1], 1, "k", until=MOVE_GRACE_S + 10.0)
    shadows.mark("a", [2], 2, "k", until=1.0)
    shadows.park("a", "server-1", now=0.0)
    held: set[int] = set()

    def holds(stream: str, keys: object) -> list[bool]:
        assert stream == "b", "no stream holds a parked key"
        return [key in held for key in keys]  # type: ignore[attr-defined]

    assert shadows.sweep(MOVE_GRACE_S - 1.0, holds) == 0
    assert shadows.sweep(MOVE_GRACE_S + 1.0, holds) == 1 and len(shadows) == 1
    shadows.mark("b", [3], 3, "k", until=1.0)
    shadows.adopt("server-1", "b", now=MOVE_GRACE_S + 2.0)
    assert shadows.sweep(2 * MOVE_GRACE_S + 1.0, holds) == 0  # the replay may be on its way
    held.add(1)
    assert shadows.sweep(2 * MOVE_GRACE_S + 3.0, holds) == 1  # 3 is not held: 1 is
    assert list(shadows.shadows("b") or ()) == [1]
    held.clear()
    assert shadows.sweep(2 * MOVE_GRACE_S + 3.0, holds) == 1 and not shadows
    assert shadows.adopt("server-1", "c", now=0.0) == 0


@pytest.mark.parametrize("kind", ["unsized", "blanket"])
async def test_a_renamed_worker_keeps_the_shadows_made_before_its_block_size_was_known(
    ctx: zmq.asyncio.Context, kind: str
) -> None:
    """A prompt shadowed before its stream's block size was known, then the worker renamed:
    its events (or the new id's replay of them) show the prompt's pages as plain ones, which
    the new id's stream must not trust. A prompt whose head cannot be kept hides the whole
    stream (fail closed): so it does under the new id."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub)
        head: list[TokenId] | list[str] = PROMPT if kind == "unsized" else ["not a token"] * 40
        svc.shadow(Namespace("", None, "t", "view"), head, WORKER, None, keep_s=60.0)
        configs = svc.stream_configs(WORKER)
        await svc.remove_worker(WORKER)
        await svc.add_worker("renamed", configs)
        events: list[Event] = [
            Stored(block_hashes=[1, 2], parent=None, token_ids=PROMPT[:32], block_size=16,
                   cache_salt="t"),
            Stored(block_hashes=[3], parent=None, token_ids=OTHER[:16], block_size=16,
                   cache_salt="t"),
        ]  # fmt: skip
        for _ in range(100):  # until the new SUB receives
            if await svc.wait_applied("renamed", await pub.publish(EventBatch(0.0, [])), 0.1):
                break
        assert await svc.wait_applied("renamed", await pub.publish(EventBatch(0.0, events)))
        plain = Namespace("", None, "t")
        assert svc.query(plain, PROMPT)["renamed"].matched_tokens == 0
        assert svc.query(plain, OTHER)["renamed"].matched_tokens == (16 if kind == "unsized" else 0)


def test_a_parked_shadow_is_copied_to_a_stream_that_may_be_its_server() -> None:
    """A stream that only may be the parked one's server gets a copy (another may be it
    too); the shadows a stream took are dropped, but for the keys marked there since, once
    its publisher shows it is a new process (`disown`), and kept once it may be the same
    (`settle`)."""
    shadows = ShadowedPrefixes()
    shadows.mark("a", [1, 2], 2, "k", until=10.0)
    shadows.park("a", "server-1", now=5.0)
    assert shadows.adopt("server-1", "x", now=6.0, take=False) == 2
    assert shadows.parked() == ["server-1"] and len(shadows) == 4
    assert shadows.adopt("server-1", "y", now=6.0) == 2 and shadows.parked() == []
    shadows.watch("x")
    shadows.mark("x", [2, 3], 3, "j", until=10.0)  # a request sent to x meanwhile
    assert shadows.disown("x") == 1 and len(shadows) == 4
    assert shadows.shadows("x") == {
        2: (10.0, frozenset("jk"), frozenset("k")),  # also k's: it stays (fail closed)
        3: (10.0, frozenset("j"), frozenset("j")),
    }
    shadows.watch("y")
    shadows.settle("y")
    assert shadows.disown("y") == 0 and len(shadows.shadows("y") or ()) == 2


@pytest.mark.parametrize(
    ("a", "b", "same", "may_be"),
    [
        ("tcp://127.0.0.1:5557", "tcp://localhost:5557", True, True),
        ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", True, True),
        ("tcp://0.0.0.0:5557", "tcp://ip6-localhost:5557", True, True),
        ("tcp://10.0.0.7:5557", "tcp://[::ffff:10.0.0.7]:05557", True, True),
        ("tcp://worker-0.svc:5557", "tcp://10.0.0.7:5557", False, True),  # a name: any host
        ("tcp://*:5557", "tcp://10.0.0.7:5557", False, True),
        ("tcp://10.0.0.7:5557", "tcp://10.0.0.8:5557", False, False),
        ("tcp://127.0.0.1:5557", "tcp://10.0.0.8:5557", False, False),
        ("tcp://localhost:5557", "tcp://localhost:5558", False, False),
        ("ipc:///run/kv/../kv/w0", "ipc:///run/kv/w0", True, True),
    ],
)
def test_a_servers_stream_is_known_across_the_spellings_of_its_host(
    a: str, b: str, same: bool, may_be: bool
) -> None:
    one, other = server_stream(StreamConfig(a)), server_stream(StreamConfig(b))
    assert (one.same(other), one.may_be(other)) == (same, may_be)
    assert (other.same(one), other.may_be(one)) == (same, may_be)
    assert not one.may_be(server_stream(StreamConfig(a, dp_rank=1)))


async def _follow(
    svc: IndexerService, pub: ScriptedPublisher, worker: str, cfg: StreamConfig
) -> None:
    """Add `worker` on `cfg` and wait until its SUB receives (empty batches published)."""
    await svc.add_worker(worker, [cfg])
    (sub,) = svc._workers[worker]
    for _ in range(100):
        seq = await pub.publish(EventBatch(ts=0.0, events=[]))
        if await svc.wait_applied(worker, seq, timeout_s=0.1) and sub.tracker.live is not None:
            return
    raise AssertionError("subscriber never received anything")


_STORED: list[Event] = [
    Stored(block_hashes=[1, 2], parent=None, token_ids=PROMPT[:32], block_size=16, cache_salt="t")
]


@pytest.mark.parametrize("host", ["localhost", "[::ffff:127.0.0.1]"])
async def test_a_worker_renamed_under_another_spelling_of_its_host_keeps_its_shadows(
    ctx: zmq.asyncio.Context, host: str
) -> None:
    """QA (xk6.py lhost): a worker renamed and its URL spelled `localhost` instead of
    `127.0.0.1` (its engine advertises the URL's host): the endpoint was compared as spelled,
    the new id's stream took no shadows, and its replay's extra_key pages were predicted to
    plain requests (4 of 4 false hits)."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, _STORED)))
        svc.shadow(Namespace("", None, "t", "view"), PROMPT, WORKER, None, keep_s=60.0)
        (cfg,) = svc.stream_configs(WORKER)
        await svc.remove_worker(WORKER)
        spelled = msgspec.structs.replace(cfg, endpoint=cfg.endpoint.replace("127.0.0.1", host))
        await _follow(svc, pub, "renamed", spelled)
        (stream,) = svc.stream_ids("renamed")
        keys = svc.block_keys(stream, Namespace("", None, "t"), PROMPT)
        await wait_until(lambda: all(svc.holds(stream, keys)))  # its replay brought them
        assert svc.query(Namespace("", None, "t"), PROMPT)["renamed"].matched_tokens == 0


@pytest.mark.parametrize("restarted", [True, False])
async def test_a_new_process_on_a_removed_workers_ports_drops_the_shadows_it_took(
    ctx: zmq.asyncio.Context, restarted: bool
) -> None:
    """QA (xk_newsrv.py): a worker removed, another server started on its events and replay
    ports and added: it took the old one's shadows, and its own plain pages of those prompts
    were predicted nothing (4 of 4, for an hour). Its seqs start behind the old one's: the
    shadows it took go, those of requests sent to it since stay. The same process (no
    restart) keeps them."""
    async with ScriptedPublisher(ctx) as pub, IndexerService(CONFIG) as svc:
        await connect(svc, pub, block_size=16)
        for _ in range(200):  # the old process's history runs ahead of the new one's
            await pub.publish(EventBatch(0.0, []))
        assert await svc.wait_applied(WORKER, await pub.publish(EventBatch(0.0, _STORED)))
        keyed = Namespace("", None, "t", "view")
        svc.shadow(keyed, PROMPT, WORKER, None, keep_s=60.0)
        (cfg,) = svc.stream_configs(WORKER)
        await svc.remove_worker(WORKER)
        if restarted:
            pub.restart()  # seq back to 0, nothing buffered: another process
        await svc.add_worker("other", [cfg])
        svc.shadow(keyed, OTHER, "other", None, keep_s=60.0)  # sent before its first batch
        stored = [*_STORED, Stored(block_hashes=[3], parent=None, token_ids=OTHER[:16],
                                   block_size=16, cache_salt="t")]  # fmt: skip
        (sub,) = svc._workers["other"]
        for _ in range(100):
            seq = await pub.publish(EventBatch(ts=0.0, events=[]))
            if await svc.wait_applied("other", seq, timeout_s=0.1) and sub.tracker.live:
                break
        if restarted:  # the new process stores the prompts, each once
            assert await svc.wait_applied("other", await pub.publish(EventBatch(0.0, stored)))
        (stream,) = svc.stream_ids("other")
        plain = Namespace("", None, "t")
        keys = svc.block_keys(stream, plain, PROMPT)
        await wait_until(lambda: all(svc.holds(stream, keys)))
        assert svc.query(plain, PROMPT)["other"].matched_tokens == (32 if restarted else 0)
        assert svc.query(plain, OTHER)["other"].matched_tokens == 0
