"""Eviction-aware placement and the learned balance on hand-computable cases."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.routing.admission import AdmissionForecast, RecencyBook
from router.routing.balance import BalanceModel
from router.routing.eviction_cost import eviction_cost

BS = 4


def _admission(held: int, queued: int, capacity: int | None = 24) -> AdmissionForecast:
    return AdmissionForecast(
        raw_tokens=0,
        kept_tokens=0,
        capacity_tokens=capacity,
        held_tokens=held,
        queued_tokens=queued,
    )


def _charge(
    book: RecencyBook,
    *,
    held: int,
    queued: int,
    new_tokens: int,
    holders: Callable[[Sequence[int]], list[int]] = lambda keys: [1] * len(keys),
    reused: frozenset[int] = frozenset(),
) -> tuple[int, int, int]:
    """(evicted, hot, sole hot) tokens of a request bringing `new_tokens` to a 24-token pool."""
    cost = eviction_cost(
        admission=_admission(held=held, queued=queued),
        new_tokens=new_tokens,
        block_size=BS,
        book=book,
        holder_counts=holders,
        reused=lambda: reused,
    )
    return cost.evicted_tokens, cost.hot_tokens, cost.sole_hot_tokens


def test_a_request_that_fits_evicts_nothing() -> None:
    cost = eviction_cost(
        admission=_admission(held=12, queued=4),
        new_tokens=8,
        block_size=BS,
        book=RecencyBook(),
        holder_counts=lambda keys: [1] * len(keys),
    )
    assert (cost.evicted_tokens, cost.sole_hot_tokens) == (0, 0)


def test_it_charges_the_reused_blocks_no_other_worker_holds() -> None:
    book = RecencyBook()
    book.touch([1, 2])  # the oldest group, used twice: hot
    book.touch([1, 2])
    book.touch([3, 4])  # used once: cold
    book.touch([5, 6])
    book.touch([5, 6])
    # 24-token pool full (6 blocks held): 8 new tokens evict the 2 oldest blocks (1, 2)
    others = {1: 1, 2: 2}  # block 2 is held by another worker too

    def holders(keys: Sequence[int]) -> list[int]:
        return [others.get(k, 1) for k in keys]

    # 1 and 2 are hot; only 1 is held nowhere else
    assert _charge(book, held=24, queued=0, new_tokens=8, holders=holders) == (8, 8, 4)
    # after the requests ahead evict blocks 1 and 2, this one evicts the cold 3 and 4
    assert _charge(book, held=24, queued=8, new_tokens=8) == (8, 0, 0)


def test_the_prefix_it_comes_to_reuse_is_never_its_own_victim() -> None:
    book = RecencyBook()
    book.touch([1, 2])  # a conversation's earlier turn: the oldest here, used twice
    book.touch([1, 2])
    book.touch([3, 4])  # another tenant's prefix, used twice
    book.touch([3, 4])
    book.touch([5, 6])

    def charge(reused: frozenset[int]) -> tuple[int, int, int]:
        return _charge(book, held=24, queued=0, new_tokens=8, reused=reused)

    assert charge(frozenset()) == (8, 8, 8)  # a stranger's request evicts blocks 1 and 2
    # the next turn of that conversation locks 1 and 2 at admission: 3 and 4 go instead
    assert charge(frozenset({1, 2})) == (8, 8, 8)
    book.touch([3, 4, 7])  # now 5, 6 (cold) are next after the conversation's blocks
    assert charge(frozenset({1, 2})) == (8, 0, 0)
    assert charge(frozenset()) == (8, 8, 8)


def test_unknown_capacity_charges_nothing() -> None:
    cost = eviction_cost(
        admission=_admission(held=24, queued=24, capacity=None),
        new_tokens=100,
        block_size=BS,
        book=RecencyBook(),
        holder_counts=lambda keys: [1] * len(keys),
    )
    assert cost.sole_hot_tokens == 0 and "capacity unknown" in cost.why


def test_the_balance_starts_at_the_prior_and_follows_the_measured_costs() -> None:
    model = BalanceModel(prior_decode_weight=32.0, prior_samples=20.0)
    assert model.estimate().decode_weight == 32.0
    # a fleet where a running request costs as much as 64 prefill tokens (0.5 ms per token)
    for i in range(2000):
        tokens, running = 100 + (i * 37) % 900, i % 7
        model.observe(0.5 * tokens + 32.0 * running, tokens, running)
    fit = model.estimate()
    assert fit.prefill_ms_per_token is not None and abs(fit.prefill_ms_per_token - 0.5) < 0.05
    assert 48.0 < fit.decode_weight < 72.0  # most of the way from the prior (32) to 64
    # bounded: a fleet where running requests seem to cost nothing stays at prior / 4
    for i in range(5000):
        tokens = 100 + (i * 37) % 900
        model.observe(0.5 * tokens, tokens, i % 7)
    assert model.estimate().decode_weight == 8.0
