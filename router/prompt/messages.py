"""Chat messages as each engine's OpenAI layer hands them to the chat template.

Before `transformers` normalizes them (`router.prompt.chat_template`), the engines prepare the
request's messages differently: SGLang keeps every field as sent, lower-cases the roles its
message models take (refusing others), dumps assistant tool calls through its `ToolCall` model
and joins a tool message's text parts with a space; vLLM keeps role, content and a few fields,
passes content as typed parts, and keeps tool calls as sent. Both parse tool-call arguments from
JSON text and flatten list content for a template that wants a string (SGLang joining the text
parts with a space, vLLM with a newline); which one a template wants is its `ContentFormat`,
detected from its syntax tree. `router.prompt.conventions` binds each engine to its function
here.

Not mirrored: media parts, which the engine expands into model-specific tokens (they are kept
as typed parts without their data, or dropped from flattened text).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from indexer.protocol.tokens import ChatTemplateError

__all__ = ["ContentFormat", "sglang_message", "vllm_message"]

# how a template wants a message's content: one string, or OpenAI's list of typed parts
ContentFormat = Literal["string", "openai"]

# what vLLM's OpenAI layer keeps of a message besides role and content
_VLLM_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning")
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


def vllm_message(
    message: Mapping[str, Any], role: str, index: int, content_format: ContentFormat
) -> dict[str, Any]:
    """Role, content as parts, and the fields vLLM keeps; tool calls kept as sent, parsed.

    Missing arguments read as an empty object, and an empty `tool_calls` list is dropped, which
    keeps templates on the plain assistant path.
    """
    content = message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list")
    fields = {"role": role, "content": _flattened(content, index, content_format, "\n")}
    fields.update({k: message[k] for k in _VLLM_MESSAGE_FIELDS if k in message})
    calls = _assistant_calls(fields)
    if calls is None:
        return fields
    if not calls:
        del fields["tool_calls"]
        return fields
    parsed_calls = []
    for j, call in enumerate(calls):
        field = f"messages[{index}].tool_calls[{j}]"
        function = _call_function(call, field)
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            arguments = _json_arguments(arguments, field)
        parsed_calls.append({**call, "function": {**function, "arguments": arguments}})
    fields["tool_calls"] = parsed_calls
    return fields
