"""Model chat templates: byte-for-byte the text and ids transformers' apply_chat_template gives.

The goldens under tests/fixtures/chat-templates/ were made by the real `transformers` from real
model templates (see make_goldens.py and the README there); here kvroute renders the same
messages and must agree exactly, errors included.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from indexer.protocol.tokens import ByteTokenizer, ChatTemplateError, render_chat
from router.config import TokenizerConfig, parse_config
from router.errors import ConfigError
from router.prompt import chat_template as chat_template_module
from router.prompt.chat_template import ModelChatTemplate, detect_content_format, special_tokens
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer, load_chat_template
from tests.router.chat_routing import (
    FIXTURES,
    MODELS,
    check_chat_matches_rendered_text,
    goldens,
)


def _cases() -> list[tuple[str, str]]:
    return [(m, c["name"]) for m in MODELS for c in goldens(m)["cases"]]


def _case(model: str, name: str) -> dict[str, Any]:
    return next(c for c in goldens(model)["cases"] if c["name"] == name)


def _model_config(model: str) -> TokenizerConfig:
    """An hf tokenizer pointed at the fixture folder; the template is found beside it (auto)."""
    return TokenizerConfig(kind="hf", path=str(FIXTURES / model / "tokenizer.json"))


@pytest.fixture(autouse=True)
def _golden_day(frozen_now: None) -> None:
    """Every test here sees the day the goldens were made."""


def test_the_fixtures_cover_the_templates_the_issue_names() -> None:
    assert {"llama-3-8b-instruct", "mistral-nemo-instruct-2407", "gemma-2-2b-it"} <= set(MODELS)
    assert any(m.startswith("qwen") for m in MODELS)


@pytest.mark.parametrize(("model", "name"), _cases())
def test_rendering_matches_transformers_byte_for_byte(model: str, name: str) -> None:
    pytest.importorskip("tokenizers")
    case = _case(model, name)
    tokenizer = build_tokenizer(_model_config(model))
    assert tokenizer.template is not None
    if "error" in case:
        with pytest.raises(ChatTemplateError) as info:
            tokenizer.template.render(case["messages"])
        assert case["error"] in str(info.value)
        return
    assert tokenizer.template.render(case["messages"]) == case["rendered"]
    # the ids transformers made from the same tokenizer.json, without added special tokens
    assert tokenizer.chat(case["messages"]) == case["ids"]


def test_chat_ids_are_the_rendered_text_encoded_without_special_tokens() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    model = "llama-3-8b-instruct"
    hf = tokenizers.Tokenizer.from_file(str(FIXTURES / model / "tokenizer.json"))
    tokenizer = build_tokenizer(_model_config(model))
    assert tokenizer.template is not None
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tokenizer.template.render(messages)
    ids = tokenizer.chat(messages)
    assert ids == hf.encode(rendered, add_special_tokens=False).ids
    bos = hf.token_to_id("<|begin_of_text|>")
    # the template wrote BOS once; encoding with special tokens would have doubled it
    assert ids[0] == bos and ids[1] != bos
    assert hf.encode(rendered, add_special_tokens=True).ids[:2] == [bos, bos]


def test_special_tokens_accept_strings_and_added_token_dicts() -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "unk_token": None,
        "pad_token": {"content": 5},
        "chat_template": "ignored",
    }
    assert special_tokens(config) == {"bos_token": "<s>", "eos_token": "</s>"}
    # an absent token renders as nothing (transformers does not pass it), never as "None"
    template = ModelChatTemplate("[{{ bos_token }}|{{ unk_token }}]", special={})
    assert template.render([{"role": "user", "content": "x"}]) == "[|]"


def test_tojson_does_not_html_escape_and_takes_transformers_arguments() -> None:
    source = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=1, sort_keys=true) }}"
    template = ModelChatTemplate(source)
    out = template.render([{"role": "user", "content": "<a href='x'>&é"}])
    assert out.startswith('{"role": "user", "content": "<a href=\'x\'>&é"}|{\n "content"')


def test_generation_tag_and_loop_controls_are_available() -> None:
    source = (
        "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    template = ModelChatTemplate(source)
    assert template.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ) == ("a")


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ("not a list", "messages must be a list"),
        ([], "must not be empty"),
        ([42], "messages[0] must be an object"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "content[0].text"),
        ([{"role": "user", "content": ["bare string part"]}], "content[0] must be an object"),
    ],
)
def test_bad_messages_are_chat_template_errors(messages: Any, needle: str) -> None:
    template = ModelChatTemplate("{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError) as info:
        template.render(messages)
    assert needle in str(info.value)


def test_a_type_error_inside_the_template_is_a_chat_template_error() -> None:
    # the template concatenates content as a string; a tool-style content object breaks it
    template = ModelChatTemplate("{{ 'x' + messages[0].content }}")
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "user", "content": {"nested": True}}])
    assert "chat template failed" in str(info.value)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['json'] }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ dict.__class__.__base__ }}",
        "{{ strftime_now.__globals__['datetime'] }}",
    ],
)
def test_templates_that_reach_outside_the_sandbox_are_refused(source: str) -> None:
    template = ModelChatTemplate(source)
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "user", "content": "x"}])
    assert "chat template" in str(info.value)


def test_a_single_unsafe_attribute_renders_as_nothing() -> None:
    # transformers' environment makes it an undefined value; only using it further raises
    template = ModelChatTemplate("[{{ messages.__class__ }}{{ dict.__init__ }}]")
    assert template.render([{"role": "user", "content": "x"}]) == "[]"


def test_rendered_output_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template_module, "MAX_RENDERED_CHARS", 1000)
    template = ModelChatTemplate(
        "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "user", "content": "0123456789"}])
    assert "exceeds 1000 characters" in str(info.value)


def test_content_format_detection_follows_the_engines() -> None:
    def loop_over(expr: str) -> str:
        return "{% for part in " + expr + " %}{{ part.text }}{% endfor %}"

    assert detect_content_format("{{ messages[0]['content'] }}") == "string"
    assert detect_content_format(loop_over("message['content']")) == "openai"
    assert detect_content_format(loop_over("m.content | list")) == "openai"
    assert detect_content_format(loop_over("msg.content[1:]")) == "openai"
    assert detect_content_format(loop_over("turn.content")) == "string"  # not a name they check
    assert detect_content_format(loop_over("message['parts']")) == "string"
    assert detect_content_format("{{ '<|vision_start|>' }}") == "openai"  # SGLang's shortcut
    assert detect_content_format("{% for %}") == "string"  # unparsable: the engines' default


def _parts_template() -> str:
    return (
        "{% for message in messages %}<{{ message.role }}>"
        "{% if message.content is string %}s:{{ message.content }}"
        "{% else %}{% for p in message.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}"
        "{% endif %}{% endfor %}"
    )


def test_list_content_is_flattened_the_way_each_engine_does() -> None:
    parts = [
        {"type": "text", "text": "a"},
        {"type": "image_url"},
        {"type": "input_text", "text": "b"},
    ]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    string_template = "{% for m in messages %}({{ m.content }}){% endfor %}"
    assert ModelChatTemplate(string_template).render(messages) == "(a b)()"
    assert ModelChatTemplate(string_template, engine="vllm").render(messages) == "(a\nb)()"
    typed = _parts_template()
    assert ModelChatTemplate(typed).content_format == "openai"
    assert ModelChatTemplate(typed).render(messages) == (
        "<user>[text:a][image:][text:b]<assistant>s:"
    )
    # vLLM hands typed-parts templates every content as parts, strings included
    plain = [{"role": "user", "content": "hi"}]
    assert ModelChatTemplate(typed, engine="vllm").render(plain) == "<user>[text:hi]"
    assert ModelChatTemplate(typed).render(plain) == "<user>s:hi"


def test_sglang_lower_cases_the_roles_its_message_models_take_and_refuses_the_rest() -> None:
    # SGLang 0.5.23 protocol.py: the generic message model lower-cases its roles; the user
    # model takes "user" exactly, so "User" is refused
    template = ModelChatTemplate("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    messages = [
        {"role": "System", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "ASSISTANT", "content": "a", "tool_calls": [_CALL]},
        {"role": "Tool", "content": "t"},
        {"role": "user", "content": "u"},
    ]
    assert template.render(messages) == "<system><user><assistant><tool><user>"
    # the assistant's tool calls were recognized under the lower-cased role
    calls = ModelChatTemplate("{{ messages[0].tool_calls[0].function.arguments.a }}")
    assert calls.render([{"role": "Assistant", "content": "", "tool_calls": [_CALL]}]) == "1"
    for role in ("User", "bogus"):
        with pytest.raises(ChatTemplateError) as info:
            template.render([{"role": role, "content": "x"}])
        assert "messages[0].role" in str(info.value) and repr(role) in str(info.value)


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_sglang_joins_a_tool_messages_text_parts_with_a_space_for_a_typed_parts_template() -> None:
    # SGLang 0.5.23 normalize_tool_content: tool results reach even a typed-parts template as
    # one string when every part is text; a media part keeps the list
    typed = ModelChatTemplate(_parts_template())
    text = [{"type": "text", "text": "sunny"}, {"type": "input_text", "text": "22C"}]
    messages = [{"role": "tool", "content": text}, {"role": "user", "content": text}]
    assert typed.render(messages) == "<tool>s:sunny 22C<user>[text:sunny][text:22C]"
    media = [{"role": "tool", "content": [*text, {"type": "image_url"}]}]
    assert typed.render(media) == "<tool>[text:sunny][text:22C][image:]"
    assert typed.render([{"role": "Tool", "content": []}]) == "<tool>s:"
    # vLLM 0.33 chat_message.py:661-686 joins them too, with a newline
    assert ModelChatTemplate(_parts_template(), engine="vllm").render(messages[:1]) == (
        "<tool>s:sunny\n22C"
    )


def test_vllm_keeps_only_the_message_fields_its_openai_layer_keeps() -> None:
    source = "{% for m in messages %}{{ m | tojson }}{% endfor %}"
    messages = [{"role": "user", "content": "x", "name": "bob", "extra": 1}]
    assert ModelChatTemplate(source, engine="vllm").render(messages) == (
        '{"role": "user", "content": "x", "name": "bob"}'
    )
    assert '"extra": 1' in ModelChatTemplate(source).render(messages)


def _merging_tokenizer(folder: Path) -> Any:
    """A byte-level BPE that merges "\\n\\n" and prepends <s>, saved with a ChatML template."""
    tokenizers = pytest.importorskip("tokenizers")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    alphabet = sorted(byte_level.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["ĊĊ"] = len(vocab)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    hf.pre_tokenizer = byte_level(add_prefix_space=False, use_regex=True)
    hf.add_special_tokens([tokenizers.AddedToken("<s>", special=True, normalized=False)])
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))]
    )
    hf.save(str(folder / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    config = {"bos_token": "<s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


def test_a_continued_message_is_encoded_apart_from_the_prompt(tmp_path: Path) -> None:
    # SGLang 0.5.23 _append_assistant_prefix_to_prompt_ids: the prompt's ids, then the continued
    # text's own ids (encoded with special tokens, BOS dropped): no BPE merge across the two
    hf = _merging_tokenizer(tmp_path)
    tokenizer = build_tokenizer(_config_at(tmp_path))
    prefix = "\n\nOnce upon"
    body = {
        "continue_final_message": True,
        "messages": [
            {"role": "user", "content": "Tell a story."},
            {"role": "assistant", "content": prefix},
        ],
    }
    tokens = parse_request(Endpoint.CHAT, json.dumps(body).encode(), tokenizer).tokens
    text = "<s><|user|>Tell a story.<|end|><|assistant|>\n"
    expected = hf.encode(text, add_special_tokens=False).ids
    expected += hf.encode(prefix, add_special_tokens=False).ids
    assert tokens == expected
    # the case is one where encoding the joined text merges differently
    assert tokens != hf.encode(text + prefix, add_special_tokens=False).ids
    assert hf.encode(prefix).ids[0] == hf.token_to_id("<s>")


def _config_at(folder: Path) -> TokenizerConfig:
    return TokenizerConfig(kind="hf", path=str(folder / "tokenizer.json"))


# --- configuration ----------------------------------------------------------------------------


def test_byte_kind_keeps_the_builtin_template_by_default() -> None:
    tok = build_tokenizer(TokenizerConfig())
    messages = [{"role": "user", "content": "héllo"}]
    assert tok.template is None
    assert tok.chat(messages) == ByteTokenizer().encode(render_chat(messages), add_bos=True)


def test_kvroute_literal_selects_the_builtin_template_even_beside_a_model_template() -> None:
    pytest.importorskip("tokenizers")
    model = "llama-3-8b-instruct"
    config = TokenizerConfig(
        kind="hf", path=str(FIXTURES / model / "tokenizer.json"), chat_template="kvroute"
    )
    assert load_chat_template(config) is None


def test_auto_prefers_chat_template_jinja_beside_the_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "config:{{ bos_token }}", "bos_token": "<B>"})
    )
    config = TokenizerConfig(kind="hf", path=str(tmp_path / "tokenizer.json"))
    template = load_chat_template(config)
    assert (
        template is not None and template.render([{"role": "user", "content": ""}]) == "config:<B>"
    )
    (tmp_path / "chat_template.jinja").write_text("file:{{ bos_token }}")
    template = load_chat_template(config)
    assert template is not None and template.render([{"role": "user", "content": ""}]) == "file:<B>"


def test_auto_without_a_model_template_warns_and_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    config = TokenizerConfig(kind="hf", path=str(tmp_path / "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="router.prompt.tokenizer"):
        assert load_chat_template(config) is None
    assert "will not match" in caplog.text and "tokenizer.chat_template" in caplog.text


def test_a_jinja_file_takes_special_tokens_from_the_tokenizer_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<E>"}))
    jinja = tmp_path / "custom.jinja"
    jinja.write_text("{{ messages[0].content }}{{ eos_token }}")
    config = TokenizerConfig(
        kind="hf", path=str(model / "tokenizer.json"), chat_template=str(jinja)
    )
    template = load_chat_template(config)
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]) == "x<E>"


def test_a_tokenizer_config_with_named_templates_uses_the_default(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    path.write_text(json.dumps({"chat_template": named}))
    template = load_chat_template(TokenizerConfig(chat_template=str(path)))
    assert template is not None and template.render([{"role": "user", "content": ""}]) == "D"


@pytest.mark.parametrize(
    ("files", "choice", "needle"),
    [
        ({}, "missing.jinja", "missing.jinja"),
        ({"bad.jinja": "{% for x in %}"}, "bad.jinja", "invalid Jinja at line 1"),
        ({"tokenizer_config.json": "{not json"}, "tokenizer_config.json", "invalid JSON"),
        ({"tokenizer_config.json": "{}"}, "tokenizer_config.json", "no chat_template"),
        ({"tokenizer_config.json": "[1]"}, "tokenizer_config.json", "a JSON object"),
        ({"t.jinja": b"\xff\xfe"}, "t.jinja", "t.jinja"),
    ],
)
def test_config_errors_name_the_file(
    tmp_path: Path, files: dict[str, str | bytes], choice: str, needle: str
) -> None:
    for name, content in files.items():
        target = tmp_path / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    with pytest.raises(ConfigError) as info:
        build_tokenizer(TokenizerConfig(chat_template=str(tmp_path / choice)))
    assert needle in str(info.value) and choice in str(info.value)


def test_the_config_fields_parse_from_toml_data() -> None:
    config = parse_config(
        {"tokenizer": {"kind": "byte", "chat_template": "kvroute", "chat_engine": "vllm"}}
    )
    assert config.tokenizer.chat_template == "kvroute" and config.tokenizer.chat_engine == "vllm"
    with pytest.raises(ConfigError) as info:
        parse_config({"tokenizer": {"chat_engine": "tgi"}})
    assert "chat_engine" in str(info.value)


# --- through the real router ------------------------------------------------------------------


async def test_the_router_matches_chat_requests_rendered_with_the_model_template() -> None:
    """A worker caches a prompt as text; the same prompt sent as chat must match it.

    The reference workers tokenize /generate text byte by byte, and the router's byte
    tokenizer renders chat with the Llama 3 template and encodes it without BOS: so a chat
    request matches exactly the pages a worker stored for the rendered text, and not when the
    router falls back to kvroute's own template.
    """
    model = FIXTURES / "llama-3-8b-instruct"
    messages = [
        {"role": "system", "content": "You are the support assistant of ACME. " * 8},
        {"role": "user", "content": "Where is my order?"},
    ]
    rendered = ModelChatTemplate.load(model / "tokenizer_config.json").render(messages)
    await check_chat_matches_rendered_text(
        model / "tokenizer_config.json",
        {"model": "m", "messages": messages},
        rendered,
        {"model": "m", "messages": [{"content": "no role"}]},
        "messages[0].role",
    )
