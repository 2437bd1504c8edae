"""Cache namespaces of requests; their public fingerprints come from `indexer.fingerprint`."""

from __future__ import annotations

from indexer.fingerprint import Fingerprinter
from indexer.service import Namespace
from router.config import LimitsConfig
from router.prompt.request import Endpoint, ParsedRequest, check_adapter_name
from router.routing.pool import ModelChoice

__all__ = ["Fingerprinter", "KeyedShadow", "keyed_namespaces", "request_namespace"]

# one item of a batch (not the first) sent with an extra_key: its namespace and its tokens,
# which it shadows where its batch goes (`Planner.shadow`)
KeyedShadow = tuple[Namespace, list[int]]


def request_namespace(
    parsed: ParsedRequest, choice: ModelChoice, limits: LimitsConfig
) -> Namespace:
    """The namespace a request is cached in: its model's cache name, the LoRA adapter, the salt,
    and the caller's extra_key (which no event carries: see `indexer.namespace.Namespace`).

    The adapter is the one the `base:adapter` model names, else `lora_path`: SGLang's OpenAI
    routes give the model's adapter precedence (`_resolve_lora_path`); its `/generate` takes
    no `model`, so there only `lora_path` counts. The adapter is what SGLang publishes as the
    events' `lora_name` (a request's `lora_path` names a loaded adapter). vLLM workers ignore
    `lora_path` (an unknown field to them) and serve the base model, so a pool of them leaves
    it out. An adapter the model names holding a NUL is refused (`check_adapter_name`): it
    could be the index's name for another adapter's pages; so is one longer than
    `limits.max_adapter_name_bytes` (the model's served half is not bounded: it names a pool).
    `lora_path` was checked where it was parsed.
    """
    lora = parsed.lora if choice.reads_lora_path else None
    if choice.adapter is not None and parsed.endpoint is not Endpoint.GENERATE:
        check_adapter_name(choice.adapter, "model", limits)  # its adapter half, or itself (vLLM)
        lora = choice.adapter
    return Namespace(
        model=choice.cache_model,
        lora=lora,
        cache_salt=parsed.salt or None,
        extra_key=parsed.extra_key or None,
    )


def keyed_namespaces(parsed: ParsedRequest, choice: ModelChoice) -> tuple[KeyedShadow, ...]:
    """The namespace of each item of a batch (after the first) that carries an extra_key, as
    `request_namespace` reads the first's: the adapter the model names on an OpenAI route for
    every item (SGLang gives it precedence over `lora_path`), else the item's own `lora_path`
    ("" and null: the base model), none where the workers ignore `lora_path` (vLLM).

    Before, an item without an adapter of its own took the first item's, and on an OpenAI
    route an item's `lora_path` won over the model's adapter: its shadow went on another
    adapter's pages than the worker stored it under, and a plain request of the item's
    namespace was predicted the extra_key's pages (QA: 288 tokens, 0 cached)."""
    adapter = choice.adapter if parsed.endpoint is not Endpoint.GENERATE else None
    out: list[KeyedShadow] = []
    for item in parsed.keyed:
        lora = adapter
        if lora is None and choice.reads_lora_path:
            lora = item.lora
        ns = Namespace(choice.cache_model, lora, item.salt, item.extra_key)
        out.append((ns, item.tokens))
    return tuple(out)
