"""Prefixes sent with an `extra_key`: their events look plain, so plain queries do not trust them.

The bookkeeping alone (`ShadowedPrefixes`), then the service over a scripted publisher on real
ZMQ sockets: a prompt shadowed before the stream's block size is known is shadowed once its
first events say the size (the events of that very prompt among them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from indexer.namespace import Namespace
from indexer.protocol.events import Event, EventBatch, Stored, TokenId
from indexer.service import IndexerService
from indexer.shadowed import ShadowedPrefixes
from tests.indexer.scripted import ScriptedPublisher
from tests.indexer.test_subscriber_zmq import CONFIG, STREAM, WORKER, connect

PROMPT: list[TokenId] = list(range(1000, 1000 + 33))  # two 16-token pages and a last token
OTHER: list[TokenId] = list(range(2000, 2000 + 17))


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def test_a_shadow_outlives_its_time_while_the_stream_holds_its_key() -> None:
    shadows = ShadowedPrefixes()
    shadows.mark("s", 7, until=10.0)
    shadows.mark("s", 7, until=5.0)  # an earlier time never shortens it
    shadows.mark("s", 8, until=10.0)
    shadows.mark("t", 7, until=10.0)
    assert len(shadows) == 3 and shadows.shadows("s") == {7: 10.0, 8: 10.0}
    held = {("s", 7)}

    def holds(stream: str, keys: object) -> list[bool]:
        return [(stream, key) in held for key in keys]  # type: ignore[attr-defined]

    assert shadows.sweep(9.0, holds) == 0  # in their time: kept, held or not
    assert shadows.sweep(11.0, holds) == 2  # past it: only the held one stays
    assert shadows.shadows("s") == {7: 10.0} and shadows.shadows("t") is None
    held.clear()
    assert shadows.sweep(11.0, holds) == 1
    assert not shadows and shadows.shadows("s") is None


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
    first = shadows.mark("s", 7, until=10.0)
    second = shadows.mark("s", 7, until=20.0)
    shadows.withdraw(first)  # extended by `second` since: kept
    assert shadows.shadows("s") == {7: 20.0}
    shadows.withdraw(second)  # back to `first`'s
    assert shadows.shadows("s") == {7: 10.0}
    shadows.withdraw(first)
    assert shadows.shadows("s") is None and len(shadows) == 0
