"""LoRA namespaces from events: by the adapter's name, never by an id a request cannot name."""

from __future__ import annotations

from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.events import Event, EventBatch, Stored, TokenId

BS = 4
TOKENS: list[TokenId] = list(range(10, 10 + 2 * BS + 1))


def _index(**adapter: object) -> PrefixIndex:
    index = PrefixIndex()
    index.add_stream("w0", model="m", engine="sglang", block_size=BS)
    stored = Stored(block_hashes=[1, 2], parent=None, token_ids=TOKENS[:8], block_size=BS,
                    **adapter)  # type: ignore[arg-type]  # fmt: skip
    batch: list[Event] = [stored]
    index.apply("w0", EventBatch(0.0, batch), 0)
    return index


def _held(index: PrefixIndex, lora: str | None) -> int:
    return index.match(Namespace("m", lora), TOKENS).blocks.get("w0", 0)


def test_pages_named_by_adapter_id_alone_are_no_requests_hit() -> None:
    # SGLang up to 0.5.17 publishes its own number for the adapter, not its name: an adapter
    # a request names "7" (or the base model) must not be predicted adapter 7's pages
    index = _index(lora_id=7)
    assert len(index) == 2
    for lora in ("7", None, "adapter-7"):
        assert _held(index, lora) == 0


def test_pages_named_by_adapter_name_are_that_adapters() -> None:
    index = _index(lora_id=7, lora_name="sql")
    assert _held(index, "sql") == 2
    assert _held(index, "7") == _held(index, None) == 0
