"""One prompt's block keys are made once per block size for all its decision asks
(`router.routing.prompt_keys`), and are the index's own keys."""

from __future__ import annotations

from itertools import pairwise

import pytest

from indexer.namespace import Namespace
from indexer.protocol.events import EventBatch, Stored, TokenId
from indexer.service import IndexerService
from router.routing.prompt_keys import PromptKeys

NS = Namespace("m", None, "tenant-a")
TOKENS = list(range(1, 70))  # 4 full blocks of 16, 5 tokens over


@pytest.fixture
def indexer() -> IndexerService:
    service = IndexerService()
    for stream, size in (("a", 16), ("b", 16), ("c", 8)):
        service.index.add_stream(stream, model="m", block_size=size)
    service.index.add_stream("unsized", model="m")
    service.index.add_pending("a", NS, [0] * 16)  # the namespace is known to the index
    return service


def _counting(indexer: IndexerService, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    real = indexer.block_keys

    def block_keys(stream: str, *args: object, **kw: object) -> list[int]:
        made.append(stream)
        return real(stream, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(indexer, "block_keys", block_keys)
    return made


def test_the_keys_are_the_indexs_and_made_once_per_block_size(
    indexer: IndexerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = {s: indexer.block_keys(s, NS, TOKENS) for s in ("a", "b", "c")}
    made = _counting(indexer, monkeypatch)
    keys = PromptKeys(indexer)
    for stream in ("a", "b", "c", "a", "b", "c"):
        assert keys.of(stream, NS, TOKENS) == want[stream]
        for limit in (0, 15, 16, 40, 68, 69, 500):
            assert keys.of(stream, NS, TOKENS, limit) == indexer.index.block_keys(
                stream, NS, TOKENS, limit
            )
    assert len(want["a"]) == 4 and len(want["c"]) == 8
    assert made == ["a", "c"]  # b shares a's block size, so a's chain
    assert keys.of("unsized", NS, TOKENS) == [] and keys.of("gone", NS, TOKENS) == []


def test_another_prompt_or_namespace_is_made_anew(
    indexer: IndexerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = PromptKeys(indexer)
    first = keys.of("a", NS, TOKENS)
    same_content = list(TOKENS)  # another request that happens to send the same prompt
    other_ns = Namespace("m", None, "tenant-b")
    indexer.index.add_pending("a", other_ns, [0] * 16)
    made = _counting(indexer, monkeypatch)
    assert keys.of("a", NS, same_content) == first
    assert keys.of("a", other_ns, same_content) != first  # another tenant: other keys
    assert keys.of("a", other_ns, same_content) == indexer.block_keys("a", other_ns, TOKENS)
    assert made == ["a", "a", "a"]  # the last by the test itself


def test_a_namespace_the_index_meets_later_is_not_remembered_empty(
    indexer: IndexerService,
) -> None:
    keys = PromptKeys(indexer)
    new = Namespace("m", None, "tenant-new")
    assert keys.of("a", new, TOKENS) == []  # not in the index yet: nothing can be held
    indexer.index.add_pending("b", new, TOKENS)  # routed: the index interns it
    assert keys.of("a", new, TOKENS) == indexer.block_keys("a", new, TOKENS) != []


def test_marks_from_given_keys_equal_marks_made_by_the_index() -> None:
    given, made = IndexerService(), IndexerService()
    for service in (given, made):
        service.index.add_stream("a", model="m", block_size=16)
        service.index.add_pending("a", NS, TOKENS[:16])
    keys = given.block_keys("a", NS, TOKENS)
    assert given.index.add_pending("a", NS, TOKENS, keys) == made.index.add_pending("a", NS, TOKENS)
    assert dict(given.index.pending.bits.items()) == dict(made.index.pending.bits.items())


def test_a_bigram_stream_gets_the_keys_of_the_prompts_pairs_beside_an_int_one() -> None:
    """A stream whose pages are SGLang EAGLE (prev, next) pairs keys a prompt by its pairs: its
    keys are not those of an int stream of the same block size, and are the ones it holds."""
    indexer = IndexerService()
    index = indexer.index
    for stream in ("plain", "eagle"):
        index.add_stream(stream, model="m", block_size=16)
    plain_tokens: list[TokenId] = [*TOKENS[:32]]
    index.apply("plain", EventBatch(0.0, [Stored([1, 2], None, plain_tokens, 16)]))
    pairs: list[TokenId] = [*pairwise(TOKENS[:33])]
    index.apply("eagle", EventBatch(0.0, [Stored([1, 2], None, pairs, 16)]))
    ns = Namespace("m")
    keys = PromptKeys(indexer)
    plain, eagle = keys.of("plain", ns, TOKENS), keys.of("eagle", ns, TOKENS)
    assert plain == indexer.block_keys("plain", ns, TOKENS) and len(plain) == 4
    assert eagle == indexer.block_keys("eagle", ns, TOKENS) and len(eagle) == 4  # 68 pairs
    assert not set(plain) & set(eagle)
    assert index.holds("eagle", eagle[:2]) == [True, True]
    for limit in (0, 16, 17, 32, 33, 34, 68):  # 33 tokens make the 32 pairs of two pages
        for stream in ("plain", "eagle"):
            want = index.block_keys(stream, ns, TOKENS, limit)
            assert keys.of(stream, ns, TOKENS, limit) == want, (stream, limit)
    assert len(keys.of("eagle", ns, TOKENS, 33)) == 2 and len(keys.of("eagle", ns, TOKENS, 32)) == 1
