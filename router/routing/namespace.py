"""Cache namespaces of requests; their public fingerprints come from `indexer.fingerprint`."""

from __future__ import annotations

from indexer.fingerprint import Fingerprinter
from indexer.service import Namespace
from router.config import LimitsConfig
from router.prompt.request import Endpoint, ParsedRequest, check_adapter_name
from router.routing.pool import ModelChoice

__all__ = ["Fingerprinter", "request_namespace"]


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
