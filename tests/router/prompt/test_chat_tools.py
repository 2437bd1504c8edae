"""Chat requests with tools, tool_choice and chat_template_kwargs, rendered as each engine does.

The `request_cases` of tests/fixtures/chat-templates/*/goldens.json are whole OpenAI request
bodies rendered by the real `transformers` from what SGLang's and vLLM's OpenAI layers hand it
(see make_goldens.py and the README there); here the raw body goes through kvroute's request
parser and must give the same text and ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from indexer.engines import EngineName
from router.config import TokenizerConfig
from router.errors import RequestError
from router.prompt.chat_template import ModelChatTemplate
from router.prompt.conventions import (
    SGLANG_CHAT,
    VLLM_CHAT,
    ChatOptions,
    chat_convention,
    chat_options,
)
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer
from tests.router.chat_routing import (
    FIXTURES,
    MODELS,
    check_chat_matches_rendered_text,
    goldens,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _request_cases() -> list[tuple[str, str, str]]:
    return [
        (m, c["name"], c["engine"]) for m in MODELS for c in goldens(m).get("request_cases", [])
    ]


@pytest.fixture(autouse=True)
def _golden_day(frozen_now: None) -> None:
    """Every test here sees the day the goldens were made."""


def _tokenizer_config(model: str, engine: EngineName) -> TokenizerConfig:
    return TokenizerConfig(
        kind="hf", path=str(FIXTURES / model / "tokenizer.json"), chat_engine=engine
    )


def test_the_goldens_cover_tools_and_kwargs_for_both_engines() -> None:
    cases = _request_cases()
    names = {name for _, name, _ in cases}
    assert {"tools_auto", "tool_choice_named", "tool_choice_none", "thinking_off"} <= names
    assert {engine for _, _, engine in cases} == {"sglang", "vllm"}
    # the two engines must really differ somewhere, or the goldens prove nothing about either
    qwen = {(c["name"], c["engine"]): c for c in goldens("qwen3-0.6b")["request_cases"]}
    assert qwen["tools_auto", "sglang"]["rendered"] != qwen["tools_auto", "vllm"]["rendered"]
    assert "<think>\n\n</think>" in qwen["thinking_off", "vllm"]["rendered"]


@pytest.mark.parametrize(("model", "name", "engine"), _request_cases())
def test_chat_requests_render_like_each_engine(model: str, name: str, engine: EngineName) -> None:
    pytest.importorskip("tokenizers")
    case = next(
        c for c in goldens(model)["request_cases"] if c["name"] == name and c["engine"] == engine
    )
    tokenizer = build_tokenizer(_tokenizer_config(model, engine))
    assert tokenizer.template is not None and tokenizer.template.engine == engine
    raw = json.dumps(case["request"]).encode()
    if "error" in case:
        with pytest.raises(RequestError) as info:
            parse_request(Endpoint.CHAT, raw, tokenizer)
        assert case["error"] in str(info.value)
        return
    options = chat_options(case["request"], chat_convention(engine))
    assert (
        tokenizer.template.render(case["request"]["messages"], options=options)
        == (case["rendered"])
    )
    assert parse_request(Endpoint.CHAT, raw, tokenizer).tokens == case["ids"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": {"name": "x"}}, "tools must be a list of objects"),
        ({"tools": ["get_weather"]}, "tools must be a list of objects"),
        ({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
        ({"tools": [{"function": {"name": 7}}]}, "tools[0].function.name"),
        ({"tools": [{"function": {"name": "f", "description": 1}}]}, "function.description"),
        ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, "function.strict"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [WEATHER], "tool_choice": {"function": "f"}}, "tool_choice must be"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must be an object"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs must be an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat"),
        ({"chat_template_kwargs": {"documents": "d"}}, "documents must be a list of objects"),
        ({"chat_template_kwargs": {"sanitize_control_tokens": True}}, "not supported"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
        ({"reasoning_effort": True}, "reasoning_effort must be one of"),
        ({"continue_final_message": "yes"}, "continue_final_message must be a boolean"),
    ],
)
def test_malformed_chat_fields_are_400s_naming_the_field(
    engine: EngineName, body: dict[str, Any], needle: str
) -> None:
    tokenizer = build_tokenizer(
        TokenizerConfig(
            chat_template=str(FIXTURES / "qwen3-0.6b" / "chat_template.jinja"), chat_engine=engine
        )
    )
    assert tokenizer.template is not None
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(RequestError) as info:
        parse_request(Endpoint.CHAT, json.dumps(request).encode(), tokenizer)
    assert needle in str(info.value)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_sglangs_chat_input_ids_are_the_prompt(engine: EngineName) -> None:
    tokenizer = build_tokenizer(
        TokenizerConfig(
            chat_template=str(FIXTURES / "qwen3-0.6b" / "chat_template.jinja"), chat_engine=engine
        )
    )
    own = build_tokenizer(TokenizerConfig())
    messages = [{"role": "user", "content": "hi"}]
    request = {"model": "m", "messages": messages, "input_ids": [1, 2, 3]}
    rendered = parse_request(Endpoint.CHAT, json.dumps({"messages": messages}).encode(), tokenizer)
    parsed = parse_request(Endpoint.CHAT, json.dumps(request).encode(), tokenizer)
    # SGLang skips the template for them (its own template too); vLLM has no such field
    assert parsed.tokens == ([1, 2, 3] if engine == "sglang" else rendered.tokens)
    assert parse_request(Endpoint.CHAT, json.dumps(request).encode(), own).tokens == [1, 2, 3]
    # still a request: the messages are checked, and so are the ids
    bad_fields: list[tuple[dict[str, Any], str]] = [
        ({"messages": "x"}, "messages must be a list"),
        ({"input_ids": [1, "a"]}, "input_ids must be a list of integers"),
    ]
    for bad, needle in bad_fields:
        with pytest.raises(RequestError) as info:
            parse_request(Endpoint.CHAT, json.dumps({**request, **bad}).encode(), own)
        assert needle in str(info.value)


def test_kvroutes_own_template_ignores_tools_but_checks_their_shape() -> None:
    tokenizer = build_tokenizer(TokenizerConfig())
    messages = [{"role": "user", "content": "hi"}]
    plain = parse_request(Endpoint.CHAT, json.dumps({"messages": messages}).encode(), tokenizer)
    body = {"messages": messages, "tools": [WEATHER], "chat_template_kwargs": {"x": 1}}
    with_tools = parse_request(Endpoint.CHAT, json.dumps(body).encode(), tokenizer)
    assert with_tools.tokens == plain.tokens
    bad_fields: list[tuple[dict[str, object], str]] = [
        ({"tools": "x"}, "tools"),
        ({"chat_template_kwargs": 1}, "kwargs"),
    ]
    for bad, needle in bad_fields:
        with pytest.raises(RequestError, match=needle):
            parse_request(
                Endpoint.CHAT, json.dumps({"messages": messages, **bad}).encode(), tokenizer
            )


@pytest.mark.parametrize(
    ("engine", "body", "needle"),
    [
        ("sglang", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ("sglang", {"chat_template_kwargs": {"add_generation_prompt": False}}, "add_generation"),
        ("sglang", {"tool_choice": "required"}, '"required" needs tools'),
        ("sglang", {"tools": [WEATHER], "tool_choice": {"function": {"name": "nope"}}}, "nope"),
        ("sglang", {"reasoning_effort": 1.5}, "number in [0, 0.99]"),
        ("vllm", {"reasoning_effort": 0.5}, "reasoning_effort must be one of"),
        ("vllm", {"add_generation_prompt": 1}, "add_generation_prompt must be a boolean"),
        ("vllm", {"continue_final_message": True}, "cannot both be true"),
        ("vllm", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ("vllm", {"tools": [{"function": {"name": "f", "parameters": []}}]}, "parameters"),
    ],
)
def test_each_engine_refuses_what_its_request_model_refuses(
    engine: EngineName, body: dict[str, Any], needle: str
) -> None:
    with pytest.raises(RequestError) as info:
        chat_options({"messages": [], **body}, chat_convention(engine))
    assert needle in str(info.value)


def test_tool_call_arguments_are_parsed_and_must_be_json_for_sglang() -> None:
    source = "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    # SGLang dumps each call through its ToolCall model; vLLM keeps the call as sent
    assert ModelChatTemplate(source).render(messages) == (
        '[{"id": "c1", "index": null, "type": "function", '
        '"function": {"name": "f", "arguments": {"a": 1}}}]'
    )
    assert ModelChatTemplate(source, engine="vllm").render(messages) == (
        '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]'
    )
    for engine, arguments, needle in [
        ("sglang", "{not json", "must be valid JSON"),
        ("sglang", "[1, 2]", "must be a JSON object"),
    ]:  # vLLM reads both as {} (test_vllm_chat.py)
        bad = {**call, "function": {"name": "f", "arguments": arguments}}
        template = ModelChatTemplate(source, engine=engine)  # type: ignore[arg-type]
        with pytest.raises(Exception) as info:
            template.render([{"role": "assistant", "tool_calls": [bad]}])
        assert "messages[0].tool_calls[0].function.arguments" in str(info.value)
        assert needle in str(info.value)
    # vLLM reads missing arguments as an empty object and drops an empty tool_calls list
    defined = "{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}"
    empty = [{"role": "assistant", "content": "x", "tool_calls": []}]
    assert ModelChatTemplate(defined, engine="vllm").render(empty) == "False"
    assert ModelChatTemplate(defined).render(empty) == "True"


def test_sglang_dumps_a_tool_schema_in_the_clients_key_order_without_unset_flags() -> None:
    # SGLang 0.5.23's Function serializer: the client's key order, then the missing fields
    # (description and parameters as null); strict and defer_loading only when set; unknown
    # keys dropped; the Tool wrapper keeps its own order and its null defer_loading
    template = ModelChatTemplate("{% for t in tools %}{{ t | tojson }}\n{% endfor %}")
    tools = [
        WEATHER,
        {"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "strict": None}},
        {
            "type": "function",
            "function": {"strict": True, "name": "g", "extra": 1},
            "defer_loading": True,
        },
    ]
    options = chat_options({"tools": tools}, SGLANG_CHAT)
    assert template.render([{"role": "user", "content": "x"}], options=options) == (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a '
        'city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}, '
        '"defer_loading": null}\n'
        '{"type": "function", "function": {"parameters": {"b": 1, "a": 2}, "name": "f", '
        '"description": null}, "defer_loading": null}\n'
        '{"type": "function", "function": {"strict": true, "name": "g", "description": null, '
        '"parameters": null, "defer_loading": true}, "defer_loading": true}\n'
    )


def test_sglang_renders_a_final_assistant_message_with_text_as_a_user_message() -> None:
    # SGLang 0.5.23 `_handle_last_assistant_message`, when not continuing: the role becomes
    # user and only the content is kept; typed-parts content is left as it was
    source = "{% for m in messages %}<{{ m.role }}:{{ m.content }}|{{ m.name }}>{% endfor %}"
    final: dict[str, Any] = {"role": "assistant", "content": None, "name": "poet", "tool_calls": []}
    messages = [{"role": "user", "content": "Write."}, final]
    body = {"messages": messages}
    sglang = ModelChatTemplate(source)
    assert sglang.render(messages, options=chat_options(body, SGLANG_CHAT)) == (
        "<user:Write.|><user:|>"
    )
    # transformers alone (no request options) and vLLM render the assistant turn as sent
    assert sglang.render(messages) == "<user:Write.|><assistant:|poet>"
    vllm = ModelChatTemplate(source, engine="vllm")
    assert vllm.render(messages, options=chat_options(body, VLLM_CHAT)) == (
        "<user:Write.|><assistant:|poet>"
    )
    parts = ModelChatTemplate(
        "{% for m in messages %}<{{ m.role }}:"
        "{% for p in m.content %}{{ p.text }}{% endfor %}>{% endfor %}"
    )
    typed = [
        {"role": "user", "content": [{"type": "text", "text": "Write."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Roses"}]},
    ]
    assert parts.render(typed, options=chat_options({}, SGLANG_CHAT)) == (
        "<user:Write.><assistant:Roses>"
    )


def test_sglang_retries_with_bare_function_schemas_when_the_first_render_fails() -> None:
    # a template that wants {name, ...} schemas, not OpenAI's {"type", "function"} wrapper
    source = (
        "{% for t in tools %}{% if t.name is not defined %}"
        "{{ raise_exception('bare schemas only') }}{% endif %}[{{ t.name }}]{% endfor %}"
        "{{ messages[0].content }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    template = ModelChatTemplate(source)
    options = chat_options({"tools": [WEATHER]}, SGLANG_CHAT)
    assert template.render(messages, options=options) == "[get_weather]hi"
    vllm = ModelChatTemplate(source, engine="vllm")
    with pytest.raises(Exception, match="bare schemas only"):
        vllm.render(messages, options=chat_options({"tools": [WEATHER]}, VLLM_CHAT))


def test_a_tool_use_named_template_is_chosen_when_tools_are_passed(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    named = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    path.write_text(json.dumps({"chat_template": named}))
    template = ModelChatTemplate.load(path)
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages) == "D:x"
    assert template.render(messages, options=ChatOptions(tools=[WEATHER])) == "T:1:x"
    # SGLang passes no tools for tool_choice "none": the default template renders
    no_tools = chat_options({"tools": [WEATHER], "tool_choice": "none"}, SGLANG_CHAT)
    assert template.render(messages, options=no_tools) == "D:x"


def test_template_kwargs_reach_the_template_and_override_special_tokens() -> None:
    source = (
        "{{ bos_token }}|{{ flag }}|{{ thinking }}|{{ enable_thinking }}|{{ reasoning_effort }}"
    )
    template = ModelChatTemplate(source, special={"bos_token": "<s>"})
    messages = [{"role": "user", "content": "x"}]
    plain = chat_options({"chat_template_kwargs": {"flag": 1}}, SGLANG_CHAT)
    assert template.render(messages, options=plain) == "<s>|1|||"
    override = chat_options({"chat_template_kwargs": {"bos_token": "<B>"}}, SGLANG_CHAT)
    assert template.render(messages, options=override).startswith("<B>|")
    # SGLang: an effort implies both thinking switches unless the request set them
    effort = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert template.render(messages, options=chat_options(effort, SGLANG_CHAT)) == (
        "<s>||True|False|low"
    )
    # vLLM: only enable_thinking, and a null or "auto" kwarg counts as unset
    vllm = ModelChatTemplate(source, special={"bos_token": "<s>"}, engine="vllm")
    body = {"reasoning_effort": "none", "chat_template_kwargs": {"flag": "auto", "thinking": None}}
    assert vllm.render(messages, options=chat_options(body, VLLM_CHAT)) == "<s>|||False|none"


@pytest.mark.parametrize(
    "body",
    [
        {"reasoning_effort": "ultra"},
        {"reasoning": {"effort": "ultra"}},
        {"reasoning_effort": "none", "reasoning": {"reasoning_effort": "ultra"}},
    ],
)
def test_sglang_takes_every_reasoning_effort_tier_of_its_request_model(
    body: dict[str, Any],
) -> None:
    # SGLang 0.5.23 ReasoningEffortTier has "ultra" (DeepSeek's) beside the OpenAI tiers; the
    # tier reaches the template as written and turns both thinking switches on
    template = ModelChatTemplate("{{ reasoning_effort }}|{{ thinking }}|{{ enable_thinking }}")
    options = chat_options(body, SGLANG_CHAT)
    assert template.render([{"role": "user", "content": "x"}], options=options) == (
        "ultra|True|True"
    )


def test_vllm_kwargs_tools_replace_the_request_tools() -> None:
    template = ModelChatTemplate("{{ tools | tojson }}", engine="vllm")
    messages = [{"role": "user", "content": "x"}]
    body = {"tools": [WEATHER], "chat_template_kwargs": {"tools": [{"name": "raw"}]}}
    assert template.render(messages, options=chat_options(body, VLLM_CHAT)) == '[{"name": "raw"}]'
    # and an empty tools list is still a list for vLLM (a template testing `is not none` sees it)
    assert template.render(messages, options=chat_options({"tools": []}, VLLM_CHAT)) == "[]"
    sglang = ModelChatTemplate("{{ tools | tojson }}")
    assert sglang.render(messages, options=chat_options({"tools": []}, SGLANG_CHAT)) == "null"


def test_documents_reach_the_template() -> None:
    source = "{% for d in documents %}[{{ d.title }}]{% endfor %}"
    messages = [{"role": "user", "content": "x"}]
    docs = [{"title": "a", "text": "1"}, {"title": "b", "text": "2"}]
    sglang = chat_options({"chat_template_kwargs": {"documents": docs}}, SGLANG_CHAT)
    assert ModelChatTemplate(source).render(messages, options=sglang) == "[a][b]"
    vllm = chat_options({"documents": docs[:1]}, VLLM_CHAT)
    assert ModelChatTemplate(source, engine="vllm").render(messages, options=vllm) == "[a]"


async def test_the_router_matches_a_chat_request_with_tools() -> None:
    """The prompt a worker cached as text must match the same request sent as chat with tools.

    With kvroute's Qwen3 fixture template and SGLang's conventions, the tool schemas are part of
    the prompt: the request matches all the pages of the text rendered with them, and a request
    with malformed tools is a 400 naming the field.
    """
    model = FIXTURES / "qwen3-0.6b"
    messages = [
        {"role": "system", "content": "You are the support agent of ACME. " * 6},
        {"role": "user", "content": "Where is my order?"},
    ]
    body = {
        "model": "m",
        "messages": messages,
        "tools": [WEATHER],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    rendered = ModelChatTemplate.load(model / "tokenizer_config.json").render(
        messages, options=chat_options(body, SGLANG_CHAT)
    )
    assert "get_weather" in rendered and rendered.endswith("<think>\n\n</think>\n\n")
    await check_chat_matches_rendered_text(
        model / "tokenizer_config.json",
        body,
        rendered,
        {**body, "tools": [{"type": "function", "function": {"name": 3}}]},
        "tools[0].function.name",
    )
