"""How many output tokens a request may generate, as SGLang reads it (sglang 0.5.23).

The admission forecast counts the pages the requests running on a worker take beyond their
prompts while a new request waits (`router.routing.admission`): SGLang budgets each running
request's remaining `max_new_tokens` (clipped at 4,096) when it admits, and the pages its
output fills are taken from the same pool the cached prefixes live in. A request that names its
limit tells the router that size; one that does not gets the engine's default where the engine
has one:

- `/generate`: `sampling_params.max_new_tokens`, default 128 (`SamplingParams`); a batch's
  first item's parameters when they are a list;
- `/v1/completions`: `max_tokens`, default 16 (`CompletionRequest`);
- `/v1/chat/completions`: `max_completion_tokens`, else the deprecated `max_tokens`; no
  default (the engine runs to the end of the context), so None: the router's configured
  `admission_reserve_tokens` stands in.

A value that is not a non-negative integer is left to the engine to refuse; the router then
knows nothing (None). Pure functions of the decoded body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "CLIP_OUTPUT_TOKENS",
    "PREFILL_OUTPUT_TOKENS",
    "chat_output_limit",
    "completion_output_limit",
    "generate_output_limit",
]

# SGLang's CLIP_MAX_NEW_TOKENS: the scheduler budgets no more than this per request
CLIP_OUTPUT_TOKENS = 4096
# what a prefill/decode pair's prefill side generates: the first token (SGLang's prefill server
# sets `max_new_tokens` to 1)
PREFILL_OUTPUT_TOKENS = 1
_GENERATE_DEFAULT = 128
_COMPLETION_DEFAULT = 16


def _limit(value: object) -> int | None:
    if type(value) is not int or value < 0:
        return None
    return min(value, CLIP_OUTPUT_TOKENS)


def generate_output_limit(body: Mapping[str, Any]) -> int | None:
    """The output limit of a `/generate` body."""
    params = body.get("sampling_params")
    if isinstance(params, list):
        params = params[0] if params else None
    if params is None:
        return _GENERATE_DEFAULT
    if not isinstance(params, dict):
        return None
    return _limit(params.get("max_new_tokens", _GENERATE_DEFAULT))


def completion_output_limit(body: Mapping[str, Any]) -> int | None:
    """The output limit of a `/v1/completions` body."""
    return _limit(body.get("max_tokens", _COMPLETION_DEFAULT))


def chat_output_limit(body: Mapping[str, Any]) -> int | None:
    """The output limit of a `/v1/chat/completions` body (None: none named)."""
    # as SGLang reads them: `max_completion_tokens or max_tokens`
    return _limit(body.get("max_completion_tokens") or body.get("max_tokens"))
