"""Chat messages as each engine's OpenAI layer hands them to the chat template.

Before `transformers` normalizes them (`router.prompt.chat_template`), the engines prepare the
request's messages differently:
- SGLang 0.5.23 keeps every field as sent, lower-cases the roles its message models take
  (refusing others), dumps assistant tool calls through its `ToolCall` model (arguments must be
  a JSON object), flattens list content for a string-content template by joining the text parts
  with a space, and joins a tool message's text parts with a space even for a typed-parts one.
- vLLM 0.33 (`renderers/chat_utils/chat_message.py`, `renderers/hf.py`) keeps role, content and
  the fields each role has (an assistant's tool calls and reasoning, sent as `reasoning` or
  `reasoning_content`; a tool message's `tool_call_id`; a string `name`), reads plain-string
  parts and the `output_text`, `refusal` and `thinking` parts as text, joins texts with a
  newline for a string-content template and a tool message's text parts always, drops Claude
  Code's billing line from system text, reads invalid or non-object tool-call arguments as
  `{}`, and, for a template that never names the "developer" role, turns developer messages
  into system messages merged at the front (`vllm_conversation`).
Which content a template wants is its `ContentFormat` (`router.prompt.content_format`).
`router.prompt.conventions` binds each engine to its functions here.

Not mirrored: media parts, which the engine expands into model-specific tokens (they are kept
as typed parts without their data, or dropped from flattened text); vLLM's extra keys on typed
parts (a part's fields beyond those its content-part types declare, e.g. `cache_control`,
which vLLM passes on to a typed-parts template); vLLM's `--chat-template-content-format`
server flag (the format is always detected).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from indexer.protocol.tokens import ChatTemplateError

__all__ = [
    "ContentFormat",
    "sglang_message",
    "vllm_conversation",
    "vllm_has_media",
    "vllm_message",
]

# how a template wants a message's content: one string, or OpenAI's list of typed parts
ContentFormat = Literal["string", "openai"]

# SGLang 0.5.23 protocol.py: `ChatCompletionMessageGenericParam._normalize_role` lower-cases a
# role and takes these; `ChatCompletionMessageUserParam` takes "user" as written, nothing else
_SGLANG_GENERIC_ROLES = (
    "system",
    "assistant",
    "tool",
    "function",
    "developer",
    "latest_reminder",
    "root",
)
_TEXT_PART_TYPES = ("text", "input_text")
_MEDIA_PART_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
}


def _text_parts(content: list[Any], index: int) -> Iterator[tuple[str, str | None]]:
    """(kind, text) of each content part; media parts yield their kind and no text."""
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{index}].content[{j}] must be an object")
        kind = part.get("type")
        if kind in _TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{index}].content[{j}].text must be a string")
            yield "text", text
        elif isinstance(kind, str) and kind in _MEDIA_PART_TYPES:
            yield _MEDIA_PART_TYPES[kind], None


def _flattened(
    content: list[Any], index: int, content_format: ContentFormat, separator: str
) -> object:
    parts = list(_text_parts(content, index))
    if content_format == "string":
        return separator.join(text for _, text in parts if text is not None)
    return [{"type": "text", "text": t} if t is not None else {"type": k} for k, t in parts]


def _assistant_calls(message: Mapping[str, Any]) -> list[Any] | None:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return None
    return calls


def _call_function(call: object, field: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict):
        raise ChatTemplateError(f"{field}.function must be an object")
    return function


def _json_arguments(arguments: str, field: str) -> object:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError) as exc:
        raise ChatTemplateError(f"{field}.function.arguments must be valid JSON") from exc


def _tool_text(role: str, content: object) -> object:
    """A tool message's parts, all text, as one string joined with a space, as SGLang 0.5.23
    hands them even to a template that wants typed parts (serving_chat.py
    `normalize_tool_content`: most templates print a tool result as a string)."""
    if role != "tool" or not isinstance(content, list):
        return content
    if not all(part.get("type") == "text" for part in content):
        return content  # a media part: the template iterates over the parts
    return " ".join(part["text"] for part in content)


def _sglang_role(role: str, index: int) -> str:
    """The role as SGLang's message models validate it: "System" is "system", "User" a 400."""
    if role == "user":
        return role
    lowered = role.lower()
    if lowered not in _SGLANG_GENERIC_ROLES:
        raise ChatTemplateError(
            f"messages[{index}].role must be 'user' or one of "
            f"{', '.join(_SGLANG_GENERIC_ROLES)} (any case), not {role!r}"
        )
    return lowered


