"""A snapshot keeps the `extra_key` shadows (version 6): a router that loads one, or a replica
that starts from the cluster's, does not trust an `extra_key` request's pages, which events
show as plain, for a plain request of its salt. Version 5 snapshots (no shadows) still load."""

from __future__ import annotations

import math
from array import array

import msgspec
import pytest

from indexer.errors import SnapshotError
from indexer.fence import DIGEST_BYTES, BatchFence
from indexer.namespace import Namespace
from indexer.protocol.events import Removed
from indexer.server_stream import ServerStream
from indexer.service import IndexerService
from indexer.shadowed import Shadow
from indexer.snapshot import (
    SNAPSHOT_VERSION,
    KeptShadows,
    _seal,
    _unseal,
    dump_index,
    load_index,
    load_snapshot,
)
from tests.indexer.test_index_unit import TOKENS, batch, make, stored

PLAIN = Namespace("m", None, "tenant")
SERVER_A = ServerStream("tcp", "127.0.0.1", "5557", "", 0)
SERVER_GONE = ServerStream("tcp", "10.0.0.9", "5557", "kv", 1)


def kept_at(at: float) -> KeptShadows:
    """Shadows as a service keeps them at clock `at`: two keys of one request share a tuple,
    a tail of its own, one shadow past its time (kept while the stream holds its key)."""
    one: Shadow = (at + 3600.0, frozenset({"view-1"}), frozenset())
    tail = (at + 3600.0, frozenset({"view-1"}), frozenset({"view-1"}))
    old = (at - 5.0, frozenset({"view-2", "view-3"}), frozenset({"view-3"}))
    return KeptShadows(
        at=at,
        streams={"a": {11: one, 12: one, 13: tail}, "b": {-(2**63): old, 2**64 - 1: old}},
        seeds={77: PLAIN},
        blanket={"c"},
        unsized=[("d", PLAIN, array("q", [5, 6, 7]), "view-4", at + 60.0)],
        servers={"a": SERVER_A},
        parked={
            SERVER_GONE: ({21: one, 22: tail}, [BatchFence(9, digest=b"d" * DIGEST_BYTES), None])
        },
        parked_unsized=[(SERVER_GONE, PLAIN, array("q", [8]), "view-5", at + 30.0)],
        parked_blanket={SERVER_GONE},
    )


def test_shadows_survive_a_snapshot_with_their_time_left() -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="tenant")), 4)
    data = dump_index(index, kept_at(100.0))
    loaded, shadows = load_snapshot(data, clock=lambda: 1000.0)
    assert loaded.entries("a") == 2
    assert shadows is not None and shadows.at == 1000.0
    a, b = shadows.streams["a"], shadows.streams["b"]
    assert a[11] == (4600.0, frozenset({"view-1"}), frozenset())
    assert a[11] is a[12]  # the keys one request shadowed still share one tuple
    assert a[13] == (4600.0, frozenset({"view-1"}), frozenset({"view-1"}))
    assert b == {
        -(2**63): (995.0, frozenset({"view-2", "view-3"}), frozenset({"view-3"})),
        2**64 - 1: (995.0, frozenset({"view-2", "view-3"}), frozenset({"view-3"})),
    }
    assert shadows.seeds == {77: PLAIN} and shadows.blanket == {"c"}
    ((stream, plain, head, extra_key, until),) = shadows.unsized
    assert (stream, plain, list(head), extra_key, until) == (
        "d",
        PLAIN,
        [5, 6, 7],
        "view-4",
        1060.0,
    )
    assert shadows.servers == {"a": SERVER_A}
    (parked, fences) = shadows.parked[SERVER_GONE]
    assert parked[21] == a[11] and parked[22] == a[13]
    assert [(f.seq, f.digest()) if f else None for f in fences] == [(9, b"d" * DIGEST_BYTES), None]
    ((server, plain, head, extra_key, until),) = shadows.parked_unsized
    assert (server, plain, list(head), extra_key, until) == (
        SERVER_GONE,
        PLAIN,
        [8],
        "view-5",
        1030.0,
    )
    assert shadows.parked_blanket == {SERVER_GONE}


def test_an_index_dumped_without_a_service_has_no_shadows() -> None:
    index = make()
    index.apply("a", batch(stored([1], TOKENS[:4])), 1)
    assert load_snapshot(dump_index(index))[1] is None


def test_a_version_5_snapshot_still_loads_without_shadows() -> None:
    """Written by the release before: no `shadows` field (the gap it had stays for that load)."""
    assert SNAPSHOT_VERSION == 6
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])), 3)
    body = msgspec.msgpack.decode(_unseal(dump_index(index)))
    del body["shadows"]
    sealed = msgspec.msgpack.decode(_seal(msgspec.msgpack.encode(body)))
    sealed["version"] = 5
    old = msgspec.msgpack.encode(sealed)
    loaded, shadows = load_snapshot(old)
    assert shadows is None and loaded.entries("a") == 2 and loaded.last_seq("a") == 3


def _damaged(path: tuple[object, ...], value: object) -> bytes:
    """A sealed snapshot of `kept_at(0)` with one field of its shadows set to `value`."""
    index = make()
    body = msgspec.msgpack.decode(_unseal(dump_index(index, kept_at(0.0))))
    node = body["shadows"]
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return _seal(msgspec.msgpack.encode(body))


