"""IntMap (`indexer._intmap`) against a plain dict: seeded random differential runs, errors, leaks.

The compiled map must be present: these tests fail when it is not built, unless
KVROUTE_PURE_PYTHON=1 says the pure-Python fallbacks are in use on purpose (then they skip).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

MapFactory = Callable[[bool], Any]


def _native() -> type[Any]:
    """The compiled IntMap type; fail (or skip under KVROUTE_PURE_PYTHON=1) when not built."""
    try:
        module = importlib.import_module("indexer._intmap")
    except ImportError as exc:
        if os.environ.get("KVROUTE_PURE_PYTHON") == "1":
            pytest.skip("KVROUTE_PURE_PYTHON=1: the compiled indexer._intmap is not in use")
        pytest.fail(
            f"indexer._intmap is not built ({exc}); run `python3 setup.py build_ext --inplace`"
            " or set KVROUTE_PURE_PYTHON=1"
        )
    intmap: type[Any] = module.IntMap
    return intmap


def _pure() -> type[Any]:
    """The pure-Python PyIntMap; skip while indexer.int_map does not exist yet."""
    try:
        module = importlib.import_module("indexer.int_map")
    except ModuleNotFoundError as exc:
        if exc.name != "indexer.int_map":
            raise
        pytest.skip("indexer.int_map (the PyIntMap fallback) does not exist yet")
    pure: type[Any] = module.PyIntMap
    return pure


@pytest.fixture(params=["native", "pure"])
def factory(request: pytest.FixtureRequest) -> MapFactory:
    """Both implementations, each called as factory(packed)."""
    cls = _native() if request.param == "native" else _pure()
    return lambda packed: cls(packed)


@pytest.fixture
def native() -> type[Any]:
    """The compiled IntMap type."""
    return _native()


# ------------------------------------------------------------------------ differential run


def _key_pool(rng: random.Random) -> list[int | bytes]:
    """Keys of every kind the map must handle, with sequential runs for clustering."""
    pool: list[int | bytes] = [INT64_MIN, INT64_MAX, -1, 0, 1, True, False, -2]
    pool += [INT64_MIN - 1, INT64_MAX + 1, 1 << 64, -(1 << 70), (1 << 200) + 3]
    pool += [b"", b"\x00", b"abc", b"\xff" * 32]
    pool += [rng.randrange(INT64_MIN, INT64_MAX + 1) for _ in range(3000)]
    pool += list(range(5000))  # vLLM-like sequential hashes must not cluster
    pool += [i << 32 for i in range(500)]  # low bits all zero
    pool += [rng.randbytes(rng.randrange(1, 16)) for _ in range(200)]
    return pool


def _value(rng: random.Random, packed: bool) -> int:
    roll = rng.random()
    if roll < 0.05:
        return rng.choice([INT64_MIN, INT64_MAX, -1, 0, True])
    if roll < 0.15 and not packed:
        return rng.choice([1 << 64, -(1 << 100), (1 << 300) + 1])
    if roll < 0.5:
        return rng.randrange(256)  # small ints are shared (interned) objects
    return rng.randrange(INT64_MIN, INT64_MAX + 1)


def _same(m: Any, model: dict[Any, int]) -> None:
    assert len(m) == len(model)
    assert dict(m.items()) == model
    assert sorted(map(repr, m)) == sorted(map(repr, m.keys()))
    assert len(m.keys()) == len(m.values()) == len(model)
    assert sorted(m.values()) == sorted(model.values())


def _differential(m: Any, packed: bool, seed: int, n_ops: int) -> None:
    """Apply n_ops random operations to m and a dict; every result and the contents agree."""
    rng = random.Random(seed)
    pool = _key_pool(rng)
    model: dict[Any, int] = {}
    missing = object()
    for step in range(n_ops):
        op = rng.random()
        k = rng.choice(pool)
        if op < 0.35:
            v = _value(rng, packed)
            m[k] = v
            model[k] = v
        elif op < 0.45:
            v = _value(rng, packed)
            assert m.setdefault(k, v) == model.setdefault(k, v)
        elif op < 0.55:
            assert m.get(k) == model.get(k)
            assert m.get(k, missing) == model.get(k, missing)
        elif op < 0.65:
            assert m.pop(k, missing) == model.pop(k, missing)
        elif op < 0.70:
            if k in model:
                del model[k]
                del m[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        elif op < 0.75:
            assert (k in m) == (k in model)
            if k in model:
                assert m[k] == model[k]
            else:
                with pytest.raises(KeyError):
                    m[k]
        elif op < 0.80:
            ks = rng.sample(pool, 40)
            want = [model.get(x, -7) for x in ks]
            assert m.get_many(ks, -7) == want
            assert m.get_many(tuple(ks), -7) == want
            assert m.get_many(iter(ks), -7) == want
            assert m.isdisjoint(ks) == model.keys().isdisjoint(ks)
        elif op < 0.84:
            # a run of sequential keys: many grow cycles and long shared probe runs
            base = rng.randrange(INT64_MIN, INT64_MAX - 4096)
            run = [(base + i, _value(rng, packed)) for i in range(rng.randrange(1, 1500))]
            m.update(run)
            model.update(run)
            if rng.random() < 0.7:
                for key, _ in run[: rng.randrange(len(run) + 1)]:
                    assert m.pop(key) == model.pop(key)
        elif op < 0.86:
            extra = {rng.choice(pool): _value(rng, packed) for _ in range(20)}
            m.update(extra)
            model.update(extra)
        elif op < 0.87:
            present = [x for x in model if rng.random() < 0.5]
            for x in present:
                assert m.pop(x) == model.pop(x)
        elif op < 0.872:
            m.clear()
            model.clear()
        elif op < 0.90:
            ks = rng.sample(pool, rng.randrange(0, 9))
            v = _value(rng, packed)
            m.assign(ks if rng.random() < 0.5 else iter(ks), v)
            model.update(dict.fromkeys(ks, v))
        elif op < 0.93:
            ks = [rng.choice(pool) for _ in range(rng.randrange(0, 9))]  # repeats included
            assert m.pop_many(ks, missing) == [model.pop(x, missing) for x in ks]
        elif op < 0.97:
            # mostly fresh keys (the store path's common case), sometimes a held or repeated one
            ks = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(rng.randrange(0, 9))]
            if ks and rng.random() < 0.3:
                ks[rng.randrange(len(ks))] = rng.choice([*pool, ks[0]])
            vs = [_value(rng, packed) for _ in ks]
            fresh = model.keys().isdisjoint(ks) and len(set(ks)) == len(ks)
            assert m.insert_new(ks, vs) is fresh
            if fresh:
                model.update(zip(ks, vs, strict=True))
            _same(m, model)
        else:
            assert len(m) == len(model)
        if step % 500 == 0:
            _same(m, model)
    _same(m, model)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_differential_against_dict(factory: MapFactory, packed: bool, seed: int) -> None:
    seed = seed * 7919 + int(os.environ.get("KVROUTE_TEST_SEED", "0"))
    print(f"seed={seed} packed={packed}")
    _differential(factory(packed), packed, seed, 6000)


@pytest.mark.parametrize("packed", [False, True])
def test_many_entries_grow_and_shrink(native: type[Any], packed: bool) -> None:
    m = native(packed)
    model: dict[int, int] = {}
    for i in range(60_000):
        key = i * 1_000_003 - 30_000
        m[key] = i
        model[key] = i
    big = sys.getsizeof(m)
    assert big >= 60_000 * 16
    assert dict(m.items()) == model
    for key in list(model)[:59_990]:
        assert m.pop(key) == model.pop(key)
    assert dict(m.items()) == model
    assert sys.getsizeof(m) < big // 100  # deletions give the memory back
    m.clear()
    assert len(m) == 0 and m.items() == [] and sys.getsizeof(m) < 200


# ----------------------------------------------------------------------------- API details


def test_keys_of_every_kind(native: type[Any]) -> None:
    m = native()
    keys: list[int | bytes] = [INT64_MIN, INT64_MAX, -1, 0, 1 << 64, -(1 << 64), b"", b"k"]
    for i, k in enumerate(keys):
        m[k] = i
    assert [m[k] for k in keys] == list(range(len(keys)))
    m[True] = 99  # bool keys are the ints 0/1, as in dict
    assert m[1] == 99 and m[True] == 99 and (False in m) == (0 in m)
    assert len(m) == len(keys) + 1

    class Sub(int):
        pass

    class BSub(bytes):
        pass

    m[Sub(5)] = 5
    m[Sub(1 << 70)] = 6
    m[BSub(b"zz")] = 7
    assert m[5] == 5 and m[1 << 70] == 6 and m[b"zz"] == 7
    assert {type(k) for k in m} == {int, bytes}  # stored normalized


def test_type_and_range_errors(native: type[Any]) -> None:
    m = native()
    p = native(True)
    for bad_key in (1.0, "1", None, (1,), bytearray(b"x")):
        for mm in (m, p):
            with pytest.raises(TypeError):
                mm[bad_key] = 1
            with pytest.raises(TypeError):
                mm[bad_key]
            with pytest.raises(TypeError):
                mm.get(bad_key)
            with pytest.raises(TypeError):
                mm.pop(bad_key, None)
            with pytest.raises(TypeError):
                bad_key in mm  # noqa: B015
            with pytest.raises(TypeError):
                mm.get_many([b"x", 1 << 70, 1, bad_key, b"y"], 0)
            with pytest.raises(TypeError):
                mm.isdisjoint([b"x", 1 << 70, 5, bad_key])
    for bad_value in (1.0, "1", None, b"1"):
        for mm in (m, p):
            with pytest.raises(TypeError):
                mm[1] = bad_value
            with pytest.raises(TypeError):
                mm[b"k"] = bad_value
            with pytest.raises(TypeError):
                mm.setdefault(2, bad_value)
    for big in (INT64_MAX + 1, INT64_MIN - 1, 1 << 100):
        with pytest.raises(OverflowError):
            p[1] = big
        with pytest.raises(OverflowError):
            p[1 << 80] = big
        m[1] = big
        assert m[1] == big
    p[1] = INT64_MAX
    p[2] = INT64_MIN
    assert p.get_many([1, 2, 3], None) == [INT64_MAX, INT64_MIN, None]
    assert len(p) == 2 and 1 not in m.keys()[1:]


def test_key_errors_and_arity(native: type[Any]) -> None:
    m = native()
    for key in (5, -1, 1 << 70, b"no"):
        with pytest.raises(KeyError) as info:
            m[key]
        assert info.value.args == (key,)
        with pytest.raises(KeyError):
            del m[key]
        with pytest.raises(KeyError):
            m.pop(key)
        assert m.pop(key, "d") == "d"
        assert m.get(key) is None
    with pytest.raises(TypeError):
        m.get()
    with pytest.raises(TypeError):
        m.get(1, 2, 3)
    with pytest.raises(TypeError):
        m.setdefault(1)
    with pytest.raises(TypeError):
        m.get_many([1])
    with pytest.raises(TypeError):
        native(1, 2)
    with pytest.raises(TypeError):
        hash(m)


def test_update_sources_and_partial_failure(native: type[Any]) -> None:
    m = native()
    m.update({1: 10, b"b": 20})
    m.update([(2, 30), [3, 40]])
    m.update(x for x in [(4, 50)])
    other = native(True)
    other.update({7: 70, 1 << 70: 80, -1: 90})
    m.update(other)
    m.update(m)  # self: no-op

    class Mapping:
        def keys(self) -> list[int]:
            return [5]

        def __getitem__(self, key: int) -> int:
            return key * 11

    m.update(Mapping())
    assert dict(m.items()) == {
        1: 10,
        b"b": 20,
        2: 30,
        3: 40,
        4: 50,
        7: 70,
        1 << 70: 80,
        -1: 90,
        5: 55,
    }
    packed = native(True)
    with pytest.raises(OverflowError):
        packed.update([*m.items(), (9, 1 << 64), (10, 1)])
    assert dict(packed.items()) == dict(m.items())  # pairs before the bad one stay applied
    with pytest.raises(ValueError):
        m.update([(1, 2, 3)])
    with pytest.raises(TypeError):
        m.update([5])
    with pytest.raises(TypeError):
        m.update(5)
    with pytest.raises(TypeError):
        m.update([(11, 1), (1.5, 2)])
    assert m[11] == 1
    big_obj = native(False)
    big_obj[1] = 1 << 64
    with pytest.raises(OverflowError):
        packed.update(big_obj)


def test_mutation_during_iteration_and_generators(native: type[Any]) -> None:
    m = native()
    m.update((i, i) for i in range(1000))
    m[b"x"] = 1
    for n, k in enumerate(m):
        del m[k]
        m[-(10 + n)] = 1  # rehashes under the iterator, which walks a snapshot
    assert len(m) == 1001

    def keys_mutating() -> Iterator[int]:
        for i in range(2000):
            m[i + 10_000] = i
            yield i + 10_000

    assert m.get_many(keys_mutating(), None) == list(range(2000))
    assert not m.isdisjoint(iter([1 << 70, 10_005]))
    assert m.isdisjoint([1 << 70, b"y", 99_999])


def test_setdefault_get_many_and_repr(native: type[Any]) -> None:
    for packed in (False, True):
        m = native(packed)
        assert m.setdefault(1, 5) == 5
        assert m.setdefault(1, 6) == 5
        assert m.setdefault(b"q", 7) == 7
        assert m.setdefault(b"q", 8) == 7
        sentinel = object()
        got = m.get_many([1, 2, b"q", b"r"], sentinel)
        assert got[0] == 5 and got[1] is sentinel and got[2] == 7 and got[3] is sentinel
        assert m.get_many([], 0) == [] and native(packed).get_many([1, b"a"], 0) == [0, 0]
        assert repr(m) == f"IntMap(n=2, packed={packed})"


# ----------------------------------------------------------------------------- leaks


def test_value_refcounts_return_to_baseline(native: type[Any]) -> None:
    value = (1 << 90) + 12345  # a private int object, so its refcount is ours alone
    okey = b"overflow-key-" + bytes(8)
    base_v, base_k = sys.getrefcount(value), sys.getrefcount(okey)
    m = native()
    for i in range(5000):
        m[i] = value
    m[okey] = value
    m[1 << 70] = value
    assert sys.getrefcount(value) == base_v + 5002
    for i in range(0, 5000, 2):
        del m[i]
    for i in range(1, 2000, 2):
        assert m.pop(i) is value
    assert sys.getrefcount(value) == base_v + 1500 + 2
    assert m.setdefault(4001, 0) is value
    for i in range(2001, 5000, 2):
        m[i] = 7  # overwrite drops the old reference
    m.update({okey: 3})
    assert sys.getrefcount(value) == base_v + 1
    m.clear()
    assert sys.getrefcount(value) == base_v and sys.getrefcount(okey) == base_k
    m[3] = value
    del m
    assert sys.getrefcount(value) == base_v


@pytest.mark.parametrize("packed", [False, True])
def test_build_and_clear_does_not_grow_memory(native: type[Any], packed: bool) -> None:
    keys: list[int | bytes] = [*range(-3000, 3000), 1 << 65, b"k"]

    def cycle() -> None:
        m = native(packed)
        for k in keys:
            m[k] = 1 << 62
        m.get_many(keys, 0)
        m.items()
        for k in keys[::3]:
            m.pop(k)
        m.clear()
        for k in keys[:50]:
            m.setdefault(k, 5)
        del m

    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(5):
            cycle()
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            cycle()
        last = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert last - first < 4096, (first, last)


def test_arrays_are_traced_and_sizeof_is_honest(native: type[Any]) -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        m = native(True)
        for i in range(100_000):
            m[i] = i
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    size = sys.getsizeof(m)
    assert size > 100_000 * 16 and abs(used - size) < size // 10
    assert size / len(m) <= 16 * 100 / 37.5 + 1  # after growth the load is at least 3/8


def test_finalizers_mutating_the_map_mid_operation(native: type[Any]) -> None:
    """A garbage collection inside an allocation may run a __del__ that changes the map."""
    m = native()
    fired = [0]

    class Mutator:
        def __init__(self) -> None:
            self.cycle = self  # only the cyclic collector frees it, at an arbitrary allocation

        def __del__(self) -> None:
            fired[0] += 1
            n = fired[0]
            if n % 3 == 0:
                m.clear()
            else:
                m.update([(n * 7919 + i, i) for i in range(50)] + [(b"o%d" % n, n)])

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        for i in range(300):
            Mutator()
            m[1 << (65 + i % 3)] = i
            source = {b"a%d" % i: i, 1 << 70: i, i: i}
            m.update(source)
            items = m.items()
            assert len(m.keys()) >= 0 and all(len(pair) == 2 for pair in items)
            m.setdefault(b"s%d" % i, i)
            other = native()
            other.update(m)
            assert len(other.items()) == len(other)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    assert fired[0] > 0
    assert len(m.items()) == len(m) == len(m.keys()) == len(m.values())


def test_bulk_methods_errors_leave_the_map_sane(native: type[Any]) -> None:
    m = native(True)
    m.update([(1, 10), (2, 20)])
    with pytest.raises(ValueError):
        m.insert_new([3, 4], [30])
    with pytest.raises(OverflowError):
        m.insert_new([5, 6, 7], [50, 2**70, 70])  # the second value does not fit: all undone
    assert sorted(m.items()) == [(1, 10), (2, 20)]
    with pytest.raises(TypeError):
        m.insert_new([8, 1.5], [80, 90])  # a bad key after a good one: undone too
    assert sorted(m.items()) == [(1, 10), (2, 20)]
    with pytest.raises(TypeError):
        m.assign([3, 4.5], 7)  # keys before the bad one stay assigned, as with update
    assert m[3] == 7 and len(m) == 3
    with pytest.raises(TypeError):
        m.pop_many([1, None], 0)  # keys before the bad one stay popped, as with pop
    assert 1 not in m and len(m) == 2
    for method, n in (("assign", 2), ("pop_many", 2), ("insert_new", 2)):
        with pytest.raises(TypeError):
            getattr(m, method)(*range(n + 1))
    with pytest.raises(TypeError):
        m.assign(5, 1)  # not iterable


def test_bulk_methods_keep_value_refcounts_exact(native: type[Any]) -> None:
    value = 10**30 + 7  # a fresh int object nobody else holds
    base = sys.getrefcount(value)
    m = native(False)
    m.assign([1, 2, 3, b"x"], value)
    assert sys.getrefcount(value) == base + 4
    assert m.insert_new([4, 5, 4], [value] * 3) is False  # repeated key: rolled back
    assert not m.insert_new([6, 1], [value, value])  # a held key: nothing inserted
    assert sys.getrefcount(value) == base + 4
    assert m.insert_new([7, 8], [value, value]) is True
    assert sys.getrefcount(value) == base + 6
    popped = m.pop_many([1, 2, 3, b"x", 7, 8, 99], None)
    assert popped == [value] * 6 + [None]
    del popped
    assert sys.getrefcount(value) == base and len(m) == 0


@pytest.mark.parametrize("seed", [5, int(os.environ.get("KVROUTE_TEST_SEED", "6"))])
def test_pop_by_value_against_dict(factory: MapFactory, seed: int) -> None:
    print(f"pop_by_value seed={seed}")
    rng = random.Random(seed)
    pool = _key_pool(rng)
    m = factory(True)
    model: dict[Any, int] = {}
    values = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(300)] + [-1, 0, INT64_MIN]
    for _ in range(3000):
        k, v = rng.choice(pool), rng.choice(values)
        m[k] = v
        model[k] = v
    other = factory(True)
    chosen = [*rng.sample(values, 120), -1]
    other.assign(chosen, 7)
    gone = m.pop_by_value(other)
    want = {k: v for k, v in model.items() if v in set(chosen)}
    assert dict(gone) == want and len(gone) == len(want)
    assert dict(m.items()) == {k: v for k, v in model.items() if k not in want}
    assert m.pop_by_value(other) == []


def test_pop_by_value_needs_packed_intmaps(native: type[Any]) -> None:
    with pytest.raises(TypeError):
        native(False).pop_by_value(native(True))
    with pytest.raises(TypeError):
        native(True).pop_by_value({1: 2})


# ------------------------------------------------------- regressions found by the C review


class _Cyclic:
    """Garbage only the cyclic collector frees; its __del__ runs `action` at that point."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.cycle = self

    def __del__(self) -> None:
        self.action()


