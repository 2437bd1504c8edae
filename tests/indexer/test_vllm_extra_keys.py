"""vLLM's block extra keys: what the index can key a block by, and what it must not index.

vLLM 0.33 (`generate_block_hash_extra_keys`, published untagged by `to_event_extra_keys`)
hashes a block with the LoRA name, the `(mm_identifier, offset)` pairs of the images it
overlaps, the `cache_salt` (a request's first block) and a digest of its prompt embeddings. A
block with images or embeddings is reused only by a request with the same ones, which tokens do
not show: before, a salted request with prompt embeddings was filed under no salt at all (its
digest read as the last extra key), so another tenant's plain prompt was predicted its pages.
"""

from __future__ import annotations

from indexer.index import PrefixIndex
from indexer.namespace import Namespace, vllm_plain_blocks
from indexer.protocol.events import Event, EventBatch, Stored, TokenId

BS = 4
DIGEST = b"\x11" * 32


def _index(*events: Stored) -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("w0", model="m", engine="vllm", block_size=BS)
    batch: list[Event] = list(events)
    index.apply("w0", EventBatch(0.0, batch), 0)
    return index


def _held(index: PrefixIndex, ns: Namespace, tokens: list[TokenId]) -> int:
    return index.match(ns, tokens).blocks.get("w0", 0)


def _tokens(start: int, blocks: int) -> list[TokenId]:
    return list(range(start, start + blocks * BS + 1))  # and a last token


def test_a_salted_request_with_prompt_embeddings_is_no_ones_hit() -> None:
    tokens = _tokens(100, 4)
    keys: list[list[object] | None] = [["tenant-a", DIGEST], [DIGEST], [DIGEST], [DIGEST]]
    stored = Stored(
        block_hashes=[1, 2, 3, 4], parent=None, token_ids=tokens[:16], block_size=BS,
        extra_keys=keys,
    )  # fmt: skip
    index = _index(stored)
    for salt in (None, "tenant-a", "tenant-b"):
        assert _held(index, Namespace("m", None, salt), tokens) == 0
    assert index.counters("w0").unindexable_blocks == 4 and len(index) == 0


def test_blocks_before_an_image_are_kept_and_the_rest_is_not() -> None:
    tokens = _tokens(200, 3)
    keys: list[list[object] | None] = [["tenant-b"], None, [["mm-hash-1", 0]]]
    stored = Stored(
        block_hashes=[5, 6, 7], parent=None, token_ids=tokens[:12], block_size=BS,
        extra_keys=keys,
    )  # fmt: skip
    index = _index(stored)
    assert _held(index, Namespace("m", None, "tenant-b"), tokens) == 2
    assert _held(index, Namespace("m", None, None), tokens) == 0
    assert index.counters("w0").unindexable_blocks == 1


def test_a_lora_name_on_every_block_and_a_salt_on_the_first_are_understood() -> None:
    tokens = _tokens(300, 2)
    keys: list[list[object] | None] = [["sql-lora", "tenant-c"], ["sql-lora"]]
    stored = Stored(
        block_hashes=[8, 9], parent=None, token_ids=tokens[:8], block_size=BS,
        lora_name="sql-lora", extra_keys=keys,
    )  # fmt: skip
    index = _index(stored)
    assert _held(index, Namespace("m", "sql-lora", "tenant-c"), tokens) == 2
    assert _held(index, Namespace("m", None, "tenant-c"), tokens) == 0
    assert index.counters("w0").unindexable_blocks == 0


def test_the_plain_prefix_of_extra_keys() -> None:
    assert vllm_plain_blocks([["salt"], None, ["lora"]], "lora", root=True) == 3
    assert vllm_plain_blocks([["salt"]], None, root=False) == 0  # a salt only starts a request
    assert vllm_plain_blocks([["a", "b"]], None, root=True) == 0  # two strings: not understood
    assert vllm_plain_blocks([None, [DIGEST]], None, root=True) == 1
    assert vllm_plain_blocks([[["mm", 0]]], None, root=True) == 0