# shadows fields: 0 kinds, 1 streams, 2 seeds, 3 blanket, 4 unsized
@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ((0, 0, 0), math.nan, r"shadows.kinds\[0\]: seconds left nan is not finite"),
        ((0, 0, 0), math.inf, r"shadows.kinds\[0\]: seconds left inf is not finite"),
        ((1, 0, 2), [0, 0, 9], "stream 'a': a kind outside 0..2"),
        ((1, 0, 2), [0, -1, 0], "stream 'a': a kind outside 0..2"),
        ((1, 0, 2), [0, 0], "stream 'a': arrays of different lengths"),
        ((1, 1, 0), "a", "stream 'a' appears twice"),
        ((4, 0, 2), [1, 2**63], r"shadows.unsized\[0\]: a token outside the signed 64-bit"),
        ((4, 0, 4), -math.inf, r"shadows.unsized\[0\]: seconds left -inf is not finite"),
        ((6, 0, 2), [0, 7], r"parked\[0\]: a kind outside 0..2"),
        ((6, 0, 3), [[9, b"short"]], r"parked\[0\]: a fence no stream could have"),
        ((6, 0, 3), [[-1, b"d" * 16]], r"parked\[0\]: a fence no stream could have"),
        ((7, 0, 2), [2**63], r"shadows.parked_unsized\[0\]: a token outside"),
    ],
)
def test_shadows_no_service_could_write_are_refused_by_name(
    path: tuple[object, ...], value: object, named: str
) -> None:
    with pytest.raises(SnapshotError, match=named):
        load_index(_damaged(path, value))


@pytest.mark.parametrize(
    ("path", "value"),
    [((0, 0, 1), [3]), ((2, 0, 1), {"model": 5}), ((3, 0), 7), ((1, 0, 1), ["x"])],
    ids=["extra_key-not-a-string", "bad-namespace", "blanket-not-a-stream", "key-not-an-int"],
)
def test_shadows_of_the_wrong_types_are_refused(path: tuple[object, ...], value: object) -> None:
    with pytest.raises(SnapshotError, match="damaged snapshot body"):
        load_index(_damaged(path, value))


def test_the_copies_of_a_page_survive_a_snapshot() -> None:
    """SGLang stores an `extra_key`'s copy of a plain page as a second `BlockStored` of the same
    hash: the copies counted since the key's last removal tell a plain copy apart."""
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="tenant")), 1)
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="tenant")), 2)
    index.apply("a", batch(stored([1], TOKENS[:4], cache_salt="tenant")), 3)
    copies = dict(index.extra_copies("a"))
    assert sorted(copies.values()) == [1, 2]
    loaded = load_index(dump_index(index))
    assert dict(loaded.extra_copies("a")) == copies
    loaded.apply("a", batch(Removed(block_hashes=[1])), 4)  # which copy went is not known
    assert sorted(loaded.extra_copies("a").values()) == [1]


@pytest.mark.parametrize("again", [[[12345, 1]], [[None, 1]], [[0, 0]], [[0, 2**32]]])
def test_copies_of_a_key_the_stream_does_not_hold_are_refused(again: list[list[object]]) -> None:
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])), 1)
    body = msgspec.msgpack.decode(_unseal(dump_index(index)))
    (stream,) = [s for s in body["streams"] if s[0] == "a"]
    if again[0][0] == 0:
        again[0][0] = stream[7][0]  # a key the stream holds, with a count no worker has
    stream[17] = again
    with pytest.raises(SnapshotError):
        load_index(_seal(msgspec.msgpack.encode(body)))


def test_a_service_loads_shadows_of_streams_its_snapshot_holds_nothing_of() -> None:
    """QA: an orphan stream dropped from a router's index kept its shadow waiting for a page
    size, so that router's next dump named a stream it did not hold; loading it raised
    `KeyError` halfway (a 500, the index swapped, the load's log line and cache reset skipped;
    a cluster replica starting from it did not start)."""
    service = IndexerService()
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="tenant")), 4)
    kept = kept_at(0.0)._replace(servers={})
    service.load(dump_index(index, kept))
    assert len(service._shadowed) == 7  # every stream's keys and the parked ones, none lost
    assert service._shadowed.parked() == [SERVER_GONE]
    assert [item[0] for item in service._unsized_shadows] == ["d"]
    again = load_snapshot(service.dump())[1]
    assert again is not None and set(again.streams) == {"a", "b"}


def test_loading_a_dump_again_and_again_keeps_each_fence_once() -> None:
    """QA: the fences of the parked shadows were added at each load, and written back into the
    next dump: a router loading its own dump 16 times held 32,768 of them."""
    service = IndexerService()
    index = make()
    index.apply("a", batch(stored([1, 2], TOKENS[:8], cache_salt="tenant")), 4)
    data = dump_index(index, kept_at(0.0))
    for _ in range(4):
        service.load(data)
        data = service.dump()
    fences = service._parked_fences
    assert {server: len(kept) for server, kept in fences.items()} == {SERVER_A: 1, SERVER_GONE: 2}