@contextlib.contextmanager
def _collect_at_next_allocation(action: Callable[[], None]) -> Iterator[None]:
    """Leave one _Cyclic as garbage with a threshold that collects at the next allocation."""
    old = gc.get_threshold()
    gc.collect()
    gc.disable()
    _Cyclic(action)
    gc.set_threshold(1, 1, 1)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.collect()


@pytest.mark.parametrize("packed", [True, False])
def test_get_many_survives_a_finalizer_that_empties_the_key_list(
    native: type[Any], packed: bool
) -> None:
    # get_many used to read the list's item array and size, then allocate its result: a
    # collection in that allocation ran this __del__, which freed the array (use after free)
    m = native(packed)
    m.update([(i, i) for i in range(100)])
    keys: list[Any] = [10**6 + i for i in range(2000)]

    def refill() -> None:
        keys.clear()
        keys.extend([b"x", 5, 10**6])

    with _collect_at_next_allocation(refill):
        got = m.get_many(keys, None)
    assert got in ([None] * 2000, [None, 5, None])
    assert keys == [b"x", 5, 10**6]


@pytest.mark.parametrize("when", range(1, 9))
def test_pop_by_value_survives_a_finalizer_that_clears_the_map(
    native: type[Any], when: int
) -> None:
    # the overflow pass used to call PyDict_Items and PyDict_DelItem on m's overflow dict after
    # allocating; a __del__ run there that cleared m left a NULL dict (segfault) or a freed one
    m = native(True)
    other = native(True)
    other[5] = 1
    m.update([(b"k%d" % i, 5) for i in range(50)] + [(i, 5) for i in range(3)] + [(9, 6)])
    fired = [0]

    def clear_on_nth() -> None:
        fired[0] += 1
        if fired[0] == when:
            m.clear()
        else:
            _Cyclic(clear_on_nth)  # more garbage: the next allocation collects again

    with _collect_at_next_allocation(clear_on_nth):
        gone = m.pop_by_value(other)
    assert fired[0] >= 1
    assert all(v == 5 for _, v in gone) and len({k for k, _ in gone}) == len(gone)
    assert len(m.items()) == len(m) <= 1


