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

The fields are read as the engines read them, through pydantic models in lax mode: SGLang's
OpenAI routes and vLLM's take `1`, `1.0` or `"true"` (`"yes"`, `"on"`, ...) as true and
`"5"`, `5.0` or `true` as an int; SGLang 0.5.23 refuses such values on `/generate` (its JSON
contract check, a 400), but its `GenerateReqInput` takes them the same lax way, and so may the
releases before it. A value that some engine may read as asking for a cap caps; one the router
cannot read as the engine would (and the engine should refuse) caps too, to what it can be
sure of: nothing (fail closed). Before, only JSON `true` and integers counted: `"echo": 1`
on a chat request, `"truncate_prompt_tokens": "5"` or `"add_special_tokens": "false"` were
predicted the hits vLLM does not give. Pure functions of the decoded body.
"""

from __future__ import annotations

import re
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


# pydantic's lax bools from strings (case-insensitive; `str_as_bool`)
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
# a zero fraction pydantic strips from an int's string ("5.00" is 5)
_ZERO_FRACTION = re.compile(r"\.0*$")


def _lax_bool(value: object) -> bool | None:
    """`value` (not null) as a pydantic bool in lax mode reads it; None: refused (or read in
    a way the router does not know)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return value == 1
    if isinstance(value, str):
        word = value.lower()
        return True if word in _TRUE_WORDS else False if word in _FALSE_WORDS else None
    return None


def _may_be_true(value: object) -> bool:
    """Whether an engine may read the flag `value` as true: anything but null and the values
    pydantic reads as false (fail closed on the ones it refuses)."""
    return value is not None and _lax_bool(value) is not False


def _lax_int(value: object) -> int | None:
    """`value` (not null) as a pydantic int in lax mode reads it; None: refused (or read in
    a way the router does not know)."""
    if isinstance(value, int):  # a bool too: true is 1
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(_ZERO_FRACTION.sub("", value.strip()))
        except ValueError:
            return None
    return None


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
    if not _may_be_true(_first(body.get("return_logprob"))):
        return None
    given = _first(body.get("logprob_start_len"))
    if given is None:
        return None  # -1: the output's logprobs only
    start = _lax_int(given)
    if start is None:
        return 0  # where the engine would start scoring, the router cannot tell
    return start if start >= 0 else None


def _holds_media(value: object) -> bool:
    """Whether a `/generate` media field (or another of `_NO_PREFIX_FIELDS`) holds an item
    (lists nest per batch item)."""
    if isinstance(value, list):
        return any(_holds_media(item) for item in value)
    return value is not None


def completion_reuse_limit(body: Mapping[str, Any], prompt_tokens: int) -> int | None:
    """The same for a `/v1/completions` body of a `prompt_tokens`-token prompt."""
    # vLLM scores the prompt for any `logprobs` (0, and false read as 0, included)
    if _may_be_true(body.get("echo")) and body.get("logprobs") is not None:
        return 0
    if _caps_openai(body, prompt_tokens, special_tokens=True):
        return 0
    return None


def chat_reuse_limit(body: Mapping[str, Any], prompt_tokens: int) -> int | None:
    """The same for a `/v1/chat/completions` body of a `prompt_tokens`-token prompt."""
    if _may_be_true(body.get("echo")) or _caps_openai(body, prompt_tokens, special_tokens=False):
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
    if cut is not None:
        length = _lax_int(cut)
        if length is None or 0 <= length < prompt_tokens:
            return True
    given = body.get("add_special_tokens")
    return given is not None and _lax_bool(given) is not special_tokens


def _has_media(message: object) -> bool:
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list):
        return False
    return any(
        isinstance(part, Mapping) and part.get("type", "text") not in _TEXT_PART_TYPES
        for part in content
    )
