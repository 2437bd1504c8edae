"""The replay ring: bounded in batches and bytes, always the newest contiguous run, exact bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.replay_ring import ReplayRing


def _payload(seq: int, size: int) -> bytes:
    # every byte says which batch it belongs to, so an overwrite cannot go unnoticed
    return bytes((seq * 31 + i) % 251 for i in range(size))


@settings(max_examples=300, deadline=None)
@given(
    max_batches=st.integers(1, 12),
    max_bytes=st.integers(1, 200),
    sizes=st.lists(st.integers(0, 120), min_size=1, max_size=80),
    start=st.integers(0, 90),
)
def test_the_ring_keeps_the_newest_run_with_exact_bytes_within_both_bounds(
    max_batches: int, max_bytes: int, sizes: list[int], start: int
) -> None:
    ring = ReplayRing(max_batches=max_batches, max_bytes=max_bytes)
    for seq, size in enumerate(sizes):
        ring.append(seq, _payload(seq, size))
        held = ring.since(0)
        assert len(held) == len(ring) <= max_batches
        assert ring.nbytes == sum(len(p) for _, p in held) <= max_bytes
        for s, p in held:
            assert p == _payload(s, sizes[s])  # never a byte of another batch
        seqs = [s for s, _ in held]
        if size <= max_bytes:
            # the newest is always kept, and what is kept is a contiguous run ending at it
            assert seqs == list(range(seq - len(seqs) + 1, seq + 1))
        else:
            assert seqs == []  # too big to keep: nothing older may be replayed past it
    assert [s for s, _ in ring.since(start)] == [s for s, _ in ring.since(0) if s >= start]
    ring.close()


def test_the_count_bound_and_the_byte_bound_each_drop_the_oldest() -> None:
    ring = ReplayRing(max_batches=3, max_bytes=100)
    for seq in range(5):
        ring.append(seq, _payload(seq, 10))
    assert [s for s, _ in ring.since(0)] == [2, 3, 4]  # the count bound
    ring = ReplayRing(max_batches=100, max_bytes=100)
    for seq in range(5):
        ring.append(seq, _payload(seq, 30))
    # 30-byte batches at 0, 30, 60; the fourth wraps to 0 over the first, the fifth over 30
    assert [s for s, _ in ring.since(0)] == [2, 3, 4] and ring.nbytes == 90
    assert ring.since(3) == [(3, _payload(3, 30)), (4, _payload(4, 30))]


def test_a_ring_needs_room() -> None:
    with pytest.raises(ValueError, match="room"):
        ReplayRing(max_batches=0, max_bytes=10)
