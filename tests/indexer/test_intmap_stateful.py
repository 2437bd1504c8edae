"""IntMap (both modes) and PyIntMap driven together by a hypothesis state machine.

Every step applies one method (the mapping basics and the index's bulk calls) to the compiled
map, to its pure-Python twin and to a plain dict model; results and contents must agree after
each. Keys mix the array's int64 range (edges, 0, dense small ints) with everything that lives
in the overflow dict (-1, ints past int64, bytes) and bools. Runs with the compiled map are
required: its absence fails the test unless KVROUTE_PURE_PYTHON=1 (then the twin runs alone).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import hypothesis
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from indexer.backend import NATIVE, PURE_REQUESTED
from indexer.int_map import PyIntMap
from tests.indexer.backends import native_or_skip

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EDGES = [INT64_MIN, INT64_MIN + 1, INT64_MAX, -2, -1, 0, 1, True, False]
BEYOND = [INT64_MIN - 1, INT64_MAX + 1, 2**64, -(2**70), 2**200 + 3]

KEYS = st.one_of(
    st.sampled_from([*EDGES, *BEYOND, b"", b"\x00", b"k"]),
    st.integers(-20, 20),  # dense: the same keys come back, sequential runs share probes
    st.integers(INT64_MIN, INT64_MAX),
    st.integers(-(2**80), 2**80),
    st.binary(max_size=3),
)
VALUES = st.one_of(
    st.sampled_from([*EDGES, *BEYOND]),
    st.integers(-5, 300),
    st.integers(INT64_MIN, INT64_MAX),
    st.integers(-(2**90), 2**90),
)
SHAPES = st.sampled_from(["list", "tuple", "iter"])
MISSING = object()  # a default no map holds

# 100 examples of 50 steps: 10-20 s a test on a quiet two-core machine, and over the suite's
# 60 s once under load (CI, 2026-12-06): hypothesis's time is no finding here
pytestmark = pytest.mark.timeout(240)

SETTINGS = hypothesis.settings(
    max_examples=int(os.environ.get("KVROUTE_STATEFUL_EXAMPLES", "100")),
    stateful_step_count=50,
    deadline=None,  # two shared cores: timing says nothing here
    database=None,  # no .hypothesis directory in the checkout
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)


def _shaped(keys: list[Any], shape: str) -> Iterable[Any]:
    """The same keys as a list, a tuple (the bulk calls' fast path) or a one-shot iterator."""
    if shape == "tuple":
        return tuple(keys)
    return iter(keys) if shape == "iter" else list(keys)


class IntMapMachine(RuleBasedStateMachine):
    """The maps of IMPLS (each built as cls(PACKED)) against a dict model."""

    PACKED: ClassVar[bool] = True
    IMPLS: ClassVar[tuple[type[Any], ...]] = (PyIntMap,)

    def __init__(self) -> None:
        super().__init__()
        self.maps: list[Any] = [cls(self.PACKED) for cls in self.IMPLS]
        self.model: dict[Any, int] = {}

    # ------------------------------------------------------------------------------ helpers

    def _checked(self) -> list[Any]:
        """The maps that type-check keys and values (the compiled one; PyIntMap is a dict)."""
        return [m for m in self.maps if not isinstance(m, PyIntMap)]

    def _fit(self, value: int) -> int:
        """`value`, or for a packed map an int64 standing in for it."""
        if self.PACKED and not INT64_MIN <= value <= INT64_MAX:
            return value % INT64_MAX
        return value

    def _key(self, data: st.DataObject) -> Any:
        """A key: often one the model holds, else any kind."""
        if self.model and data.draw(st.booleans()) is True:
            return data.draw(st.sampled_from(list(self.model)))
        return data.draw(KEYS)

    def _keys(self, data: st.DataObject, max_size: int = 10) -> list[Any]:
        return [self._key(data) for _ in range(data.draw(st.integers(0, max_size)))]

    def _all(self, call: Callable[[Any], Any], want: Any) -> None:
        for m in self.maps:
            assert call(m) == want, type(m).__name__

    # -------------------------------------------------------------------------------- rules

    @rule(data=st.data(), value=VALUES)
    def setitem(self, data: st.DataObject, value: int) -> None:
        key = self._key(data)
        if self._fit(value) != value:
            for m in self._checked():
                with pytest.raises(OverflowError):
                    m[key] = value
            return
        for m in self.maps:
            m[key] = value
        self.model[key] = value

    @rule(data=st.data())
    def delitem(self, data: st.DataObject) -> None:
        key = self._key(data)
        present = key in self.model
        self.model.pop(key, None)
        for m in self.maps:
            if present:
                del m[key]
            else:
                with pytest.raises(KeyError):
                    del m[key]

    @rule(data=st.data())
    def lookups(self, data: st.DataObject) -> None:
        key = self._key(data)
        self._all(lambda m: key in m, key in self.model)
        self._all(lambda m: m.get(key), self.model.get(key))
        self._all(lambda m: m.get(key, MISSING), self.model.get(key, MISSING))
        for m in self.maps:
            if key in self.model:
                assert m[key] == self.model[key]
            else:
                with pytest.raises(KeyError):
                    m[key]

    @rule(data=st.data(), with_default=st.booleans())
    def pop(self, data: st.DataObject, with_default: bool) -> None:
        key = self._key(data)
        if with_default:
            want = self.model.pop(key, MISSING)
            self._all(lambda m: m.pop(key, MISSING), want)
        elif key in self.model:
            want = self.model.pop(key)
            self._all(lambda m: m.pop(key), want)
        else:
            for m in self.maps:
                with pytest.raises(KeyError):
                    m.pop(key)

    @rule(data=st.data(), value=VALUES)
    def setdefault(self, data: st.DataObject, value: int) -> None:
        key = self._key(data)
        if self._fit(value) != value:
            for m in self._checked():  # the default is checked even for a held key
                with pytest.raises(OverflowError):
                    m.setdefault(key, value)
            return
        want = self.model.setdefault(key, value)
        self._all(lambda m: m.setdefault(key, value), want)

    @rule(data=st.data(), values=st.lists(VALUES, max_size=12), source=st.integers(0, 3))
    def update(self, data: st.DataObject, values: list[int], source: int) -> None:
        pairs = [(self._key(data), self._fit(v)) for v in values]
        for m in self.maps:
            if source == 0:
                m.update(pairs)
            elif source == 1:
                m.update(dict(pairs))
            elif source == 2:
                m.update(iter(pairs))
            else:  # another map of the same kind, of either mode (packed holds int64 only)
                fits = all(INT64_MIN <= v <= INT64_MAX for _, v in pairs)
                other = type(m)(fits and data.draw(st.booleans()))
                other.update(pairs)
                m.update(other)
        self.model.update(pairs)

    @rule(data=st.data(), shape=SHAPES)
    def get_many_and_isdisjoint(self, data: st.DataObject, shape: str) -> None:
        keys = self._keys(data, 40)
        want = [self.model.get(k, MISSING) for k in keys]
        self._all(lambda m: m.get_many(_shaped(keys, shape), MISSING), want)
        self._all(lambda m: m.isdisjoint(_shaped(keys, shape)), self.model.keys().isdisjoint(keys))

    @rule(data=st.data(), value=VALUES, shape=SHAPES)
    def assign(self, data: st.DataObject, value: int, shape: str) -> None:
        keys = self._keys(data)
        value = self._fit(value)
        for m in self.maps:
            m.assign(_shaped(keys, shape), value)
        self.model.update(dict.fromkeys(keys, value))

    @rule(data=st.data(), shape=SHAPES)
    def pop_many(self, data: st.DataObject, shape: str) -> None:
        keys = self._keys(data)  # repeats included: the second pop of a key gets the default
        want = [self.model.pop(k, MISSING) for k in keys]
        self._all(lambda m: m.pop_many(_shaped(keys, shape), MISSING), want)

    @rule(data=st.data(), values=st.lists(VALUES, max_size=10), shape=SHAPES)
    def insert_new(self, data: st.DataObject, values: list[int], shape: str) -> None:
        keys = [self._key(data) if data.draw(st.booleans()) else data.draw(KEYS) for _ in values]
        values = [self._fit(v) for v in values]
        if keys and data.draw(st.integers(0, 9)) == 0:
            for m in self.maps:
                with pytest.raises(ValueError):
                    m.insert_new(_shaped(keys, shape), values[1:])
            return
        fresh = self.model.keys().isdisjoint(keys) and len(set(keys)) == len(keys)
        self._all(lambda m: m.insert_new(_shaped(keys, shape), values), fresh)
        if fresh:
            self.model.update(zip(keys, values, strict=True))

    @rule(data=st.data(), itself=st.booleans())
    def pop_by_value(self, data: st.DataObject, itself: bool) -> None:
        held = sorted({v for v in self.model.values() if isinstance(v, int)})
        pool = st.sampled_from(held) if held else KEYS
        chosen = data.draw(st.lists(st.one_of(pool, KEYS), max_size=8))
        if not self.PACKED and self._checked():
            for m in self._checked():  # the compiled map needs packed int64 values
                with pytest.raises(TypeError):
                    m.pop_by_value(m if itself else type(m)(True))
            return
        named = self.model if itself else set(chosen)
        want = {k: v for k, v in self.model.items() if v in named}
        for m in self.maps:
            other = m
            if not itself:
                other = type(m)(data.draw(st.booleans()))
                other.assign(chosen, 0)
            gone = m.pop_by_value(other)
            assert dict(gone) == want and len(gone) == len(want), type(m).__name__
        for k in want:
            del self.model[k]

    @rule(start=st.integers(INT64_MIN, INT64_MAX - 3000), n=st.integers(1, 400), keep=VALUES)
    def grow_then_shrink(self, start: int, n: int, keep: int) -> None:
        # a sequential run: several doublings, then shrinks as most of it goes again
        run = [(start + i, self._fit(keep)) for i in range(n)]
        for m in self.maps:
            m.update(run)
        self.model.update(run)
        doomed = [k for k, _ in run[: n - n // 8]]
        want = [self.model.pop(k) for k in doomed]
        self._all(lambda m: m.pop_many(doomed, None), want)

    @rule(bad=st.sampled_from([1.0, "1", None, (1,), bytearray(b"k")]))
    def bad_types_change_nothing(self, bad: Any) -> None:
        calls: list[tuple[str, tuple[Any, ...]]] = [
            ("__setitem__", (bad, 1)),
            ("__setitem__", (1, bad)),
            ("get", (bad,)),
            ("get_many", ([1, bad], 0)),
            ("insert_new", ([12345, bad], [1, 2])),
            ("isdisjoint", ((bad,),)),
        ]
        for m in self._checked():
            for name, args in calls:
                with pytest.raises(TypeError):
                    getattr(m, name)(*args)

    @rule()
    def clear(self) -> None:
        for m in self.maps:
            m.clear()
        self.model.clear()

    # --------------------------------------------------------------------------- invariants

    @invariant()
    def contents_agree(self) -> None:
        for m in self.maps:
            name = type(m).__name__
            assert len(m) == len(self.model), name
            assert dict(m.items()) == self.model, name
            keys = m.keys()
            assert len(keys) == len(self.model) and set(keys) == self.model.keys(), name
            assert set(m) == self.model.keys(), name
            assert sorted(m.values()) == sorted(self.model.values()), name


def _run(packed: bool) -> None:
    impls: tuple[type[Any], ...] = (PyIntMap,)
    if NATIVE is not None or not PURE_REQUESTED:
        impls = (native_or_skip().int_map, PyIntMap)
    seed = int(os.environ.get("KVROUTE_TEST_SEED", random.randrange(2**32)))
    print(f"stateful seed={seed} packed={packed} (rerun with KVROUTE_TEST_SEED={seed})")
    machine = type(
        f"IntMapMachine{'Packed' if packed else 'Objects'}",
        (IntMapMachine,),
        {"PACKED": packed, "IMPLS": impls},
    )
    # older hypothesis releases leave this one untyped: call it through a typed name
    run: Callable[..., None] = run_state_machine_as_test
    run(hypothesis.seed(seed)(machine), settings=SETTINGS)


def test_packed_maps_agree_with_a_dict() -> None:
    _run(packed=True)


def test_object_maps_agree_with_a_dict() -> None:
    _run(packed=False)