def sglang_message(
    message: Mapping[str, Any], role: str, index: int, content_format: ContentFormat
) -> dict[str, Any]:
    """Every field as sent, the role normalized; assistant tool calls dumped through SGLang's
    `ToolCall` model.

    That model has id, index, type and function, so unset fields are there as nulls, and it
    requires the arguments to be a JSON object.
    """
    fields = dict(message)
    fields["role"] = _sglang_role(role, index)
    content = message.get("content")
    if content is None:
        fields["content"] = ""  # SGLang renders a null content as the empty string
    elif isinstance(content, list):
        fields["content"] = _tool_text(
            fields["role"], _flattened(content, index, content_format, " ")
        )
    calls = _assistant_calls(fields)
    if calls is None:
        return fields
    parsed_calls = []
    for j, call in enumerate(calls):
        field = f"messages[{index}].tool_calls[{j}]"
        function = _call_function(call, field)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _json_arguments(arguments, field)
            if not isinstance(arguments, dict):
                raise ChatTemplateError(f"{field}.function.arguments must be a JSON object")
        parsed_calls.append(
            {
                "id": call.get("id"),
                "index": call.get("index"),
                "type": call.get("type", "function"),
                "function": {"name": function.get("name"), "arguments": arguments},
            }
        )
    fields["tool_calls"] = parsed_calls
    return fields


# vLLM 0.33 chat_message.py: the part types read as text (`TEXT_PART_TYPES`), with the field
# each reads its text from (`MM_PARSER_MAP`)
_VLLM_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# a part of these types with null text is skipped (`PART_TYPES_TO_SKIP_NONE_CONTENT`); the
# others become a part with null text, or nothing in a flattened string
_VLLM_SKIP_NULL_TEXT = ("text", "refusal")
# the media part types, by the modality a typed-parts template sees
_VLLM_MEDIA_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
    "prompt_embeds": "prompt_embeds",
}
# the fields that give a part without a type its kind (`parse_chat_message_content_mm_part`)
_VLLM_UNTYPED_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# Claude Code's attribution line, whose `cch` changes per request
# (`_strip_claude_code_billing_header`)
_BILLING_HEADER = "x-anthropic-billing-header"

# one parsed part: ("text", its text or None), ("tool_reference", its name) or (modality, None)
_Part = tuple[str, object]


def _vllm_part_type(part: Mapping[str, Any], field: str) -> str:
    """The part's type as vLLM reads it: a part without one (or with a `uuid`) is named by the
    media field it holds."""
    kind = part.get("type")
    if isinstance(kind, str) and part.get("uuid") is None:
        if kind in _VLLM_TEXT_FIELDS or kind in _VLLM_MEDIA_TYPES or kind == "tool_reference":
            return kind
        raise ChatTemplateError(f"{field}.type {kind!r} is not a chat content part type")
    if kind is None or part.get("uuid") is not None:
        for key in _VLLM_UNTYPED_KEYS:
            if key in part:
                return key
        raise ChatTemplateError(f"{field} has no type")
    raise ChatTemplateError(f"{field}.type must be a string")


def _vllm_parts(content: list[Any], index: int) -> Iterator[_Part]:
    """Each part as vLLM 0.33 parses it (`parse_chat_message_content_part`)."""
    for j, part in enumerate(content):
        field = f"messages[{index}].content[{j}]"
        if isinstance(part, str):
            yield "text", part
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{field} must be a string or an object")
        kind = _vllm_part_type(part, field)
        if kind in _VLLM_TEXT_FIELDS:
            key = _VLLM_TEXT_FIELDS[kind]
            text = part.get(key)
            if text is None and kind in _VLLM_SKIP_NULL_TEXT:
                continue
            if text is not None and not isinstance(text, str):
                raise ChatTemplateError(f"{field}.{key} must be a string")
            yield "text", text
        elif kind == "tool_reference":
            yield kind, part.get("name")
        else:
            yield _VLLM_MEDIA_TYPES[kind], None


def _vllm_content(content: list[Any], index: int, content_format: ContentFormat) -> object:
    """The parts as the template gets them: typed parts, or the texts joined with a newline.

    Joining skips empty texts (vLLM keeps only truthy parsed parts) and media, which the engine
    replaces with model-specific placeholders (not mirrored).
    """
    parts = list(_vllm_parts(content, index))
    if content_format == "string":
        return "\n".join(str(v) for k, v in parts if k in ("text", "tool_reference") and v)
    typed: list[dict[str, Any]] = []
    for kind, value in parts:
        if kind == "text":
            typed.append({"type": "text", "text": value})
        elif kind == "tool_reference":
            typed.append({"type": kind, "name": value})
        else:
            typed.append({"type": kind})
    return typed


