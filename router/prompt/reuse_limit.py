"""How much of a prompt the engine may take from its cache, when prompt logprobs cap it.

An engine reuses at most the prompt's tokens but the last (whose logits it must compute). When
a request asks for the logprobs of prompt tokens, SGLang (0.5.23, `Req._compute_max_prefix_len`)
also reuses nothing from the first token it must score on: a cached prefix has no logits to
give. Predicting the whole held prefix for such a request would be a hit the worker does not
give. As SGLang reads the body:

- `/generate`: `return_logprob` true with `logprob_start_len` >= 0 caps the reuse at
  `logprob_start_len` (a batch's first item's values when they are lists); -1 or none
  (the default) scores the output only, and nothing is capped;
- `/v1/completions`: `echo` with `logprobs` scores the whole prompt (`logprob_start_len` 0):
  nothing is reused (vLLM's prompt logprobs skip its prefix cache too);
- `/v1/chat/completions`: output logprobs only; nothing is capped.

Values of the wrong type are left to the engine to refuse (no cap). A pure function of the
decoded body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["completion_reuse_limit", "generate_reuse_limit"]


def _first(value: object) -> object:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def generate_reuse_limit(body: Mapping[str, Any]) -> int | None:
    """The most prompt tokens the engine may reuse for a `/generate` body (None: no cap but
    the last token's)."""
    start = _first(body.get("logprob_start_len"))
    if _first(body.get("return_logprob")) is True and type(start) is int and start >= 0:
        return start
    return None


def completion_reuse_limit(body: Mapping[str, Any]) -> int | None:
    """The same for a `/v1/completions` body: 0 when it echoes the prompt with logprobs."""
    return 0 if body.get("echo") and body.get("logprobs") else None
