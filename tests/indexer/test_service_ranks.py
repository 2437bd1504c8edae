"""`IndexerService` with data-parallel workers: every rank answered apart, marks on one rank.

Real subscriber tasks on real (silent) ZMQ endpoints: the streams stay empty, so what a query
reports comes from the pending marks the test places.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from indexer.service import IndexerService, Namespace, StreamConfig

NS = Namespace("m", None, "tenant")
TOKENS = list(range(100, 100 + 65))  # 4 full 16-token blocks (and one token more)


def _silent_endpoint() -> str:
    """A tcp endpoint nobody publishes on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _streams(*ranks: int) -> list[StreamConfig]:
    return [
        StreamConfig(endpoint=_silent_endpoint(), block_size=16, model="m", dp_rank=rank)
        for rank in ranks
    ]


@pytest.fixture
async def indexer() -> AsyncIterator[IndexerService]:
    async with IndexerService() as service:
        yield service


async def test_a_mark_for_one_rank_lands_on_that_rank_only(indexer: IndexerService) -> None:
    await indexer.add_worker("w", _streams(1, 0))  # listed out of order: answered in rank order
    await indexer.add_worker("solo", _streams(0))
    before = indexer.query(NS, TOKENS)["w"]
    assert [(r.dp_rank, r.pending_tokens) for r in before.ranks] == [(0, 0), (1, 0)]

    indexer.add_pending(NS, TOKENS, "w", dp_rank=1)
    match = indexer.query(NS, TOKENS)["w"]
    assert [(r.dp_rank, r.pending_tokens) for r in match.ranks] == [(0, 0), (1, 64)]
    assert match.pending_tokens == 64  # the best rank's, on top
    assert indexer.query(NS, TOKENS)["solo"].pending_tokens == 0
    # another namespace sees none of it
    other = indexer.query(Namespace("m", None, "other"), TOKENS)["w"]
    assert all(r.pending_tokens == 0 for r in other.ranks)


async def test_a_mark_without_a_rank_lands_on_every_rank(indexer: IndexerService) -> None:
    # the router leaves the rank to the engine (one candidate for the worker): any may serve
    await indexer.add_worker("w", _streams(0, 1))
    indexer.add_pending(NS, TOKENS, "w")
    assert [r.pending_tokens for r in indexer.query(NS, TOKENS)["w"].ranks] == [64, 64]


async def test_a_rank_the_worker_lacks_marks_nothing(indexer: IndexerService) -> None:
    await indexer.add_worker("w", _streams(0, 1))
    indexer.add_pending(NS, TOKENS, "w", dp_rank=7)
    assert [r.pending_tokens for r in indexer.query(NS, TOKENS)["w"].ranks] == [0, 0]
