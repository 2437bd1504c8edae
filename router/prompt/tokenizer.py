"""Prompt tokenization on the router side; it must agree with the workers' tokenizer.

Two kinds: the built-in byte tokenizer the reference workers use (no files), and a Hugging Face
`tokenizer.json` loaded through the optional `tokenizers` package (extra `kvroute[hf]`), imported
only when configured.

Chat requests are rendered into text first, with one of two templates:
- the model's own Jinja chat template (`router.prompt.chat_template`), what SGLang and vLLM
  render with; its text is encoded without added special tokens, since the template writes BOS
  itself, and the text SGLang appends to continue a final assistant message is encoded apart;
- kvroute's built-in template (`indexer.protocol.tokens.render_chat`), what the reference workers
  render with, encoded after a BOS token.
Completion and /generate text is encoded with the tokenizer's special tokens (a model's BOS)
with a Hugging Face tokenizer, as SGLang and vLLM encode it, and without with the byte one.
`tokenizer.chat_template` picks one (see `router.config.TokenizerConfig`).

With a Hugging Face tokenizer, long prompts may be parsed on a thread
(`router.prompt.offload`, `tokenizer.offload_min_bytes`); the byte tokenizer never is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from indexer.protocol.tokens import ByteTokenizer, render_chat
from router.config import TokenizerConfig
from router.errors import ConfigError
from router.prompt.offload import TokenizeOffload

if TYPE_CHECKING:
    # jinja2 comes with the optional extra: imported only when a model template is configured
    from router.prompt.chat_template import ModelChatTemplate
    from router.prompt.conventions import ChatOptions

__all__ = ["BUILTIN_TEMPLATE", "PromptTokenizer", "build_tokenizer", "load_chat_template"]

log = logging.getLogger(__name__)

BUILTIN_TEMPLATE = "kvroute"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class _Encoder(Protocol):
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...


class PromptTokenizer:
    """Text and chat prompts to token ids, the way the workers tokenize them.

    `offload`, when set, is where `router.http.intake` parses long requests (off the loop).
    """

    def __init__(
        self,
        encoder: _Encoder,
        name: str,
        template: ModelChatTemplate | None = None,
        offload: TokenizeOffload | None = None,
        *,
        text_special_tokens: bool = False,
        bos_id: int | None = None,
    ) -> None:
        self._encoder = encoder
        self.name = name
        self.template = template
        self.offload = offload
        # whether a text prompt gets the tokenizer's special tokens (a model's BOS): SGLang
        # and vLLM call a Hugging Face tokenizer with its default, add_special_tokens=True;
        # the reference workers' byte tokenizer adds none to text
        self._text_special = text_special_tokens
        # the id of the model's BOS token (its config's `bos_token`), if it has one
        self._bos_id = bos_id

    def close(self) -> None:
        """Stop the offload threads, if any."""
        if self.offload is not None:
            self.offload.close()

    def text(self, text: str) -> list[int]:
        """Ids of a completion or /generate prompt, as the workers tokenize it: with a Hugging
        Face tokenizer's special tokens (SGLang's `_tokenize_texts`, 0.5.23: the tokenizer's
        default), none with the byte tokenizer (the reference workers')."""
        return self._encoder.encode(text, add_bos=self._text_special)

    def chat(self, messages: Sequence[object], options: ChatOptions | None = None) -> list[int]:
        """Ids of a chat prompt as the engine computes them (raises ChatTemplateError).

        `options` (tools, template kwargs, ...) reach the model template only: kvroute's own
        template, like the reference workers, renders the messages alone.
        """
        if self.template is not None:
            prompt = self.template.render_prompt(messages, options=options)
            ids = self._encoder.encode(prompt.text, add_bos=False)
            if prompt.continuation:
                ids += self._continuation(prompt.continuation)
            return ids
        return self._encoder.encode(render_chat(messages), add_bos=True)

    def _continuation(self, text: str) -> list[int]:
        """A continued assistant message's ids, encoded on their own as SGLang 0.5.23 does
        (serving_chat.py `_append_assistant_prefix_to_prompt_ids`): with the tokenizer's special
        tokens like any text, a leading BOS dropped."""
        ids = self._encoder.encode(text, add_bos=self._text_special)
        if ids and self._bos_id is not None and ids[0] == self._bos_id:
            ids = ids[1:]
        return ids


# from this many characters on, `encode_batch`: it releases the GIL (`encode` does not), so an
# offloaded encode leaves the loop running, and on a long text it is as fast (3.2 ms at best
# for both on ~5,500 tokens, `kvroute bench tokenize`); on a short one it costs a few
# microseconds more (rayon's dispatch), so short texts keep `encode`
_BATCH_MIN_CHARS = 2048


class _HfEncoder:
    """`tokenizers.Tokenizer` behind the byte tokenizer's interface."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids: list[int]
        if len(text) >= _BATCH_MIN_CHARS:
            ids = self._tokenizer.encode_batch([text], add_special_tokens=add_bos)[0].ids
        else:
            ids = self._tokenizer.encode(text, add_special_tokens=add_bos).ids
        return ids


def build_tokenizer(config: TokenizerConfig) -> PromptTokenizer:
    """The configured tokenizer; a missing optional dependency, a tokenizer file or a chat
    template that cannot be loaded is a ConfigError naming its key (`tokenizer.path`...): a
    reload refuses such a file by it (`router.http.start_checks`)."""
    if config.kind == "byte":
        return PromptTokenizer(ByteTokenizer(), "byte", _chat_template(config))
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(
            "tokenizer.kind = 'hf' needs the optional extra: pip install 'kvroute[hf]'",
            key="tokenizer.kind",
        ) from exc
    try:
        hf = tokenizers.Tokenizer.from_file(config.path)
    except Exception as exc:
        raise ConfigError(f"tokenizer.path {config.path!r}: {exc}", key="tokenizer.path") from exc
    # the template after the tokenizer: a missing tokenizer file is said first, alone (its
    # folder's missing template would be warned of before it)
    template = _chat_template(config)
    offload = None
    if config.offload_bytes():
        offload = TokenizeOffload(config.offload_bytes(), config.offload_threads)
    bos = None if template is None else template.special.get("bos_token")
    return PromptTokenizer(
        _HfEncoder(hf),
        f"hf:{config.path}",
        template,
        offload,
        text_special_tokens=True,
        bos_id=None if bos is None else hf.token_to_id(bos),
    )


def _chat_template(config: TokenizerConfig) -> ModelChatTemplate | None:
    """`load_chat_template`, its refusals naming `tokenizer.chat_template` (the template it
    picks, or the one beside `tokenizer.path`) where they name no key of their own."""
    try:
        return load_chat_template(config)
    except ConfigError as exc:
        exc.key = exc.key or "tokenizer.chat_template"
        raise


def load_chat_template(config: TokenizerConfig) -> ModelChatTemplate | None:
    """The model chat template `config` selects, or None for kvroute's built-in one."""
    choice = config.chat_template
    if choice == BUILTIN_TEMPLATE or (not choice and config.kind == "byte"):
        return None
    try:
        from router.prompt.chat_template import ModelChatTemplate
    except ImportError as exc:
        raise ConfigError(
            "model chat templates need jinja2, from the optional extra: pip install 'kvroute[hf]'"
        ) from exc
    if not choice:
        found = _template_beside(Path(config.path).parent)
        if found is None:
            log.warning(
                "no chat template beside %s (%s or %s with a chat_template): chat requests are "
                "rendered with kvroute's template and will not match the engine's cache; set "
                "tokenizer.chat_template",
                config.path,
                CHAT_TEMPLATE_FILE,
                TOKENIZER_CONFIG,
            )
            return None
        return ModelChatTemplate.load(found, engine=config.chat_engine)
    path = Path(choice)
    if not path.is_file():
        raise ConfigError(f"tokenizer.chat_template {choice!r}: no such file")
    # a bare .jinja file takes its special tokens from the model's tokenizer config
    special_from = path.with_name(TOKENIZER_CONFIG)
    if config.kind == "hf" and Path(config.path).with_name(TOKENIZER_CONFIG).is_file():
        special_from = Path(config.path).with_name(TOKENIZER_CONFIG)
    return ModelChatTemplate.load(path, special_tokens_from=special_from, engine=config.chat_engine)


def _template_beside(folder: Path) -> Path | None:
    """The file holding the model's template in a model folder, if there is one."""
    config = folder / TOKENIZER_CONFIG
    if config.is_file():
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            return config  # loads the .jinja file, with the config's special tokens
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{config}: {exc}") from exc
        if isinstance(data, dict) and data.get("chat_template"):
            return config
        return None
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return folder / CHAT_TEMPLATE_FILE
    return None
