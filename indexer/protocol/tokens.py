"""The built-in byte tokenizer and chat template shared by reference workers and the router.

Prefix routing only works when the router and the workers agree on token ids, so the embedded
fleet uses one deterministic tokenizer that needs no model files: every UTF-8 byte of the text
is one token, id = byte value + `BYTE_OFFSET`. Ids below the offset are reserved for special
tokens (BOS). It lives beside the wire protocol because `workers` may import nothing else of
ours.

The chat template renders each message as `<|role|>\\n{content}\\n` after a BOS token and ends
with `<|assistant|>\\n`, so a conversation that grows by turns keeps its earlier turns as an
exact token prefix (which is what makes multi-turn cache hits possible).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BOS_TOKEN_ID",
    "BYTE_OFFSET",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "ChatTemplateError",
    "checked_messages",
    "render_chat",
]

BOS_TOKEN_ID = 1
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET


class ChatTemplateError(ValueError):
    """A chat message list that cannot be rendered; the message names the bad field."""


class ByteTokenizer:
    """Byte-level tokenizer: one token per UTF-8 byte, deterministic and reversible."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; BOS first when asked (chat prompts)."""
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS_TOKEN_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special and out-of-range ids are dropped, bad UTF-8 is replaced."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < VOCAB_SIZE)
        return data.decode("utf-8", errors="replace")


def _content_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{index}].content[].text must be a string")
            parts.append(text)
        return "".join(parts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")


def checked_messages(messages: object) -> list[tuple[Mapping[str, object], str]]:
    """Each message of a chat request with its role; ChatTemplateError names the bad field.

    Every chat template (this one and a model's, `router.chat_template`) starts from here.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ChatTemplateError("messages must be a list")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out: list[tuple[Mapping[str, object], str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        out.append((message, role))
    return out


def render_chat(messages: Sequence[object], *, add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style chat messages into the prompt text both sides tokenize."""
    chunks: list[str] = []
    for i, (message, role) in enumerate(checked_messages(messages)):
        chunks.append(f"<|{role}|>\n{_content_text(message.get('content'), i)}\n")
    if add_generation_prompt:
        chunks.append("<|assistant|>\n")
    return "".join(chunks)
