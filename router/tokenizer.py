"""Prompt tokenization on the router side; it must agree with the workers' tokenizer.

Two kinds: the built-in byte tokenizer the reference workers use (no files), and a Hugging Face
`tokenizer.json` loaded through the optional `tokenizers` package (extra `kvroute[hf]`), imported
only when configured. Chat requests are rendered with the project's chat template in both
cases: model-specific Jinja templates are out of scope, so with a real model, route chat by
`input_ids` or accept that chat affinity is approximate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from indexer.protocol.tokens import ByteTokenizer, render_chat
from router.config import TokenizerConfig
from router.errors import ConfigError

__all__ = ["PromptTokenizer", "build_tokenizer"]


class _Encoder(Protocol):
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...


class PromptTokenizer:
    """Text and chat prompts to token ids, the way the workers tokenize them."""

    def __init__(self, encoder: _Encoder, name: str) -> None:
        self._encoder = encoder
        self.name = name

    def text(self, text: str) -> list[int]:
        """Ids of a completion or /generate prompt (no BOS, as the workers do)."""
        return self._encoder.encode(text)

    def chat(self, messages: Sequence[object]) -> list[int]:
        """Ids of a chat prompt: BOS + the rendered template (raises ChatTemplateError)."""
        return self._encoder.encode(render_chat(messages), add_bos=True)


class _HfEncoder:
    """`tokenizers.Tokenizer` behind the byte tokenizer's interface."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_bos).ids
        return ids


def build_tokenizer(config: TokenizerConfig) -> PromptTokenizer:
    """The configured tokenizer; a missing optional dependency is a ConfigError."""
    if config.kind == "byte":
        return PromptTokenizer(ByteTokenizer(), "byte")
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(
            "tokenizer.kind = 'hf' needs the optional extra: pip install 'kvroute[hf]'"
        ) from exc
    try:
        hf = tokenizers.Tokenizer.from_file(config.path)
    except Exception as exc:
        raise ConfigError(f"tokenizer.path {config.path!r}: {exc}") from exc
    return PromptTokenizer(_HfEncoder(hf), f"hf:{config.path}")
