"""Tokenizers: the built-in byte tokenizer, and a Hugging Face tokenizer.json (optional extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from indexer.protocol.tokens import ByteTokenizer, render_chat
from router.config import TokenizerConfig
from router.errors import ConfigError
from router.prompt.tokenizer import build_tokenizer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "chat-templates"


def test_byte_tokenizer_matches_the_workers() -> None:
    tok = build_tokenizer(TokenizerConfig())
    messages = [{"role": "user", "content": "héllo"}]
    assert tok.text("héllo") == ByteTokenizer().encode("héllo")
    assert tok.chat(messages) == ByteTokenizer().encode(render_chat(messages), add_bos=True)


def test_hf_tokenizer_file_is_used_when_the_extra_is_installed(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "[BOS]": 1, "hello": 2, "world": 3}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    hf = tokenizers.Tokenizer(model)
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)]
    )
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(path)))
    # text as SGLang and vLLM encode it: the tokenizer's special tokens included (its BOS)
    assert tok.text("hello world nope") == [1, 2, 3, 0]
    assert tok.chat([{"role": "user", "content": "hello"}])[0] == 1  # BOS from the template


@pytest.mark.parametrize(
    ("model", "bos"),
    [
        ("llama-3-8b-instruct", "<|begin_of_text|>"),
        ("mistral-nemo-instruct-2407", "<s>"),
        ("qwen3-0.6b", None),
    ],
)
def test_a_text_prompt_starts_as_the_engine_starts_it(model: str, bos: str | None) -> None:
    """SGLang (`TokenizerManager._tokenize_texts`, 0.5.23) calls the model's tokenizer with its
    default, add_special_tokens=True: Llama's and Mistral's text prompts start with their BOS,
    Qwen's with none. Without it a text prompt's blocks never matched what the worker cached."""
    tokenizers = pytest.importorskip("tokenizers")
    path = FIXTURES / model / "tokenizer.json"
    own = tokenizers.Tokenizer.from_file(str(path))
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(path)))
    text = "The quick brown fox jumps over the lazy dog. " * 3
    ids = tok.text(text)
    bare = own.encode(text, add_special_tokens=False).ids
    if bos is None:
        assert ids == bare
    else:
        assert ids == [own.token_to_id(bos), *bare]


def test_hf_tokenizer_errors_are_config_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = TokenizerConfig(kind="hf", path=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError) as info:
        build_tokenizer(config)
    # the missing file is what is said: no warning about its folder's chat template first
    assert "chat template" not in caplog.text
    if importlib.util.find_spec("tokenizers") is None:
        assert "kvroute[hf]" in str(info.value)
    else:
        assert "missing.json" in str(info.value)
