"""The admission-time forecast on hand-computable cases (`router.routing.admission`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from indexer.backend import PURE
from router.routing.admission import (
    AdmissionForecast,
    RecencyBook,
    WaitingDecisions,
    forecast,
    recency_stride,
    stretch_keys,
)
from tests.indexer.backends import native_or_skip

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
        waiting=WaitingDecisions(0.0),
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
        waiting=WaitingDecisions(0.0),
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
        waiting=WaitingDecisions(0.0),
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


def test_a_running_request_holds_its_output_and_its_prompts_partial_last_page() -> None:
    # a 6-block pool, full: B (3 blocks) touched after A (3 blocks); one token queued
    book = RecencyBook()
    book.touch([1, 2, 3])
    book.touch([4, 5, 6])

    def kept(in_flight: int, reserve: int) -> int:
        return _run(
            raw=12,
            capacity=24,
            held=24,
            queued=1,
            in_flight=in_flight,
            reserve=reserve,
            keys=[4, 5, 6],
            book=book,
        )

    assert kept(0, 0) == 12  # nothing running: 3 blocks used since B's, within the pool
    # one running request: its prompt's partial last page and 4 output tokens take two pages
    # beside its prompt's blocks (3 + 2 <= 6): B survives
    assert kept(1, 4) == 12
    # two of them: 3 + 4 > 6, B is evicted before admission
    assert kept(2, 4) == 0
    # with no output at all a running request still holds its partial page: 3 + 2 <= 6
    assert kept(2, 0) == 12
    assert kept(4, 0) == 0


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


def _over_blocks_1_to_3(
    book: RecencyBook,
    waiting: WaitingDecisions,
    *,
    held: int,
    queued: int,
    now: float,
    room: int | None = None,
    trickles: bool = False,
    running_cap: int | None = None,
    seq: int | None = None,
    cached_late: bool = False,
) -> AdmissionForecast:
    """A 12-token match over blocks 1, 2, 3, the first `held` tokens from events (the rest
    pending), on a 100-token pool with nothing to evict."""
    return forecast(
        raw_tokens=12,
        matched_tokens=held,
        capacity_tokens=100,
        held_tokens=held,
        queued_tokens=queued,
        in_flight=2,
        reserve_tokens=0,
        block_size=BS,
        keys=lambda: [1, 2, 3],
        book=book,
        waiting=waiting,
        now=now,
        seq=seq,
        batch_room=room,
        trickles=trickles,
        running_cap=running_cap,
        cached_late=cached_late,
    )


def _pending(
    book: RecencyBook,
    waiting: WaitingDecisions,
    *,
    now: float = 0.0,
    room: int | None = None,
    trickles: bool = False,
    seq: int | None = None,
    running_cap: int | None = None,
    cached_late: bool = False,
) -> int:
    """Blocks 1, 2, 3: block 1 from events, 2 and 3 pending (12 tokens matched)."""
    found = _over_blocks_1_to_3(
        book,
        waiting,
        held=4,
        queued=8,
        now=now,
        room=room,
        trickles=trickles,
        seq=seq,
        running_cap=running_cap,
        cached_late=cached_late,
    )
    return found.kept_tokens


def _behind_a_prefill(
    window_s: float = 0.0, held_blocks: int = 1
) -> tuple[RecencyBook, WaitingDecisions, int, int]:
    """A request in prefill (`ahead`, not answered) and one queued behind it over blocks 1-3,
    predicted to find block 1 and so bringing 2 and 3 (`stamp`)."""
    book = RecencyBook()
    waiting = WaitingDecisions(window_s)
    ahead = book.touch([9])
    waiting.sent(ahead, kept_blocks=0, held_blocks=0, running=0, now=0.0)
    stamp = book.touch([1, 2, 3])
    waiting.sent(stamp, kept_blocks=1, held_blocks=held_blocks, running=1, now=0.01)
    return book, waiting, ahead, stamp


def _held(book: RecencyBook, waiting: WaitingDecisions, queued: int) -> AdmissionForecast:
    """Blocks 1, 2, 3 all held per the events (12 tokens matched)."""
    return _over_blocks_1_to_3(book, waiting, held=12, queued=queued, now=5.0)


def test_pending_blocks_count_only_while_their_request_is_on_its_way() -> None:
    book = RecencyBook()
    stamp = book.touch([1, 2, 3])  # the request that marked 2 and 3 pending
    waiting = WaitingDecisions(0.0)
    waiting.sent(stamp, kept_blocks=1, held_blocks=1, running=0, now=0.0)
    assert _pending(book, waiting, now=0.0005) == 4  # an idle worker's next turn: same batch
    assert _pending(book, waiting, now=0.002) == 12  # taken in on that turn
    # it answered (the stream's last batch was 7 then); its stores may still be on their
    # way: the events show them once the stream has published since, and within the grace
    waiting.answered(stamp, first_byte=True, now=0.003, seq=7)
    assert _pending(book, waiting, now=0.004, seq=7) == 12  # the repeat sent right away
    assert _pending(book, waiting, now=0.004, seq=8) == 12  # a batch since, within the grace
    assert _pending(book, waiting, now=5.0, seq=7) == 12  # nothing published since
    # a batch since and the grace over: its stores never showed up (evicted, or never made)
    assert _pending(book, waiting, now=5.0, seq=8) == 4


def test_blocks_a_request_not_yet_admitted_brings_are_not_found_by_its_batch() -> None:
    book, waiting, ahead, _ = _behind_a_prefill()
    # both wait for the end of that prefill: this request would be admitted with it
    assert _pending(book, waiting, now=5.0) == 4
    # the prefill ended (its first byte): the worker admitted the queued one, which now
    # stores blocks 2 and 3 before a request routed now is admitted
    waiting.answered(ahead, first_byte=True)
    assert _pending(book, waiting, now=5.0) == 12


def test_an_unanswered_end_is_no_step_and_a_decode_step_takes_the_window() -> None:
    book, waiting, ahead, _ = _behind_a_prefill(window_s=0.02)
    waiting.answered(ahead, first_byte=False)  # failed or cancelled: no prefill ended
    assert _pending(book, waiting, now=5.0) == 4
    # nothing unanswered ahead but requests decoding: admitted at the end of the step
    other = WaitingDecisions(0.02)
    later = book.touch([1, 2, 3])
    other.sent(later, kept_blocks=1, held_blocks=1, running=2, now=1.0)
    assert _pending(book, other, now=1.01) == 4
    assert _pending(book, other, now=1.03) == 12


def test_held_blocks_a_waiting_request_must_compute_again_are_lost_with_it() -> None:
    # blocks 1-3 are held, but the request that touched them last was predicted to find
    # only block 1 (the rest evicted before it is admitted): it computes 2 and 3 again
    book, waiting, ahead, _ = _behind_a_prefill(held_blocks=3)
    found = _held(book, waiting, queued=12)
    assert found.kept_tokens == 4 and "not admitted" in found.why
    waiting.answered(ahead, first_byte=True)
    assert _pending(book, waiting) == 12


def test_requests_sent_before_a_known_admission_join_that_batch() -> None:
    book = RecencyBook()
    waiting = WaitingDecisions(0.02)
    first = book.touch([9])  # nothing ahead, requests decoding: admitted at t=1.02
    waiting.sent(first, kept_blocks=0, held_blocks=1, running=3, now=1.0)
    stamp = book.touch([1, 2, 3])  # arrives before that step ends: the same batch
    waiting.sent(stamp, kept_blocks=1, held_blocks=1, running=4, now=1.01)
    assert _pending(book, waiting, now=1.015) == 4
    assert _pending(book, waiting, now=1.021) == 12
    # one sent after that admission waits for the prefill it started
    late = book.touch([1, 2, 3, 4])
    waiting.sent(late, kept_blocks=3, held_blocks=1, running=5, now=1.03)
    assert not waiting.admitted(late, 1.5)
    waiting.answered(first, first_byte=True)
    assert waiting.admitted(late, 1.5)


def test_a_full_running_batch_admits_one_at_a_time_so_the_next_finds_the_blocks() -> None:
    book, waiting, _, stamp = _behind_a_prefill()
    # room for both in the next batch: this request would be admitted with the one ahead
    assert _pending(book, waiting, room=2) == 4
    # room for one only (the rest of the running cap is decoding): it comes in a later batch
    assert _pending(book, waiting, room=1) == 12
    # a third waiting between them: two more than the one ahead need three places
    between = book.touch([7])
    waiting.sent(between, kept_blocks=0, held_blocks=1, running=2, now=0.02)
    assert waiting.behind(stamp) == 1
    assert _pending(book, waiting, room=2) == 12
    assert _pending(book, waiting, room=3) == 4


def test_a_request_that_ended_unanswered_leaves_no_mark_it_touched_last_on_its_way() -> None:
    book, waiting, _, _ = _behind_a_prefill()
    # a request waits, bringing blocks 2 and 3; a sibling sent behind it touches
    # them last, and its client leaves before an answer (its own marks taken back)
    sibling = book.touch([1, 2, 3])
    waiting.sent(sibling, kept_blocks=1, held_blocks=1, running=2, now=0.02)
    waiting.answered(sibling, first_byte=False, now=0.03, seq=None)
    # the marks left on 2 and 3 are the waiting one's: not on their way for a request routed
    # now (before, they counted through the sibling's grace: 12 tokens, the worker found 4)
    assert _pending(book, waiting, now=0.04) == 4
    # one that answered is read through its grace as before
    answered = book.touch([1, 2, 3])
    waiting.sent(answered, kept_blocks=3, held_blocks=1, running=2, now=0.05)
    waiting.answered(answered, first_byte=True, now=0.06, seq=None)
    assert _pending(book, waiting, now=0.07) == 12


def test_an_overlap_scheduler_gives_no_block_a_request_brings_before_it_answers() -> None:
    book, waiting, ahead, stamp = _behind_a_prefill()
    # the request ahead answered: the one of `stamp` is in the prefill batch now, and one
    # routed now comes in a later batch, which finds the blocks it brings
    waiting.answered(ahead, first_byte=True, now=0.02, seq=3)
    assert _pending(book, waiting, now=0.03, seq=3) == 12
    # but a worker that forms its next batch while that prefill runs matches it against the
    # cache before the prefill's prompts are in it: nothing it brings, however long since
    assert _pending(book, waiting, now=0.03, seq=3, cached_late=True) == 4
    assert _pending(book, waiting, now=5.0, seq=9, room=1, cached_late=True) == 4
    found = _over_blocks_1_to_3(book, waiting, held=4, queued=8, now=5.0, cached_late=True)
    assert found.cause == "batched" and "overlap scheduler" in found.why, found.why
    # once it answered, its prompt is cached (its stores may still be on their way)
    waiting.answered(stamp, first_byte=True, now=5.1, seq=9)
    assert _pending(book, waiting, now=5.2, seq=9, cached_late=True) == 12


def test_a_prefill_side_in_a_backlog_shares_a_batch_only_with_the_request_right_ahead() -> None:
    book, waiting, _, stamp = _behind_a_prefill()
    for n in range(3):  # three more waiting behind the one that brings blocks 2 and 3
        other = book.touch([20 + n])
        waiting.sent(other, kept_blocks=0, held_blocks=1, running=2 + n, now=0.02)
    assert waiting.behind(stamp) == 3 and len(waiting) == 5
    # a batch of 8 takes all five and this one: the same batch, on any worker
    assert _pending(book, waiting, room=8) == 4
    # a batch of 5 takes it with the three between (3 + 2 <= 5): the same batch there too
    assert _pending(book, waiting, room=5) == 4
    # a prefill side trickles a backlog longer than a batch in: three back, a later batch
    assert _pending(book, waiting, now=5.0, room=5, trickles=True) == 12
    # no backlog beyond one batch: as any worker
    assert _pending(book, waiting, now=5.0, room=8, trickles=True) == 4
    # right behind it, a trickling backlog still shares its batch, event batch or not
    last = book.touch([1, 2, 3, 4])
    waiting.sent(last, kept_blocks=1, held_blocks=1, running=6, now=0.03, seq=7)
    assert waiting.joins_batch(last, now=5.0, seq=8, batch_room=5, trickles=True)
    assert not waiting.joins_batch(last, now=5.0, seq=8, batch_room=5, trickles=False)


def _waits_for_room(footprint: int = 40) -> tuple[RecencyBook, WaitingDecisions, int]:
    """A request decoding there (answered), and one over blocks 1-3 (`stamp`) sent when the
    pool had no room for it beside that one, predicted to find block 1 and so bringing 2
    and 3."""
    book = RecencyBook()
    waiting = WaitingDecisions(0.02)
    ahead = book.touch([9])
    waiting.sent(ahead, kept_blocks=0, held_blocks=0, running=0, now=0.0, seq=6)
    waiting.answered(ahead, first_byte=True, now=0.01, seq=6)  # it decodes, holding pages
    stamp = book.touch([1, 2, 3])
    waiting.sent(
        stamp,
        kept_blocks=1,
        held_blocks=1,
        running=1,
        now=0.02,
        seq=6,
        room=False,
        footprint_tokens=footprint,
    )
    return book, waiting, stamp


def test_a_request_waiting_for_kv_room_is_not_taken_as_admitted() -> None:
    book, waiting, stamp = _waits_for_room()
    assert waiting.awaiting_room == 1
    # a decode step's time, an answer, an event batch since: none says the worker took it
    # in (it waits for pages to come free). Before, each did, and a request routed behind
    # it, admitted in its batch once pages came free, was predicted blocks 2 and 3
    other = book.touch([7])
    waiting.sent(other, kept_blocks=0, held_blocks=0, running=2, now=0.03, seq=6)
    waiting.answered(other, first_byte=True, now=0.04, seq=7)
    assert not waiting.admitted(stamp, 5.0, seq=9)
    assert _pending(book, waiting, now=5.0, seq=9) == 4
    # the room the requests decoding leave in the running batch says nothing of the batch
    # it goes in (they end to make room): only the running cap bounds it
    assert _pending(book, waiting, now=5.0, seq=9, room=1) == 4
    found = _over_blocks_1_to_3(book, waiting, held=4, queued=8, now=5.0, seq=9)
    assert found.cause == "batched" and found.awaiting_room == 1
    assert "for KV room: 1" in found.why
    # a request sent behind it waits too (first come, first served), room or not
    behind = book.touch([8])
    waiting.sent(behind, kept_blocks=0, held_blocks=0, running=2, now=5.0, seq=9)
    assert waiting.awaiting_room == 2 and not waiting.admitted(behind, 9.0, seq=12)
    # more between them than one batch takes: a request routed now comes in a later batch
    assert _pending(book, waiting, now=5.0, seq=9, running_cap=2) == 12
    assert _pending(book, waiting, now=5.0, seq=9, running_cap=3) == 4


def test_a_request_waiting_for_kv_room_goes_in_once_what_is_ahead_of_it_fits() -> None:
    book, waiting, stamp = _waits_for_room(footprint=40)
    behind = book.touch([8])
    waiting.sent(behind, kept_blocks=0, held_blocks=0, running=2, now=0.03, footprint_tokens=30)
    # a request ended, and what is in flight is still 31 tokens over the pool: the one
    # behind (30) does not make up for it, and the worker keeps both waiting
    waiting.room_came(31, now=1.0, seq=8)
    assert waiting.awaiting_room == 2
    # 30 over: without the one behind, what is in flight fits; it goes in on the next step
    waiting.room_came(30, now=1.0, seq=8)
    assert waiting.awaiting_room == 1
    assert waiting.admitted(stamp, 1.03, seq=8)
    assert not waiting.admitted(behind, 9.0, seq=12)
    # as one sent at that moment with requests decoding: admitted within the window, or at
    # the next event batch; a request routed before then shares its batch
    assert _pending(book, waiting, now=1.01, seq=8) == 4
    assert _pending(book, waiting, now=1.03, seq=8) == 12
    assert _pending(book, waiting, now=1.01, seq=9) == 12
    waiting.room_came(-5, now=2.0, seq=9)  # room to spare: the one behind goes in too
    assert waiting.awaiting_room == 0 and waiting.admitted(behind, 2.03, seq=9)
    # the count follows requests that end while they wait
    _, gone, stamp = _waits_for_room()
    gone.answered(stamp, first_byte=False, now=1.0)
    assert gone.awaiting_room == 0


def test_blocks_stored_since_a_waiting_request_was_sent_are_its_finished_prefill() -> None:
    # a prefill side answers only once its decode has the KV; its stores show first
    book, waiting, _, _ = _behind_a_prefill()  # held: block 1; it brings 2 and 3
    assert _pending(book, waiting, now=5.0) == 4  # pending, not admitted: its batch
    # its blocks arrived in the events: its prefill is over
    assert _held(book, waiting, queued=0).kept_tokens == 12


def test_an_event_batch_after_it_was_sent_says_the_worker_took_it_in() -> None:
    book = RecencyBook()
    waiting = WaitingDecisions(0.0)
    ahead = book.touch([9])  # a prefill side that answers only once its decode has the KV
    waiting.sent(ahead, kept_blocks=0, held_blocks=0, running=0, now=0.0, seq=7)
    stamp = book.touch([1, 2, 3])
    waiting.sent(stamp, kept_blocks=1, held_blocks=1, running=1, now=0.01, seq=7)
    assert not waiting.admitted(stamp, 5.0, seq=7)  # no batch since: still waiting
    assert waiting.admitted(stamp, 5.0, seq=8)  # a step ended since it was sent
    assert not waiting.admitted(stamp, 5.0, seq=None)
    # a stream with no batch when it was sent: its first batch is such a step
    fresh = WaitingDecisions(0.0)
    first = book.touch([5])
    fresh.sent(first, kept_blocks=0, held_blocks=0, running=0, now=0.0)
    late = book.touch([6])
    fresh.sent(late, kept_blocks=0, held_blocks=0, running=1, now=0.01)
    assert fresh.admitted(late, 0.02, seq=0)


def test_the_book_keeps_a_block_per_stretch_and_each_stands_for_its_stretch() -> None:
    assert [recency_stride(b) for b in (1, 4, 16, 64)] == [16, 4, 1, 1]
    # the last block of each stretch, and of a shorter last one its last block
    assert stretch_keys(list(range(10)), 4) == [3, 7, 9]
    assert stretch_keys(list(range(8)), 4) == [3, 7]
    assert stretch_keys([5, 6], 1) == [5, 6]
    # blocks of 1 token, a stretch of 4 kept per decision: 3, 7, 11 of a 12-block path
    book = RecencyBook()
    old = list(range(100, 112))
    book.touch(stretch_keys(old, 4))
    for n in range(3):  # three newer paths of 12 blocks: 9 book entries, 36 blocks
        book.touch(stretch_keys(list(range(200 + 12 * n, 212 + 12 * n)), 4))

    # 12 entries newer or as new as the old path's stand for 48 blocks: a 48-block pool keeps
    # it, a 47-block one (held full, 4 tokens queued) does not
    assert _kept_at_stride(book, old, 48) == 12
    assert _kept_at_stride(book, old, 47) == 0


def _kept_at_stride(book: RecencyBook, keys: list[int], pool: int, raw: int = 12) -> int:
    """What a forecast keeps of `raw` matched tokens of `keys` (blocks of 1 token, the book
    keeping one per 4), the pool held full and 4 tokens queued."""
    return forecast(
        raw_tokens=raw,
        matched_tokens=raw,
        capacity_tokens=pool,
        held_tokens=pool,
        queued_tokens=4,
        in_flight=0,
        reserve_tokens=0,
        block_size=1,
        keys=lambda: keys,
        book=book,
        waiting=WaitingDecisions(0.0),
        stride=4,
    ).kept_tokens


def test_a_prompt_that_leaves_a_hot_prefix_inside_a_stretch_is_as_old_as_its_own_blocks() -> None:
    # X: 2 blocks every prompt shares, then 10 of its own, routed first; then three prompts
    # through the same 2 blocks. The first stretch of X (its 2 shared blocks and 2 of its
    # own) is as old as X: its own blocks there are evicted with the rest of X. When the
    # stretch's first block stood for it, the shared block's recency kept all 4: QA's false
    # hit on pages of 1-8 tokens (matched 16, cached 8-12, every round)
    book = RecencyBook()
    x = [1, 2, *range(300, 310)]
    book.touch(stretch_keys(x, 4))
    for n in range(3):
        book.touch(stretch_keys([1, 2, *range(400 + 20 * n, 410 + 20 * n)], 4))
    assert _kept_at_stride(book, x, 47) == 0
    assert _kept_at_stride(book, x, 48) == 12
    # a match that ends inside a stretch at a block no decision ended at (X's first 6 blocks,
    # another prompt having stored them) is the oldest there: the requests that used those
    # blocks left their recency on other keys
    assert _kept_at_stride(book, x, 48, raw=6) == 4


@pytest.mark.parametrize("kind", ["native", "python"])
def test_the_book_agrees_with_a_plain_model_over_many_touches_prunes_and_rebuilds(
    kind: str,
) -> None:
    # the model: each key's latest stamp and how many touches used it since the book last
    # learnt it; not_older counts the stamps, reused is two uses or more (the book must agree)
    rng = random.Random(7)
    book = RecencyBook((native_or_skip() if kind == "native" else PURE).int_map)
    model: dict[int, int] = {}
    uses: Counter[int] = Counter()
    for step in range(3000):  # past several rebuilds of the tree (1,024 stamps wide)
        keys = rng.sample(range(400), rng.choice([1, 2, 12, 39, 120]))
        if step % 13 == 0:
            keys += keys[: rng.randrange(1, 3)]  # a key twice in one touch counts once
        if step % 29 == 0 and model:
            keys = [k for k, s in model.items() if s == max(model.values())]  # a whole group
        stamp = book.touch(keys)
        model.update(dict.fromkeys(keys, stamp))
        uses.update(set(keys))
        if step % 97 == 0:
            held = set(rng.sample(range(400), 200))

            def holds(ks: list[int], held: set[int] = held) -> list[bool]:
                return [k in held for k in ks]

            book.prune(holds, keep=60)
            model = {k: s for k, s in model.items() if book.stamp(k) is not None}
            uses = Counter({k: n for k, n in uses.items() if k in model})
            assert len(model) == len(book)
        for probe in (0, stamp - 50, stamp - 5, stamp, stamp + 1):
            assert book.not_older(probe) == sum(1 for s in model.values() if s >= probe)
        assert all(book.stamp(k) == s for k, s in model.items())
        assert all(book.reused(k) == (uses[k] >= 2) for k in range(400))


def test_a_held_match_skips_the_keys_unless_a_request_ahead_computes_held_blocks_again() -> None:
    book = RecencyBook()
    waiting = WaitingDecisions(0.0)
    ahead = book.touch([9])  # in flight there, predicted to reuse all it held
    waiting.sent(ahead, kept_blocks=1, held_blocks=1, running=0, now=0.0)
    asked: list[int] = []

    def keys() -> list[int]:
        asked.append(1)
        return [1, 2, 3]

    def run() -> AdmissionForecast:
        return forecast(
            raw_tokens=12,
            matched_tokens=12,
            capacity_tokens=100,
            held_tokens=12,
            queued_tokens=0,
            in_flight=1,
            reserve_tokens=0,
            block_size=BS,
            keys=keys,
            book=book,
            waiting=waiting,
            now=5.0,
        )

    assert run().kept_tokens == 12 and not asked  # nothing can take a held block from it
    # one sent after it was predicted to lose held blocks (it computes them again)
    again = book.touch([1, 2, 3])
    waiting.sent(again, kept_blocks=1, held_blocks=3, running=1, now=5.0)
    assert waiting.recomputes_held()
    assert run().kept_tokens == 4 and asked
    waiting.answered(again, first_byte=False)
    assert not waiting.recomputes_held()