def test_pop_by_value_of_itself_matches_the_python_twin(factory: MapFactory) -> None:
    # m.pop_by_value(m) decided the overflow entries after deleting the array ones, so an
    # overflow value naming a just-deleted array key was kept; PyIntMap decides all first
    m = factory(True)
    m.update({5: 6, 6: 0, -1: 5, b"b": -1, 2**64: 7, 7: 8})
    gone = m.pop_by_value(m)
    assert sorted(gone, key=repr) == sorted([(5, 6), (-1, 5), (b"b", -1), (2**64, 7)], key=repr)
    assert dict(m.items()) == {6: 0, 7: 8}


def test_slot_positions_are_keyed_per_process(native: type[Any]) -> None:
    # block keys come from client-chosen tokens: slots must not be predictable across processes
    import subprocess

    code = (
        "from indexer._intmap import IntMap\n"
        "m = IntMap(True)\n"
        "m.update((i, i) for i in range(64))\n"
        "print(m.keys())\n"
    )
    orders = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(3)
    }
    assert len(orders) > 1  # the same inserts, another layout in another process


def test_or_many_against_dict(factory: MapFactory) -> None:
    m = factory(False)
    model: dict[Any, int] = {}
    rng = random.Random(61)
    for _ in range(300):
        keys = [
            rng.choice([*range(-3, 40), 2**70, b"k", INT64_MIN]) for _ in range(rng.randrange(9))
        ]
        mask = rng.choice([1, 1 << 60, 1 << 100, 0, 5])
        m.or_many(keys if rng.random() < 0.5 else iter(keys), mask)
        for k in keys:
            model[k] = model.get(k, 0) | mask
        assert dict(m.items()) == model


