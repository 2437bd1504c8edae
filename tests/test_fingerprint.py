"""Fingerprints: one scheme for the router's admin API and the record/replay tools."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from indexer.fingerprint import FINGERPRINT_KEY_ENV, Fingerprinter, salt_fingerprint
from indexer.namespace import Namespace


def test_the_same_key_gives_the_same_ids_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = Namespace("m", None, "tenant-a")
    monkeypatch.setenv(FINGERPRINT_KEY_ENV, "shared-key")
    from_env = Fingerprinter()(ns)
    assert from_env == Fingerprinter("shared-key")(ns)
    assert from_env != Fingerprinter("other-key")(ns)
    assert salt_fingerprint("tenant-a") == salt_fingerprint("tenant-a", b"shared-key")


def test_a_fingerprint_is_the_keyed_blake2b_of_the_namespace_fields() -> None:
    # the documented scheme, computed here from hashlib alone: ids stay comparable with any
    # tool that follows the docs
    fields = msgspec.msgpack.encode(("m", None, "tenant-a"))
    expected = hashlib.blake2b(fields, key=b"k", digest_size=8).hexdigest()
    assert Fingerprinter("k")(Namespace("m", None, "tenant-a")) == expected
    salt = hashlib.blake2b(b"tenant-a", key=b"k", digest_size=6).hexdigest()
    assert salt_fingerprint("tenant-a", b"k") == "salt:" + salt
    # a key longer than BLAKE2b takes (64 bytes) is hashed to one, and still tells keys apart
    long_a, long_b = "a" * 100, "a" * 99 + "b"
    ns = Namespace("m", None, "tenant-a")
    assert Fingerprinter(long_a)(ns) != Fingerprinter(long_b)(ns)
    short = hashlib.blake2b(long_a.encode()).digest()
    assert (
        Fingerprinter(long_a)(ns) == hashlib.blake2b(fields, key=short, digest_size=8).hexdigest()
    )


def test_fingerprints_hide_the_salt_and_separate_namespaces() -> None:
    fp = Fingerprinter("k")
    ids = {fp(Namespace("m", None, s)) for s in ("a", "b", None)} | {fp(Namespace("m", "a", None))}
    assert len(ids) == 4
    assert all("tenant" not in i and len(i) == 16 for i in ids)
    assert salt_fingerprint(None) == "-"
    # a colliding concatenation of fields must not collide (msgpack keeps the fields apart)
    assert fp(Namespace("m", "a:b", None)) != fp(Namespace("m", "a", "b"))


def test_without_a_key_fingerprints_are_random_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FINGERPRINT_KEY_ENV, raising=False)
    ns = Namespace("", None, "tenant-a")
    assert Fingerprinter()(ns) == Fingerprinter()(ns)  # one process key
    assert Fingerprinter()(ns) != Fingerprinter("guess")(ns)


def test_an_extra_key_namespace_has_its_own_fingerprint_and_others_keep_theirs() -> None:
    fp = Fingerprinter("k")
    base = Namespace("m", None, "tenant-a")
    assert fp(Namespace("m", None, "tenant-a", "view")) != fp(base)
    assert fp(Namespace("m", None, "tenant-a", "")) == fp(base)


def test_fingerprints_keep_no_salt_in_memory() -> None:
    import gc
    import tracemalloc

    import indexer.fingerprint
    import indexer.namespace

    fp = Fingerprinter("k")
    salts = 4_000
    # what is allocated here (the salts) or by the fingerprint and namespace code: not what
    # other threads of the test process allocate meanwhile (the whole process's count was
    # 400 KB over once in a full run)
    ours = [
        tracemalloc.Filter(True, path)
        for path in (__file__, indexer.fingerprint.__file__, indexer.namespace.__file__)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(ours)
        for i in range(salts):
            fp(Namespace("m", None, f"{i:08d}" + "x" * 4096))  # 4 KiB each: 16 MiB if kept
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(ours)
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    # nothing per namespace is kept: well under one salt's size
    assert grown < 4096, grown
