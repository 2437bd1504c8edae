"""PendingTable on its own: refresh, expiry order, discards and the size cap, on both backends."""

from __future__ import annotations

import os
import random

from indexer.backend import Backend
from indexer.index.pending import PendingTable

SHIFT = 48


def marks(table: PendingTable, key: int) -> int:
    """Stream bits of `key` (slot i is bit i)."""
    return table.bits.get(key, 0) >> SHIFT


def test_marks_refresh_expire_and_discard(backend: Backend) -> None:
    now = [0.0]
    table = PendingTable(lambda: now[0], 2.0, shift=SHIFT, int_map=backend.int_map)
    assert table.add([1, 2, 3], slot=0, ns_id=5, fill=7) == 3
    assert table.add([2, 3, 4], slot=1, ns_id=5, fill=7) == 3
    assert marks(table, 2) == 0b11 and table.bits[2] & 0xFF == 7 and len(table) == 6
    now[0] = 1.0
    table.add([3], slot=0, ns_id=5, fill=7)  # refreshes (3, slot 0) until 3.0
    now[0] = 2.5
    table.expire()  # the marks of t=0 expire, except the refreshed (3, 0)
    assert (marks(table, 1), marks(table, 2), marks(table, 3), marks(table, 4)) == (0, 0, 1, 0)
    assert 1 not in table.bits and len(table) == 1 and table.namespaces() == {5}
    table.discard(3, 0)
    assert len(table) == 0 and not table.bits
    now[0] = 10.0
    table.expire()  # the refreshing mark expires with nothing left to drop
    assert table.namespaces() == set()


def test_discard_slot_and_namespace(backend: Backend) -> None:
    table = PendingTable(lambda: 0.0, 2.0, shift=SHIFT, int_map=backend.int_map)
    table.add([1, 2], slot=0, ns_id=1)
    table.add([2, 3], slot=1, ns_id=1)
    table.add([9], slot=1, ns_id=2)
    table.discard_slot(1)
    assert (marks(table, 1), marks(table, 2), marks(table, 3), marks(table, 9)) == (1, 1, 0, 0)
    table.add([9], slot=2, ns_id=2)
    table.discard_namespace(1)
    assert (marks(table, 1), marks(table, 2), marks(table, 9)) == (0, 0, 0b100)
    assert table.namespaces() == {2} and len(table) == 1
    table.clear()
    assert len(table) == 0 and not table.bits and table.namespaces() == set()


def test_cap_and_zero_ttl(backend: Backend) -> None:
    table = PendingTable(lambda: 0.0, 2.0, max_entries=5, shift=SHIFT, int_map=backend.int_map)
    assert table.add(range(4), slot=0, ns_id=1) == 4
    assert table.add(range(10, 20), slot=0, ns_id=1) == 1  # room for one more
    assert table.add([99], slot=1, ns_id=1) == 0 and len(table) == 5
    off = PendingTable(lambda: 0.0, 0.0, shift=SHIFT, int_map=backend.int_map)
    assert off.add([1], slot=0, ns_id=1) == 0 and not off.bits


