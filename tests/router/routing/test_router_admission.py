"""The admission-time forecast on hand-computable cases (`router.routing.admission`)."""

from __future__ import annotations

from router.routing.admission import RecencyBook, forecast

BS = 4  # tokens per block


def _run(
    *,
    raw: int,
    capacity: int | None,
    held: int,
    queued: int = 0,
    in_flight: int = 0,
    reserve: int = 0,
    keys: list[int],
    book: RecencyBook | None,
) -> int:
    return forecast(
        raw_tokens=raw,
        matched_tokens=raw,
        capacity_tokens=capacity,
        held_tokens=held,
        queued_tokens=queued,
        in_flight=in_flight,
        reserve_tokens=reserve,
        block_size=BS,
        keys=lambda: keys,
        book=book,
    ).kept_tokens


def test_unknown_capacity_keeps_the_raw_match_and_says_so() -> None:
    found = forecast(
        raw_tokens=8,
        matched_tokens=8,
        capacity_tokens=None,
        held_tokens=100,
        queued_tokens=100,
        in_flight=1,
        reserve_tokens=0,
        block_size=BS,
        keys=lambda: [1, 2],
        book=None,
    )
    assert found.kept_tokens == 8 and "capacity unknown" in found.why


def test_nothing_is_evicted_while_held_plus_queued_fits() -> None:
    found = forecast(
        raw_tokens=8,
        matched_tokens=8,
        capacity_tokens=40,
        held_tokens=24,
        queued_tokens=12,
        in_flight=1,
        reserve_tokens=4,  # 24 + 12 + 4 = 40: fits exactly
        block_size=BS,
        keys=lambda: [1, 2],
        book=None,
    )
    assert (found.kept_tokens, found.evict_tokens) == (8, 0)
    assert "nothing is evicted" in found.why


def test_the_least_recently_used_prefix_is_lost_and_a_recent_one_kept() -> None:
    # the worker holds two prefixes of 3 blocks (24 tokens of a 24-token pool): A touched
    # first, then B; a queued request (its blocks C touched last, not held yet) needs 8 tokens
    book = RecencyBook()
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8]
    book.touch(a)
    book.touch(b)
    book.touch(c)

    def kept(keys: list[int]) -> int:
        return _run(raw=12, capacity=24, held=24, queued=8, keys=keys, book=book)

    assert kept(a) == 0  # A is the oldest group: evicted whole
    assert kept(b) == 12  # the 2 evicted blocks are older than B
    # the same demand after A was used again: B is now the oldest
    book.touch(a)
    assert kept(b) == 0
    assert kept(a) == 12


def test_blocks_no_decision_touched_are_the_oldest() -> None:
    book = RecencyBook()
    book.touch([4, 5])
    book.touch([7])  # the queued request's block
    # held: 2 untouched blocks (1, 2) + the touched 4, 5; one block must go
    assert _run(raw=8, capacity=16, held=16, queued=4, keys=[1, 2], book=book) == 0
    assert _run(raw=8, capacity=16, held=16, queued=4, keys=[4, 5], book=book) == 8
    # an untouched block below a touched one is as recent as it (a path is touched together)
    assert _run(raw=12, capacity=16, held=16, queued=4, keys=[4, 5, 9], book=book) == 12


def test_prune_drops_what_the_stream_no_longer_holds_but_keeps_the_newest() -> None:
    book = RecencyBook()
    book.touch([1, 2])
    book.touch([3, 4])
    book.touch([5, 6])  # on its way: not held yet, but among the newest `keep`
    held = {2, 3, 4}
    dropped = book.prune(lambda keys: [k in held for k in keys], keep=3)
    assert dropped == 1  # key 1; 5 and 6 are among the newest three and are kept
    assert [k for k in range(1, 7) if book.stamp(k) is not None] == [2, 3, 4, 5, 6]
    assert book.not_older(book.stamp(3) or 0) == 4  # 3, 4, 5, 6


def test_pending_blocks_count_only_while_their_request_is_on_its_way() -> None:
    book = RecencyBook()
    stamp = book.touch([1, 2, 3])  # the request that marked 2 and 3 pending

    def kept(waiting: set[int]) -> int:
        return forecast(
            raw_tokens=12,
            matched_tokens=4,  # block 1 from events, 2 and 3 pending
            capacity_tokens=100,
            held_tokens=4,
            queued_tokens=8,
            in_flight=1,
            reserve_tokens=0,
            block_size=BS,
            keys=lambda: [1, 2, 3],
            book=book,
            waiting=waiting,
        ).kept_tokens

    assert kept({stamp}) == 12
    # it answered and its stores never showed up: evicted (or never made)
    assert kept(set()) == 4
