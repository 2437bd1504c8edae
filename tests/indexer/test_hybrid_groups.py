"""Hybrid models: only the KV-cache groups that make a reusable prefix are indexed.

vLLM 0.33 publishes, for a model with several KV-cache groups (sliding window + full
attention, Mamba hybrids), one `BlockStored` per group with `group_idx` and
`kv_cache_spec_kind`, and `BlockRemoved` with `group_idx` only. The payloads here are the map
layout of vLLM 0.33's `vllm/distributed/kv_events.py` (the golden `vllm-0.33.0-live-map`
capture's keys plus the kind fields), decoded by the real decoder.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol import decode_batch

NS = Namespace("m", None, "tenant-a")
TOKENS = list(range(1, 17))  # 4 pages of 4


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], group: int, kind: str | None
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["tenant-a"]] + [None] * (len(hashes) - 1) if parent is None else None,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": 8 if kind == "sliding_window" else None,
        "locality": None,
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }


def removed(hashes: list[int], group: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group}


def apply(index: PrefixIndex, *events: dict[str, Any]) -> None:
    index.apply("v", decode_batch(msgspec.msgpack.encode([1767225600.25, list(events), 0])))


def held(index: PrefixIndex) -> int:
    return index.query(NS, TOKENS)["v"].blocks


def fresh() -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("v", model="m", engine="vllm", block_size=4)
    return index


def test_the_kind_fields_decode_from_vllm_033_maps() -> None:
    batch = decode_batch(
        msgspec.msgpack.encode([0.0, [stored([1], None, TOKENS[:4], 1, "sliding_window")], 0])
    )
    (event,) = batch.events
    assert (event.group_idx, event.kv_cache_spec_kind) == (1, "sliding_window")  # type: ignore[union-attr]


def test_a_sliding_window_group_is_no_prefix_and_its_evictions_take_nothing_away() -> None:
    index = fresh()
    # the same pages, stored by the full-attention group 0 and the sliding-window group 1 (vLLM
    # hashes a page the same way in both groups)
    apply(
        index,
        stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"),
        stored([11, 12, 13, 14], None, TOKENS, 1, "sliding_window"),
    )
    assert held(index) == 4
    # the window slides: group 1 frees its oldest pages; the full-attention copy is still there
    apply(index, removed([11, 12], 1))
    assert held(index) == 4
    counters = index.counters("v")
    assert counters.skipped_group_blocks == 4 + 2 and counters.unknown_removes == 0
    # the full-attention group evicting is what ends the prefix
    apply(index, removed([13, 14], 0))
    assert held(index) == 2


def test_a_model_with_only_non_prefix_groups_predicts_nothing() -> None:
    index = fresh()
    apply(
        index,
        stored([21, 22, 23, 24], None, TOKENS, 0, "mamba"),
        stored([31, 32, 33, 34], None, TOKENS, 1, "sliding_window"),
    )
    assert held(index) == 0 and index.entries("v") == 0


def test_mla_and_single_group_events_are_indexed_as_before() -> None:
    index = fresh()
    apply(index, stored([41, 42], None, TOKENS[:8], 0, "mla_attention"))
    assert held(index) == 2
    older = fresh()
    apply(older, stored([41, 42], None, TOKENS[:8], 0, None))  # no kind: one group (vLLM < 0.33)
    assert held(older) == 2


def test_a_loaded_snapshot_keeps_which_groups_make_no_prefix() -> None:
    """The skipped groups (and a lookahead) travel in the snapshot: after a load (a warm start,
    /admin/index/load) a sliding-window group's removal had taken full-attention blocks away,
    and the replicas' indexes parted."""
    from indexer.snapshot import dump_index, load_index

    index = fresh()
    apply(
        index,
        stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"),
        stored([11, 12, 13, 14], None, TOKENS, 1, "sliding_window"),
    )
    loaded = load_index(dump_index(index))
    apply(loaded, removed([13, 14], 1))
    assert held(loaded) == held(index) == 4


def test_a_group_with_null_blocks_left_out_of_its_hashes_costs_its_batch_nothing() -> None:
    """vLLM 0.33 leaves a sliding-window (or Mamba) group's null and masked blocks out of
    block_hashes, not out of token_ids: that event was undecodable and took the whole batch
    with it (the full-attention store, a removal), and the subscriber cleared the stream."""
    index = fresh()
    swa = stored([24], None, TOKENS, 1, "sliding_window")  # 3 null blocks left out
    apply(index, stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"), swa)
    assert held(index) == 4
    apply(index, removed([14], 0), swa)
    assert held(index) == 3  # the removal in its batch applied
    counters = index.counters("v")
    assert counters.skipped_group_blocks == 2 and counters.skipped_events == 0


def test_a_store_that_does_not_decode_is_forgotten_and_its_batch_applies() -> None:
    """Its batch's other events apply; the blocks it names are dropped (a store may replace
    what a hash names: the old mapping kept could predict a page the worker let go), and a
    later store chained on it is an unknown parent, never indexed on a guess."""
    index = fresh()
    apply(index, stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"))
    assert held(index) == 4
    bad = {**stored([13, 14], 12, TOKENS[8:16], 0, "full_attention"), "block_size": "4"}
    apply(index, bad, removed([12], 0))
    assert held(index) == 1  # 13 and 14 forgotten, 12 removed by the event beside it
    counters = index.counters("v")
    assert counters.skipped_events == 1 and counters.blocks_removed == 1
    apply(index, stored([15], 14, list(range(17, 21)), 0, "full_attention"))
    assert index.counters("v").unknown_parents == 1


def test_a_removal_that_does_not_decode_is_still_a_removal() -> None:
    index = fresh()
    apply(index, stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"))
    apply(index, {**removed([13, 14], 0), "medium": 5})
    assert held(index) == 2


def test_an_unreadable_store_of_a_group_not_indexed_is_skipped_as_that_group() -> None:
    index = fresh()
    apply(index, stored([11, 12, 13, 14], None, TOKENS, 0, "full_attention"))
    bad_swa = {**stored([13, 14], 12, TOKENS[8:16], 1, "sliding_window"), "block_size": 0}
    apply(index, bad_swa)
    assert held(index) == 4  # its hashes are the full-attention group's too: kept
    assert index.counters("v").skipped_group_blocks == 2
    apply(index, removed([13, 14], 1))  # and its group's removals are skipped from now on
    assert held(index) == 4
