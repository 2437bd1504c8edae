"""How much of a prompt the engine may take from its cache, when the request caps it.

An engine reuses at most the prompt's tokens but the last (whose logits it must compute). Some
requests reuse less, or nothing, and predicting the whole held prefix for them would be a hit
the worker does not give. The request is parsed before its worker (and so its engine) is
chosen, so the rules of both engines apply (fail closed: where one of them reuses less, less
is predicted):

- prompt logprobs. SGLang (0.5.23, `Req._compute_max_prefix_len`) reuses nothing from the first
  prompt token it must score: `/generate` with `return_logprob` true and `logprob_start_len`
  >= 0 is capped there (a batch's first item's values when they are lists; -1, the default,
  scores the output only), `/v1/completions` with `echo` and `logprobs` at 0. vLLM (0.33,
  `SamplingParams.skip_reading_prefix_cache`) reuses nothing once `prompt_logprobs` is set: by
  the field itself, by `echo` with `logprobs` (0 included) on completions, by `echo` on chat
  (which asks for `top_logprobs`, 0 by default);
- `truncate_prompt_tokens` (vLLM) shorter than the prompt: the engine computes a cut prompt,
  from the side its tokenizer says (the router cannot know which): nothing is predicted;
- `add_special_tokens` against the endpoint's default (vLLM: true for text, false for chat):
  the engine's tokens differ from the router's from the first one: nothing is predicted;
- media parts in chat messages: the engine expands them into tokens the router does not make
  (a placeholder per image, in front of the message's text for a template that wants a
  string), so the router's tokens are not the engine's past the first one: nothing is predicted.
  Likewise SGLang's `/generate` with `image_data`, `video_data` or `audio_data` (any item not
  null, as `has_valid_data` reads them): the engine swaps each placeholder for pad ids drawn from
  the media's hash, and the router cannot tell where the placeholders are;
- SGLang's `session_params` (`/generate` and its OpenAI routes): the engine puts the session's
  earlier prompt and output in front of the prompt (`SessionController`, 0.5.23), a prefix the
  router never saw: nothing is predicted;
- SGLang's `positional_embed_overrides` (`/generate`, any item not null): the engine matches
  no prefix for such a request, nor caches it (0.5.23, `Req.init_next_round_input` and
  `skip_radix_cache_insert`: the same ids with other vectors are other KV): nothing is
  predicted.

Values of the wrong type are left to the engine to refuse (no cap). Pure functions of the
decoded body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["chat_reuse_limit", "completion_reuse_limit", "generate_reuse_limit"]

# parts that carry no media: vLLM 0.33 reads these as text (chat_message.py `TEXT_PART_TYPES`,
# with `thinking`), as the router does in vLLM mode, and SGLang's message models take no
# `output_text` or `refusal` part. Newer SGLang models take `thinking` and `tool_reference`
# parts, which the router's SGLang mode does not render: those still cap (fail closed).
_TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")
_MEDIA_FIELDS = ("image_data", "video_data", "audio_data")
# /generate fields whose any item not null makes the engine reuse nothing (`_holds_media`)
_NO_PREFIX_FIELDS = (*_MEDIA_FIELDS, "positional_embed_overrides")


def _first(value: object) -> object:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def generate_reuse_limit(body: Mapping[str, Any]) -> int | None:
    """The most prompt tokens the engine may reuse for a `/generate` body (None: no cap but
    the last token's)."""
    if body.get("session_params") is not None or any(
        _holds_media(body.get(field)) for field in _NO_PREFIX_FIELDS
    ):
        return 0
    start = _first(body.get("logprob_start_len"))
    if _first(body.get("return_logprob")) is True and type(start) is int and start >= 0:
        return start
    return None


def _holds_media(value: object) -> bool:
    """Whether a `/generate` media field (or another of `_NO_PREFIX_FIELDS`) holds an item
    (lists nest per batch item)."""
    if isinstance(value, list):
        return any(_holds_media(item) for item in value)
    return value is not None


def completion_reuse_limit(body: Mapping[str, Any], prompt_tokens: int) -> int | None:
    """The same for a `/v1/completions` body of a `prompt_tokens`-token prompt."""
    logprobs = body.get("logprobs")
    if body.get("echo") and logprobs is not None and logprobs is not False:
        return 0
    if _caps_openai(body, prompt_tokens, special_tokens=True):
        return 0
    return None


def chat_reuse_limit(body: Mapping[str, Any], prompt_tokens: int) -> int | None:
    """The same for a `/v1/chat/completions` body of a `prompt_tokens`-token prompt."""
    if body.get("echo") is True or _caps_openai(body, prompt_tokens, special_tokens=False):
        return 0
    messages = body.get("messages")
    if isinstance(messages, list) and any(_has_media(m) for m in messages):
        return 0
    return None


def _caps_openai(body: Mapping[str, Any], prompt_tokens: int, *, special_tokens: bool) -> bool:
    """The OpenAI fields that make the engine reuse nothing the router could predict: vLLM's,
    and SGLang's session."""
    if body.get("prompt_logprobs") is not None or body.get("session_params") is not None:
        return True
    if body.get("prompt_embeds"):
        # vLLM keys embedded prompts by their tensors (0.33 `kv_cache_utils`), never by the
        # token ids the router would compute from a text prompt given beside them
        return True
    cut = body.get("truncate_prompt_tokens")
    if type(cut) is int and 0 <= cut < prompt_tokens:
        return True
    given = body.get("add_special_tokens")
    return isinstance(given, bool) and given is not special_tokens


def _has_media(message: object) -> bool:
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list):
        return False
    return any(
        isinstance(part, Mapping) and part.get("type", "text") not in _TEXT_PART_TYPES
        for part in content
    )
