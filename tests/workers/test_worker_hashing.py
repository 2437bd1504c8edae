"""SGLang's event hashes against the vectors SGLang's own hasher produced."""

from __future__ import annotations

from typing import Any

import pytest

from workers.hashing import (
    digest_to_hash,
    dynamo_hash,
    dynamo_namespace_seed,
    page_digests,
    salt_seed,
)


def _vector_ids(vectors: Any) -> list[str]:
    return [v["name"] for v in vectors["vectors"]]


def _expected_default(vector: dict[str, Any]) -> tuple[list[int], list[int | None]]:
    """Compute (hashes, parents) for one vector the way the recorder sees its node(s)."""
    page = vector["page_size"]
    prior = salt_seed(vector["cache_salt"])
    hashes: list[int] = []
    parents: list[int | None] = []
    nodes = vector["nodes"] or [{"token_ids": vector["token_ids"]}]
    for node in nodes:
        digests = page_digests(node["token_ids"], page, prior, bigram=vector["bigram"])
        for d in digests:
            parents.append(hashes[-1] if hashes else None)
            hashes.append(digest_to_hash(d))
        prior = digests[-1]
    return hashes, parents


def test_every_vector_matches(hash_vectors: Any) -> None:
    checked = 0
    for vector in hash_vectors["vectors"]:
        hashes, parents = _expected_default(vector)
        if vector["format"] == "dynamo":
            seed = dynamo_namespace_seed(vector["extra_key"], vector["cache_salt"])
            assert seed.hex() == vector["namespace_seed_hex"], vector["name"]
            assert hashes == vector["default_format_hashes"], vector["name"]
            hashes = [dynamo_hash(seed, h) for h in hashes]
            parents = [None if p is None else dynamo_hash(seed, p) for p in parents]
        assert hashes == vector["block_hashes"], vector["name"]
        assert parents == vector["parents"], vector["name"]
        checked += 1
    assert checked == 19


def test_page_digests_match_the_full_digests(hash_vectors: Any) -> None:
    for vector in hash_vectors["vectors"]:
        if "page_digests_hex" not in vector or vector["nodes"]:
            continue
        digests = page_digests(
            vector["token_ids"],
            vector["page_size"],
            salt_seed(vector["cache_salt"]),
            bigram=vector["bigram"],
        )
        assert [d.hex() for d in digests] == vector["page_digests_hex"], vector["name"]


def test_salt_seeds_the_chain_and_changes_every_hash() -> None:
    plain = page_digests([1, 2, 3, 4], 2, None)
    salted = page_digests([1, 2, 3, 4], 2, salt_seed("tenant-a"))
    assert not set(plain) & set(salted)
    assert salt_seed(None) is None


def test_concatenation_counter_example_differs_in_dynamo_format() -> None:
    assert dynamo_namespace_seed("a", "bc") != dynamo_namespace_seed("ab", "c")
    assert dynamo_namespace_seed("a:b", None) != dynamo_namespace_seed("a", "b")


def test_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        page_digests([1], 0, None)