def test_or_many_over_long_runs_of_shared_values_against_dict(factory: MapFactory) -> None:
    # a routed prompt's marks: hundreds of keys, runs of them sharing one value object (assign
    # stores one for all), new keys that grow the array mid-call, a key twice in one call
    m = factory(False)
    model: dict[Any, int] = {}
    rng = random.Random(67)
    for step in range(60):
        base = rng.randrange(0, 4000)
        run = list(range(base, base + rng.randrange(1, 700)))
        value = (1 << rng.randrange(40, 90)) | step
        m.assign(run, value)
        model.update(dict.fromkeys(run, value))
        keys = run[rng.randrange(len(run)) :] + [rng.randrange(-50, 5000) for _ in range(300)]
        keys += keys[:3]
        mask = 1 << rng.randrange(30, 100)
        m.or_many(keys, mask)
        for k in keys:
            model[k] = model.get(k, 0) | mask
        assert len(m) == len(model)
        assert dict(m.items()) == model


def test_or_many_refuses_packed_maps_and_bad_masks(native: type[Any]) -> None:
    with pytest.raises(TypeError):
        native(True).or_many([1], 1)
    with pytest.raises(TypeError):
        native(False).or_many([1], 1.5)
    m = native(False)
    with pytest.raises(TypeError):
        m.or_many([1, 2.5, 3], 4)  # the key before the bad one stays updated
    assert dict(m.items()) == {1: 4}
