"""SGLang EAGLE bigram pages are matched by a request's (prev, next) pairs, page by page: a
repeated prompt is predicted exactly what SGLang's own radix cache reuses, and an int stream
beside it is matched by its tokens as before.

With EAGLE, SGLang 0.5.23 keys its radix cache by bigrams (`RadixKey.is_bigram`) and publishes
each page's `token_ids` as `[t_j, t_{j+1}]` pairs (`mem_cache/events.py` `record_store`). The
pages come here from the golden capture, decoded by the real decoder. The expected reuse is an
independent reading of SGLang's `match_prefix` (`sglang_reuses`), not the index's code.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from indexer.backend import Backend
from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import EventBatch, Stored
from indexer.snapshot import dump_index, load_index

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
NS = Namespace("m")
PAGE = 4
CAPTURED = list(range(11, 20))  # the node of the capture: 9 raw tokens, 8 pairs, 2 pages
SECOND_PAGE = -5301148870896220668  # the capture's second page hash


def sglang_reuses(cached: list[int], prompt: list[int], bigram: bool) -> int:
    """What SGLang 0.5.23 reuses of `prompt` when its radix cache holds the node of raw tokens
    `cached`: the key is the prompt less its last token (`Req._compute_max_prefix_len`), made
    into (prev, next) pairs with EAGLE (`RadixKey.maybe_to_bigram_view`: n tokens are n - 1
    positions), cut to whole pages (`page_aligned`); the node holds its whole pages too."""
    key: list[object] = list(prompt[: max(len(prompt) - 1, 0)])
    held: list[object] = list(cached)
    if bigram:
        key = list(pairwise(key))
        held = list(pairwise(held))
    held = held[: len(held) // PAGE * PAGE]
    n = 0
    while n < min(len(key), len(held)) and key[n] == held[n]:
        n += 1
    return n // PAGE * PAGE


def _golden() -> EventBatch:
    doc = json.loads((FIXTURE / "sglang-0.5.23-live-eagle-bigram.json").read_text())
    return decode_batch(bytes.fromhex(doc["frames"][2]))


def _prompts() -> list[list[int]]:
    base = list(range(11, 24))
    out = [[*range(11, 20), 30, 31]]  # the QA case: SGLang reuses 8
    for k in range(len(base) + 1):
        for tail in ([], [99], [99, 98]):
            out.append(base[:k] + tail)
    return out


def _index(backend: Backend) -> PrefixIndex:
    index = PrefixIndex(backend=backend)
    index.add_stream("eagle", model="m")  # learns size and kind from its pages
    index.add_stream("plain", model="m")
    golden = _golden()
    pairs = golden.events[0]
    assert isinstance(pairs, Stored) and pairs.token_ids[:2] == [(11, 12), (12, 13)]
    index.apply("eagle", golden)
    # the same prompt on a worker without EAGLE: its two full pages of plain tokens
    index.apply("plain", EventBatch(0.0, [Stored([1, 2], None, list(range(11, 19)), PAGE)]))
    return index


def _check(index: PrefixIndex, eagle_cached: list[int]) -> None:
    for prompt in _prompts():
        limit = max(len(prompt) - 1, 0)  # what the router asks: the last token is never reused
        found = index.query(NS, prompt, limit)
        want = sglang_reuses(eagle_cached, prompt, bigram=True)
        assert found["eagle"].blocks * PAGE == want, prompt
        assert found["plain"].blocks * PAGE == sglang_reuses(CAPTURED[:8], prompt, False), prompt
        # the keys the router books and forecasts by are the held ones, as many as matched
        keys = index.block_keys("eagle", NS, prompt, limit)
        held = index.holds("eagle", keys)
        assert held[: want // PAGE] == [True] * (want // PAGE), prompt


def test_a_repeated_prompt_matches_what_sglang_reuses_on_bigram_pages(backend: Backend) -> None:
    index = _index(backend)
    assert index.bigram("eagle") is True and index.bigram("plain") is False
    assert index.key_shape("eagle") == (PAGE, True)
    assert index.counters("eagle").token_kind_mismatches == 0
    repeated = [*range(11, 20), 30, 31]
    assert index.query(NS, repeated, len(repeated) - 1)["eagle"].blocks * PAGE == 8
    # the prompt of the capture itself: its last token is not reused, and the second page's
    # last pair (18, 19) needs it, so SGLang reuses the first page only
    assert index.query(NS, CAPTURED, len(CAPTURED) - 1)["eagle"].blocks * PAGE == 4
    _check(index, CAPTURED)


def test_a_child_page_is_matched_across_the_pair_that_spans_the_boundary(
    backend: Backend,
) -> None:
    index = _index(backend)
    child = Stored([3], SECOND_PAGE, [(19, 20), (20, 21), (21, 22), (22, 23)], PAGE)
    index.apply("eagle", EventBatch(0.0, [child]))
    _check(index, list(range(11, 24)))


def test_pending_marks_and_snapshots_keep_the_bigram_keying(backend: Backend) -> None:
    index = _index(backend)
    other = [*range(50, 60)]
    assert index.add_pending("eagle", NS, other) == 2  # 9 pairs: two whole pages
    assert index.query(NS, other, len(other) - 1)["eagle"].pending_blocks == 2
    loaded = load_index(dump_index(index), backend=backend)
    assert loaded.bigram("eagle") is True
    repeated = [*range(11, 20), 30, 31]
    assert loaded.query(NS, repeated, len(repeated) - 1)["eagle"].blocks == 2


def test_pages_of_the_other_kind_are_counted_and_not_kept(backend: Backend) -> None:
    index = _index(backend)
    index.apply("eagle", EventBatch(0.0, [Stored([9], None, list(range(40, 44)), PAGE)]))
    assert index.counters("eagle").token_kind_mismatches == 1
    assert index.entries("eagle") == 2
    assert index.query(NS, list(range(40, 46)), 5)["eagle"].blocks == 0
    # a stream that holds nothing takes the kind of its next page (EAGLE turned off)
    index.clear_stream("eagle")
    index.apply("eagle", EventBatch(0.0, [Stored([9], None, list(range(40, 44)), PAGE)]))
    assert index.bigram("eagle") is False
    assert index.query(NS, list(range(40, 46)), 5)["eagle"].blocks == 1


@pytest.mark.parametrize("kind", ["unknown", "bigram"])
def test_a_shadow_covers_the_bigram_key(backend: Backend, kind: str) -> None:
    index = PrefixIndex(backend=backend)
    index.add_stream("eagle", model="m", block_size=PAGE)
    if kind == "bigram":
        index.apply("eagle", _golden())
    tokens = list(range(11, 20))
    made = index.chain_keys("eagle", NS, tokens, 1)
    assert made is not None
    keys = [chain[0] for chain in made[1] if chain]
    pairs = index.block_keys("eagle", NS, tokens)[:1] if kind == "bigram" else []
    if kind == "unknown":
        # its pages may turn out either kind: both first keys are shadowed
        index.apply("eagle", _golden())
        pairs = index.block_keys("eagle", NS, tokens)[:1]
        assert len(keys) == 2
    assert pairs and pairs[0] in keys
