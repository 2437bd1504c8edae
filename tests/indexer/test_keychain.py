"""`indexer._keychain` against the Python chain: identical keys on every input, same errors.

The keys are persisted (snapshots, recordings), so equality is checked three ways: against
`indexer.namespace` (`chain_keys`, `py_chain`, `partial_key`) and against a literal
`hash((prev, tuple(block)))` loop written here, over seeded random inputs that mix in every
kind of item the fast path must hand to the general one.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tracemalloc
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest

from indexer.namespace import chain_keys, partial_key, py_chain

try:
    from indexer import _keychain as _compiled

    _COMPILED: ModuleType | None = _compiled
    _IMPORT_ERROR = ""
except ImportError as exc:  # not built: the fixture below decides between fail and skip
    _COMPILED = None
    _IMPORT_ERROR = str(exc)

MODULUS = 2**61 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Items the fast path (exact ints in [0, 2**30)) must pass to the general one, and its edges.
SPECIAL_TOKENS: list[Hashable] = [
    0,
    1,
    -1,
    -2,
    2**30 - 1,
    2**30,
    -(2**30),
    MODULUS,
    MODULUS + 1,
    -MODULUS,
    3 * MODULUS,
    -5 * MODULUS + 1,
    2**61,
    INT64_MAX,
    INT64_MIN,
    2**64 + 5,
    -(2**200) - 7,
    True,
    False,
    "token",
    (1, 2),
]
SPECIAL_PREVS = [0, 1, -1, -2, MODULUS, -MODULUS, 2**61, INT64_MAX, INT64_MIN, 2**64 + 3, -(2**99)]


@pytest.fixture(scope="module")
def kc() -> ModuleType:
    """The compiled module; its absence fails unless KVROUTE_PURE_PYTHON=1 asks for fallbacks."""
    if _COMPILED is None:
        if os.environ.get("KVROUTE_PURE_PYTHON", "") not in ("", "0"):
            pytest.skip(f"KVROUTE_PURE_PYTHON=1: indexer._keychain not built ({_IMPORT_ERROR})")
        pytest.fail(
            f"indexer._keychain not built ({_IMPORT_ERROR}): run "
            "`python3 setup.py build_ext --inplace`, or set KVROUTE_PURE_PYTHON=1"
        )
    return _COMPILED


@pytest.fixture
def rng() -> Iterator[random.Random]:
    """A seeded generator; the seed is printed (shown on failure) and can be forced by env."""
    seed = int(os.environ.get("KVROUTE_TEST_SEED", random.randrange(2**32)))
    print(f"seed={seed} (rerun with KVROUTE_TEST_SEED={seed})")
    yield random.Random(seed)


def literal_chain(
    prev: int, tokens: Sequence[Hashable], block_size: int, start: int = 0, count: int = -1
) -> list[int]:
    """The specification, spelled out: one real tuple hash per full block."""
    full = len(tokens) // block_size
    stop = full if count < 0 else min(full, start + count)
    keys = []
    for i in range(start, stop):
        prev = hash((prev, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(prev)
    return keys


def random_tokens(rng: random.Random, n: int, special_share: float) -> list[Hashable]:
    """Token ids as a tokenizer makes them, with a share of special items mixed in."""
    return [
        rng.choice(SPECIAL_TOKENS) if rng.random() < special_share else rng.randrange(300_000)
        for _ in range(n)
    ]


def random_prev(rng: random.Random) -> int:
    """A chain start anywhere in (and a little beyond) the int64 range."""
    if rng.random() < 0.2:
        return rng.choice(SPECIAL_PREVS)
    return rng.randrange(INT64_MIN, INT64_MAX + 1)


def test_random_chains_equal_python(kc: ModuleType, rng: random.Random) -> None:
    for case in range(2000):
        n = rng.choice([0, 1, rng.randrange(0, 40), rng.randrange(0, 400)])
        block_size = rng.choice([1, 2, 3, 16, rng.randrange(1, 40)])
        tokens = random_tokens(rng, n, rng.choice([0.0, 0.02, 0.3]))
        prev = random_prev(rng)
        start = rng.choice([0, 0, 1, rng.randrange(0, 30)])
        count = rng.choice([-1, -1, 0, 1, rng.randrange(-3, 30)])
        want = literal_chain(prev, tokens, block_size, start, count)
        ctx = f"case {case}: n={n} bs={block_size} start={start} count={count} prev={prev}"
        assert py_chain(prev, tokens, block_size, start, count) == want, ctx
        assert kc.chain(prev, tokens, block_size, start, count) == want, ctx
        assert kc.chain(prev, tuple(tokens), block_size, start, count) == want, ctx
        if start == 0 and count < 0:
            assert kc.chain(prev, tokens, block_size) == chain_keys(prev, tokens, block_size)
        cut = rng.randrange(0, block_size + 1)
        assert kc.partial(prev, tokens[:cut]) == partial_key(prev, tokens[:cut]), ctx
        assert kc.partial(prev, tuple(tokens[:cut])) == partial_key(prev, tokens[:cut]), ctx


def test_prompt_sized_chain_equals_python(kc: ModuleType, rng: random.Random) -> None:
    tokens = random_tokens(rng, 8192, 0.0)
    for _ in range(5):
        prev = random_prev(rng)
        want = chain_keys(prev, tokens, 16)
        assert len(want) == 512
        assert kc.chain(prev, tokens, 16) == want
        # resuming from any stored key continues the same chain (how events extend a parent)
        cut = rng.randrange(1, 512)
        assert kc.chain(want[cut - 1], tokens, 16, cut) == want[cut:]
        assert kc.chain(want[cut - 1], tokens, 16, cut, 7) == want[cut : cut + 7]
        assert kc.chain(prev, tokens, 16, cut, 7) == py_chain(prev, tokens, 16, cut, 7)


def test_other_sequences_equal_python(kc: ModuleType, rng: random.Random) -> None:
    prev = random_prev(rng)
    assert kc.chain(prev, range(1000), 16) == literal_chain(prev, list(range(1000)), 16)
    assert kc.chain(prev, range(1000), 16, 3, 5) == literal_chain(prev, range(1000), 16, 3, 5)
    assert kc.chain(prev, range(-50, 50), 7) == literal_chain(prev, list(range(-50, 50)), 7)
    assert kc.partial(prev, range(9)) == partial_key(prev, range(9))
    word = "abcdefghij"  # a str is a sequence of hashable 1-char strs
    assert kc.chain(prev, word, 3) == literal_chain(prev, word, 3)


def test_special_items_one_at_a_time(kc: ModuleType, rng: random.Random) -> None:
    # each special item alone, at every position of a block, on the fast path's edge
    for item in SPECIAL_TOKENS:
        for pos in range(4):
            tokens: list[Hashable] = [rng.randrange(1000) for _ in range(12)]
            tokens[pos * 3 + 1] = item
            prev = random_prev(rng)
            want = literal_chain(prev, tokens, 3)
            assert kc.chain(prev, tokens, 3) == want, (item, pos)
            assert kc.chain(prev, tuple(tokens), 3) == want, (item, pos)
            assert kc.partial(prev, tokens) == partial_key(prev, tokens), (item, pos)


def test_empty_and_short_inputs(kc: ModuleType) -> None:
    assert kc.chain(5, [], 16) == []
    assert kc.chain(5, (), 1) == []
    assert kc.chain(5, list(range(15)), 16) == []  # a lone partial block is never keyed
    assert kc.chain(5, list(range(17)), 16) == literal_chain(5, list(range(17)), 16)
    assert kc.chain(5, list(range(64)), 16, 4) == []
    assert kc.chain(5, list(range(64)), 16, 0, 0) == []
    assert kc.partial(5, []) == hash((5, (), 0))
    assert kc.partial(-1, ()) == hash((-1, (), 0))


def test_huge_start_and_count_are_clamped_not_errors(kc: ModuleType) -> None:
    tokens = list(range(40))
    want = literal_chain(9, tokens, 4)
    assert kc.chain(9, tokens, 4, 0, 2**100) == want
    assert kc.chain(9, tokens, 4, 0, -(2**100)) == want
    assert kc.chain(9, tokens, 4, 2**100) == []
    assert kc.chain(9, tokens, 2**100) == []


def test_int_hash_equals_hash(kc: ModuleType, rng: random.Random) -> None:
    edges = [m * MODULUS + d for m in range(-6, 7) for d in (-2, -1, 0, 1, 2)]
    edges += [INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, 2**64, -(2**64), 2**1000 + 1]
    edges += [True, False, -(2**30), 2**30, 2**30 - 1, 2**60, -(2**60)]
    for x in edges:
        assert kc.int_hash(x) == hash(x), x
    for _ in range(20_000):
        x = rng.randrange(INT64_MIN, INT64_MAX + 1) >> rng.randrange(64)
        assert kc.int_hash(x) == hash(x), x
        assert kc.int_hash(-x) == hash(-x), -x


def test_int_subclass_prev_keeps_its_own_hash(kc: ModuleType) -> None:
    class Odd(int):
        def __hash__(self) -> int:
            return 12345

    tokens = list(range(32))
    want = literal_chain(Odd(7), tokens, 8)
    assert want != literal_chain(7, tokens, 8)
    assert kc.chain(Odd(7), tokens, 8) == want
    assert kc.partial(Odd(7), tokens[:3]) == hash((Odd(7), (0, 1, 2), 3))
    assert kc.int_hash(Odd(7)) == 12345


def test_bad_arguments_raise_like_python(kc: ModuleType) -> None:
    tokens = list(range(32))
    for block_size in (0, -1, -(2**100)):
        with pytest.raises(ValueError, match="block_size"):
            kc.chain(1, tokens, block_size)
        with pytest.raises(ValueError, match="block_size"):
            py_chain(1, tokens, block_size)
    with pytest.raises(ValueError, match="start"):
        kc.chain(1, tokens, 4, -1)
    with pytest.raises(ValueError, match="start"):
        py_chain(1, tokens, 4, -1)
    bad_calls: list[Callable[[], Any]] = [
        lambda: kc.chain("seed", tokens, 4),
        lambda: kc.chain(1.5, tokens, 4),
        lambda: kc.chain(None, tokens, 4),
        lambda: kc.chain(1, tokens, 4.0),
        lambda: kc.chain(1, tokens, 4, "0"),
        lambda: kc.chain(1, tokens, 4, 0, None),
        lambda: kc.chain(1, 12345, 4),
        lambda: kc.chain(1, {1, 2, 3, 4}, 2),
        lambda: kc.chain(1, tokens),
        lambda: kc.chain(1, tokens, 4, 0, -1, 0),
        lambda: kc.chain(prev=1, tokens=tokens, block_size=4),
        lambda: kc.partial("seed", tokens),
        lambda: kc.partial(1, 5),
        lambda: kc.partial(1),
        lambda: kc.int_hash("1"),
        lambda: kc.int_hash(1.0),
    ]
    for call in bad_calls:
        with pytest.raises(TypeError):
            call()


def test_unhashable_token_raises_the_error_hash_raises(kc: ModuleType) -> None:
    with pytest.raises(TypeError) as expected:
        hash([1])
    tokens: list[Hashable] = [*range(10), [1], *range(10)]  # type: ignore[list-item]
    calls: list[Callable[[], object]] = [
        lambda: kc.chain(3, tokens, 4),
        lambda: kc.chain(3, tuple(tokens), 4),
        lambda: kc.chain(3, tokens, 4, 1),
        lambda: kc.partial(3, tokens),
    ]
    for call in calls:
        with pytest.raises(TypeError) as got:
            call()
        assert str(got.value) == str(expected.value)
    # a block after the unhashable one is not reached; blocks before it are still fine
    assert kc.chain(3, tokens, 4, 0, 2) == literal_chain(3, tokens, 4, 0, 2)


def test_an_error_from_a_tokens_hash_propagates(kc: ModuleType) -> None:
    class Boom:
        def __hash__(self) -> int:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        kc.chain(0, [1, 2, Boom(), 4], 2)
    with pytest.raises(RuntimeError, match="boom"):
        kc.partial(0, [Boom()])


def test_a_hash_that_mutates_the_tokens_cannot_corrupt(kc: ModuleType) -> None:
    # A token whose __hash__ refills the very list being keyed (freeing its item array, whose
    # memory the refill then reuses): the compiled chain must not read the stale array, and
    # (like the Python chain, which slices first) keys the tokens it was passed.
    class Refilling:
        def __init__(self, victim: list[Hashable]) -> None:
            self.victim = victim

        def __hash__(self) -> int:
            size = len(self.victim)
            self.victim.clear()
            self.victim.extend([-3] * size)
            return 77

    def victim_and_reference(position: int) -> tuple[list[Hashable], list[Hashable]]:
        victim: list[Hashable] = [*range(1000, 1032)]
        reference = list(victim)
        victim[position] = Refilling(victim)
        reference[position] = Refilling([])
        return victim, reference

    for position in (0, 5, 31):
        victim, reference = victim_and_reference(position)
        want = literal_chain(4, reference, 8)
        assert kc.chain(4, victim, 8) == want
        assert victim == [-3] * 32
        victim, reference = victim_and_reference(position)
        assert kc.partial(4, victim) == partial_key(4, reference)
        assert victim == [-3] * 32


def test_no_reference_leaks(kc: ModuleType) -> None:
    # built at run time: a literal would be a module constant shared with other tests' data
    big = int("18446744073709551621")  # a token taking the general path
    tokens = [*range(40), big, *range(23)]
    prev = int("1180591620717411303425")  # a prev hashed through PyObject_Hash
    unhashable: list[Hashable] = [1, 2, [3], 4]  # type: ignore[list-item]

    def calls() -> None:
        kc.chain(prev, tokens, 16)
        kc.chain(-12345, tokens, 8, 1, 3)
        kc.chain(7, range(64), 16)
        kc.partial(prev, tokens[:5])
        kc.int_hash(big)
        with pytest.raises(TypeError):
            kc.chain(0, unhashable, 2)
        with pytest.raises(TypeError):
            kc.partial(0, unhashable)

    gc.collect()
    before = sys.getrefcount(big), sys.getrefcount(tokens), sys.getrefcount(prev)
    for _ in range(200):
        calls()
    gc.collect()
    assert (sys.getrefcount(big), sys.getrefcount(tokens), sys.getrefcount(prev)) == before

    # 100k calls under tracemalloc stay flat: one leaked int per call would be ~3 MB
    tracemalloc.start()
    try:
        for _ in range(1000):
            kc.chain(prev, tokens, 16)
        gc.collect()
        start_bytes, _ = tracemalloc.get_traced_memory()
        for _ in range(100_000):
            kc.chain(prev, tokens, 16)
        for _ in range(5000):
            calls()
        gc.collect()
        end_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end_bytes - start_bytes < 64 * 1024, end_bytes - start_bytes


@pytest.mark.parametrize("shrink", [True, False])
@pytest.mark.parametrize("function", ["chain", "partial"])
def test_a_finalizer_that_empties_the_tokens_mid_copy_cannot_corrupt(
    kc: ModuleType, function: str, shrink: bool
) -> None:
    # A slow token makes chain/partial snapshot the caller's list. They used PyList_GetSlice /
    # PyList_AsTuple, which allocate and then copy from the item array seen before: a garbage
    # collection inside that allocation ran this __del__, which freed it (a read of freed
    # memory, a segfault). The snapshot is now allocated first, then filled and size-checked.
    def call(tokens: list[Hashable]) -> object:
        if function == "chain":
            return kc.chain(7, tokens, 4)
        return kc.partial(7, tokens)

    tokens: list[Hashable] = [*range(64), "slow", *range(3000)]
    original = list(tokens)

    class Mutator:
        def __init__(self) -> None:
            self.cycle = self  # only the cyclic collector frees it

        def __del__(self) -> None:
            if shrink:
                tokens.clear()
            tokens.extend([1] * 3)

    def arm() -> None:
        # leave a Mutator as garbage, collected at the next GC-tracked allocation
        gc.collect()
        gc.disable()
        Mutator()
        gc.set_threshold(1, 1, 1)
        gc.enable()

    old = gc.get_threshold()
    try:
        if shrink:
            with pytest.raises(RuntimeError, match="changed size"):
                arm()
                call(tokens)
        else:  # grown: the tokens the call was given are keyed
            arm()
            got = call(tokens)
            gc.set_threshold(*old)
            assert got == call(original)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    assert tokens[-3:] == [1, 1, 1]