def _without_billing_header(content: list[Any]) -> list[Any]:
    """A system message's parts with Claude Code's billing line dropped from each text."""
    out: list[Any] = []
    for part in content:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not isinstance(text, str) or not text.startswith(_BILLING_HEADER):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _joined_tool_text(content: object) -> object:
    """A tool message's typed text parts as one string joined with a newline: most templates
    print a tool result as a string. Other parts (a tool reference) keep the list."""
    if not isinstance(content, list):
        return content
    if any(part.get("type") != "text" for part in content):
        return content
    return "\n".join(part.get("text") or "" for part in content)


def _vllm_arguments(arguments: object, field: str) -> object:
    """Tool-call arguments as vLLM's `_postprocess_messages` leaves them: an object, with
    missing, invalid-JSON and non-object arguments read as `{}` so that a conversation whose
    history holds a malformed call can go on."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        except RecursionError as exc:
            raise ChatTemplateError(f"{field}.function.arguments nests too deep") from exc
    return arguments if isinstance(arguments, dict) else {}


def _vllm_tool_calls(calls: object, index: int) -> list[Any] | None:
    """An assistant's tool calls with parsed arguments; None when the list is empty."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"messages[{index}].tool_calls must be a list")
    if not calls:
        return None  # dropped: keeps templates on the plain assistant path
    parsed = []
    for j, call in enumerate(calls):
        field = f"messages[{index}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ChatTemplateError(f"{field} must be an object")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ChatTemplateError(f"{field} must be a function call with a function object")
        arguments = _vllm_arguments(function.get("arguments"), field)
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def vllm_message(
    message: Mapping[str, Any], role: str, index: int, content_format: ContentFormat
) -> dict[str, Any]:
    """The message as vLLM 0.33's `parse_chat_message_content` and `_postprocess_messages`
    make it: role and content, then the fields each role keeps.

    An assistant keeps its tool calls (arguments parsed) and its reasoning, sent as `reasoning`
    or as `reasoning_content` (the request model renames it) and passed under both names; a
    tool message its `tool_call_id`, with typed text parts joined; a developer message its
    `tools`; any message a string `name` and `task`. A system message loses Claude Code's
    billing line.
    """
    content = message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [content]
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list")
    if role == "system":
        content = _without_billing_header(content)
    fields: dict[str, Any] = {
        "role": role,
        "content": _vllm_content(content, index, content_format),
    }
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = _vllm_tool_calls(message["tool_calls"], index)
            if calls is not None:
                fields["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            fields["reasoning"] = fields["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            fields["tool_call_id"] = message["tool_call_id"]
        fields["content"] = _joined_tool_text(fields["content"])
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            fields[key] = message[key]
    if role == "developer":
        fields["tools"] = message.get("tools")
    return fields


def vllm_conversation(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """vLLM 0.33's `safe_apply_chat_template`: when the template never names the "developer"
    role, developer messages become system messages (without their tools), and then all system
    messages are merged into one at the front, if they are not a lone first one already."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    if '"developer"' in template or "'developer'" in template:
        return messages
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        text = message.get("content", "")
        if isinstance(text, list):
            # a null text (a typed part vLLM keeps) fails vLLM's join; here it is left out
            text = "\n".join(
                part if isinstance(part, str) else part["text"]
                for part in text
                if isinstance(part, str)
                or (isinstance(part, dict) and isinstance(part.get("text"), str))
            )
        if text:
            texts.append(text)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def vllm_has_media(messages: object) -> bool:
    """Whether vLLM 0.33 sees non-text content in the messages (`has_non_text_content`): then
    it renders them even when a pre-tokenized prompt came with the request."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        for key in ("reasoning", "reasoning_content"):
            reasoning = message.get(key)
            if isinstance(reasoning, Mapping) and reasoning.get("type") == "prompt_embeds":
                return True
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type", "text")
            if (
                any(key in part for key in _VLLM_MEDIA_TYPES)
                or not isinstance(kind, str)
                or (kind not in _VLLM_TEXT_FIELDS and kind != "tool_reference")
            ):
                return True
    return False