def test_against_a_per_entry_model(backend: Backend) -> None:
    seed = int(os.environ.get("KVROUTE_TEST_SEED", "51"))
    print(f"pending seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    now = [0.0]
    table = PendingTable(lambda: now[0], 1.0, shift=SHIFT, int_map=backend.int_map)
    model: dict[tuple[int, int], float] = {}  # (key, slot) -> deadline
    for _ in range(400):
        now[0] += rng.random() * 0.2
        roll = rng.random()
        if roll < 0.6:
            slot = rng.randrange(4)
            keys = rng.sample(range(60), rng.randrange(1, 12))
            table.add(keys, slot=slot, ns_id=1)
            model.update(dict.fromkeys([(k, slot) for k in keys], now[0] + 1.0))
        elif roll < 0.8:
            key, slot = rng.randrange(60), rng.randrange(4)
            table.discard(key, slot)
            model.pop((key, slot), None)
        else:
            slot = rng.randrange(4)
            table.discard_slot(slot)
            model = {ks: d for ks, d in model.items() if ks[1] != slot}
        table.expire()
        model = {ks: d for ks, d in model.items() if d > now[0]}
        want: dict[int, int] = {}
        for key, slot in model:
            want[key] = want.get(key, 0) | 1 << slot
        assert {k: v >> SHIFT for k, v in table.bits.items()} == want
        assert len(table) == len(model)


def test_a_withdrawn_mark_gives_its_keys_back_to_the_standing_mark_before_it(
    backend: Backend,
) -> None:
    """A request that failed takes back its marks; a sibling's marks of the same keys stand
    (before, nothing could be taken back: a refused request's marks steered for the TTL)."""
    now = [0.0]
    table = PendingTable(lambda: now[0], 2.0, shift=SHIFT, int_map=backend.int_map)
    table.add([1, 2], slot=0, ns_id=1)  # a sibling on its way over blocks 1 and 2
    sibling = table.generation
    table.add([1, 2, 3], slot=0, ns_id=1)
    failed = table.generation
    table.add([9], slot=1, ns_id=1)  # another stream's mark, untouched
    assert table.withdraw(0, failed) == 1  # block 3: only the failed request marked it
    assert (marks(table, 1), marks(table, 2), marks(table, 3), marks(table, 9)) == (1, 1, 0, 2)
    assert table.withdraw(0, failed) == 0  # once
    # the sibling's mark still expires on time, taking 1 and 2 with it
    now[0] = 2.5
    table.expire()
    assert not table.bits and len(table) == 0
    assert table.withdraw(0, sibling) == 0  # expired: nothing to take back
    # a mark whose keys came from a mark withdrawn meanwhile drops them all
    table.add([4, 5], slot=0, ns_id=1)
    first = table.generation
    table.add([4, 5], slot=0, ns_id=1)
    second = table.generation
    assert table.withdraw(0, first) == 0  # refreshed by `second`: kept
    assert table.withdraw(0, second) == 2  # and `first`, withdrawn, gets nothing back
    assert not table.bits and len(table) == 0


def test_a_late_mark_lives_what_is_left_of_its_ttl(backend: Backend) -> None:
    """Another replica's decision NATS held up (`age_s`) lives the rest of its TTL, not a whole
    one from its arrival (QA: a decision held 2.6 s was predicted on a worker flushed since);
    one older than the TTL marks nothing. Its shorter deadline falls before older marks'."""
    now = [10.0]
    table = PendingTable(lambda: now[0], 2.0, shift=SHIFT, int_map=backend.int_map)
    assert table.add([1], slot=0, ns_id=1, age_s=2.0) == 0  # sent a TTL ago: nothing
    assert table.add([1], slot=0, ns_id=1, age_s=5.0) == 0 and not table.bits
    table.add([7], slot=0, ns_id=1)  # until 12.0
    own = table.generation
    table.add([8], slot=0, ns_id=1, age_s=1.5)  # until 10.5: before the mark above
    late = table.generation
    table.add([9], slot=0, ns_id=1, age_s=-3.0)  # a sender's clock ahead: taken as now (12.0)
    now[0] = 10.6
    table.expire()
    assert (marks(table, 7), marks(table, 8), marks(table, 9)) == (1, 0, 1)
    assert table.withdraw(0, late) == 0  # expired already
    table.add([8], slot=0, ns_id=1, age_s=1.0)  # until 11.6, sitting before `own`
    assert table.withdraw(0, table.generation) == 1  # found, though older marks end later
    assert table.withdraw(0, own) == 1 and marks(table, 7) == 0
    now[0] = 12.1
    table.expire()
    assert not table.bits and len(table) == 0


def test_late_marks_against_a_per_entry_model(backend: Backend) -> None:
    """Marks of all ages, withdrawals among them: each (key, slot) lives until the deadline of
    the latest mark on it standing, a withdrawn one giving its keys back to the one before."""
    seed = int(os.environ.get("KVROUTE_TEST_SEED", "52"))
    print(f"late pending seed={seed} backend={backend.name}")
    rng = random.Random(seed)
    now = [0.0]
    table = PendingTable(lambda: now[0], 1.0, shift=SHIFT, int_map=backend.int_map)
    # generation -> (slot, deadline, keys); per (key, slot) the generations that marked it
    standing: dict[int, tuple[int, float, list[int]]] = {}
    history: dict[tuple[int, int], list[int]] = {}
    for _ in range(500):
        now[0] += rng.random() * 0.2
        for generation in [g for g, (_, d, _) in standing.items() if d <= now[0]]:
            del standing[generation]  # expired (a withdrawal comes too late for it)
        if rng.random() < 0.75 or not standing:
            slot = rng.randrange(3)
            keys = rng.sample(range(40), rng.randrange(1, 8))
            age = rng.choice([0.0, 0.0, rng.random() * 1.2])
            if table.add(keys, slot=slot, ns_id=1, age_s=age):
                standing[table.generation] = (slot, now[0] + 1.0 - age, keys)
                for key in keys:
                    history.setdefault((key, slot), []).append(table.generation)
        else:
            generation = rng.choice(sorted(standing))
            slot = standing.pop(generation)[0]
            table.withdraw(slot, generation)
            for gens in history.values():
                if gens and gens[-1] == generation:
                    gens.pop()  # back to the mark before, if it stands
        table.expire()
        want: dict[int, int] = {}
        for (key, slot), gens in history.items():
            if gens and gens[-1] in standing:
                want[key] = want.get(key, 0) | 1 << slot
        assert {k: v >> SHIFT for k, v in table.bits.items()} == want


def test_twins_go_with_their_plain_keys_and_stay_within_the_marks(backend: Backend) -> None:
    """Keys marked in a namespace no event shows are tied to the plain keys of the same blocks
    (`twin`): a removal of a plain key drops its twins' marks on that slot, every extra_key's
    that has one; the ties of marks that lapsed are swept, and go with their slot's marks."""
    now = [0.0]
    table = PendingTable(lambda: now[0], 2.0, shift=SHIFT, int_map=backend.int_map)
    table.add([11, 12, 13], slot=0, ns_id=1)
    table.twin(0, [1, 2, 3], [11, 12, 13])
    table.add([21, 22], slot=0, ns_id=2)  # another extra_key's copy of blocks 1 and 2
    table.twin(0, [1, 2], [21, 22])
    table.add([11, 12, 13], slot=1, ns_id=1)
    table.twin(1, [1, 2, 3], [11, 12, 13])
    assert table.removed(0, [7]) == 0  # a plain key with no twin
    assert table.removed(0, [2]) == 2 and (marks(table, 12), marks(table, 22)) == (0b10, 0)
    assert (marks(table, 11), marks(table, 13), marks(table, 21)) == (0b11, 0b11, 1)
    assert table.removed(0, [2]) == 0  # its twins went with it
    assert table.removed(1, [1, 3]) == 2 and marks(table, 11) == marks(table, 13) == 1
    table.discard_slot(0)
    assert 0 not in table.twins and 1 in table.twins
    now[0] = 3.0
    table.expire()
    assert not table.twins and len(table) == 0  # no mark left on the slot: no twins
    # prompt after prompt, each one's marks lapsing once the next is made: a sweep keeps the
    # ties of the marked keys only
    for i in range(4):
        now[0] = 10.0 * i
        keys = list(range(10_000 * i + 1, 10_000 * i + 3001))
        table.add(keys, slot=2, ns_id=1)
        table.expire()
        table.twin(2, [k + 500_000 for k in keys], keys)
    assert len(table.twins[2]) == 3000
    assert table.removed(2, [1 + 500_000, 20_001 + 500_000]) == 0  # lapsed: nothing to drop
    assert table.removed(2, [30_001 + 500_000]) == 1 and marks(table, 30_001) == 0
