"""vLLM mode (`tokenizer.chat_engine = "vllm"`): chat requests tokenized as vLLM 0.33 does.

Each test builds, by hand, the conversation vLLM's OpenAI layer hands `apply_chat_template`
for a request (the vLLM lines it follows are cited in the test's docstring: files under
`vllm/` of the 0.33 release), renders it with the model template under transformers' rules
(kvroute's Jinja environment and message normalization, held to transformers' own output by
the goldens of test_chat_template.py), encodes it without special tokens (vLLM's chat default)
and requires the router's ids for the raw request to be those ids.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest

from indexer.engines import EngineName
from router.config import TokenizerConfig
from router.errors import RequestError
from router.prompt.chat_template import (
    ModelChatTemplate,
    _transformers_message,
    detect_content_format,
)
from router.prompt.conventions import ChatOptions
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import PromptTokenizer, build_tokenizer
from tests.router.chat_routing import FIXTURES

LLAMA = "llama-3-8b-instruct"
QWEN = "qwen3-0.6b"
USER = "Please summarise the following design document in detail. " * 6


@cache
def _tokenizer(model: str, engine: EngineName = "vllm") -> PromptTokenizer:
    pytest.importorskip("tokenizers")
    path = FIXTURES / model / "tokenizer.json"
    return build_tokenizer(TokenizerConfig(kind="hf", path=str(path), chat_engine=engine))


def _router_ids(model: str, body: dict[str, Any], engine: EngineName = "vllm") -> list[int]:
    raw = json.dumps(body).encode()
    return parse_request(Endpoint.CHAT, raw, _tokenizer(model, engine)).tokens


def _vllm_ids(model: str, conversation: list[dict[str, Any]]) -> list[int]:
    """The ids of `conversation` as vLLM hands it to `apply_chat_template`."""
    import tokenizers

    template = _tokenizer(model).template
    assert template is not None
    messages = [_transformers_message(dict(m)) for m in conversation]
    text = template._generate(template._template, messages, ChatOptions(), None)
    hf = tokenizers.Tokenizer.from_file(str(FIXTURES / model / "tokenizer.json"))
    ids: list[int] = hf.encode(text, add_special_tokens=False).ids
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_developer_messages_become_one_leading_system_message() -> None:
    """renderers/hf.py:887-898 (`safe_apply_chat_template`): when the template has no
    "developer" literal (hf.py:600-601), developer messages become system messages without
    their tools (hf.py:604-616), then every system message is merged, joined with a blank line,
    into one at the front unless a lone one is first already (hf.py:619-658). Llama 3's template
    names no developer role."""
    developer = {"role": "developer", "content": "Be terse.", "tools": None}
    system = {"role": "system", "content": "Be terse."}
    user = {"role": "user", "content": USER}
    assert _router_ids(LLAMA, {"messages": [developer, user]}) == _vllm_ids(LLAMA, [system, user])
    after = {"messages": [user, developer]}
    assert _router_ids(LLAMA, after) == _vllm_ids(LLAMA, [system, user])
    # the false hit this was: a developer turn after a cached prompt shared all of its ids
    cached = _router_ids(LLAMA, {"messages": [user]})
    assert _common_prefix(cached, _router_ids(LLAMA, after)) < 30
    merged = {"role": "system", "content": "Be kind.\n\nBe terse."}
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
            user,
            {"role": "developer", "content": "Be terse."},
            {"role": "system", "content": ""},
        ]
    }
    assert _router_ids(LLAMA, body) == _vllm_ids(LLAMA, [merged, user])


def test_a_template_that_names_the_developer_role_keeps_it_with_its_tools() -> None:
    """chat_message.py:694-695: a developer message carries its `tools`; hf.py:889-892 leaves
    it as it is for a template that says 'developer'."""
    source = (
        "{% for m in messages %}{% if m.role == 'developer' %}D:{{ m.tools | tojson }}"
        "{% else %}{{ m.role }}{% endif %}|{% endfor %}"
    )
    template = ModelChatTemplate(source, engine="vllm")
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d", "tools": tools},
    ]
    assert template.render(messages) == 'user|D:[{"type": "function", "function": {"name": "f"}}]|'
    # SGLang's mode is unchanged: no conversion
    assert ModelChatTemplate("{{ messages[0].role }}").render(messages[1:]) == "developer"


# a string-content template that mentions images only in a comment
_IMAGE_COMMENT = (
    "{# text-only model: image inputs are not supported #}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
)
# a typed-parts template whose loop variable is not one SGLang knows
_TURN_LOOP = (
    "{% for turn in messages %}<|{{ turn['role'] }}|>{% for part in turn['content'] %}"
    "{{ part['text'] }}{% endfor %}|{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_IMAGE_COMMENT, "string"),
        (_TURN_LOOP, "openai"),
        # a variable named content, outside a macro (hf.py:556-563)
        (
            "{% for message in messages %}{% set content = message['content'] %}"
            "{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # aliases of the messages: a slice, a filter, a namespace attribute (hf.py:424-473)
        (
            "{% set rest = messages[1:] %}{% for x in rest %}"
            "{% for p in x.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set ns = namespace(rest=messages | list) %}{% for x in ns.rest %}"
            "{% for p in x['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # a macro parameter receiving a message's content (hf.py:500-544)
        (
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for x in messages %}{{ show(x.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(content) %}{% for p in content %}{% endfor %}{% endmacro %}"
            "{{ show(1) }}",
            "string",
        ),
        # an indexed message is not a loop variable
        ("{% for p in messages[0].content %}{{ p.text }}{% endfor %}", "string"),
        # a matched loop binding two names fails vLLM's walk (its assert): "string"
        (
            "{% for x in messages %}{% for a, b in x.content %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for a, b in messages %}{% endfor %}{% for p in content %}{% endfor %}", "string"),
        ("{% for %}", "string"),
    ],
)
def test_content_format_is_detected_by_vllms_syntax_walk(source: str, expected: str) -> None:
    """renderers/hf.py:364-597 (`_detect_content_format`): only the syntax tree counts."""
    assert detect_content_format(source, "vllm") == expected


def test_the_detected_format_decides_what_the_template_sees() -> None:
    """chat_message.py:381-421 hands a typed-parts template the parts, a string template the
    text; SGLang's rule (any media word; loop variables message/msg/m) is kept for SGLang."""
    messages = [{"role": "user", "content": "hello world"}]
    assert ModelChatTemplate(_IMAGE_COMMENT, engine="vllm").render(messages) == (
        "<|user|>hello world\n"
    )
    assert detect_content_format(_IMAGE_COMMENT) == "openai"  # SGLang's media-word rule
    turn = ModelChatTemplate(_TURN_LOOP, engine="vllm")
    assert turn.render(messages) == "<|user|>hello world|"
    # the false hit this was: every prompt rendered with its content dropped
    assert turn.render([{"role": "user", "content": "another"}]) != turn.render(messages)


def test_kv_transfer_prompt_token_ids_are_the_prompt_of_a_chat_request() -> None:
    """renderers/online_renderer.py:112-157 (`_reused_prompt_token_ids`) and 810-820
    (`preprocess_chat`): a decode stage's forwarded ids are the prompt, the template skipped,
    unless `echo` is set or the messages hold non-text content (chat_message.py:351-378,
    chat_completion/protocol.py:1070-1088); malformed ids are a 400. Completions have no such
    reuse."""
    messages = [{"role": "user", "content": "hi"}]
    ids = list(range(1, 11))
    body = {"messages": messages, "kv_transfer_params": {"prompt_token_ids": ids}}
    assert _router_ids(LLAMA, body) == ids
    rendered = _router_ids(LLAMA, {"messages": messages})
    assert _router_ids(LLAMA, {**body, "echo": True}) == rendered
    image = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    media = {**body, "messages": [{"role": "user", "content": image}]}
    assert _router_ids(LLAMA, media) == _router_ids(LLAMA, {"messages": media["messages"]})
    # SGLang reads no kv_transfer_params
    assert _router_ids(LLAMA, body, "sglang") == _router_ids(
        LLAMA, {"messages": messages}, "sglang"
    )
    for bad in ([], [1, -2], [1, True], "1 2", [1.0]):
        wrong = {**body, "kv_transfer_params": {"prompt_token_ids": bad}}
        with pytest.raises(RequestError) as info:
            _router_ids(LLAMA, wrong)
        assert "kv_transfer_params.prompt_token_ids" in str(info.value)
    completion = {"prompt": "hi", "kv_transfer_params": {"prompt_token_ids": ids}}
    raw = json.dumps(completion).encode()
    tokens = parse_request(Endpoint.COMPLETIONS, raw, _tokenizer(LLAMA)).tokens
    assert tokens == _tokenizer(LLAMA).text("hi")


def test_an_assistants_reasoning_content_reaches_the_template() -> None:
    """chat_completion/protocol.py:576-600 renames `reasoning_content` to `reasoning` (unless
    that is set); chat_message.py:655-660 passes an assistant's reasoning under both names,
    and only an assistant's."""
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    parsed = {**call, "function": {"name": "calc", "arguments": {"x": 1}}}
    body = {
        "messages": [
            {"role": "user", "content": "compute"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "need calc",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": "42", "reasoning_content": "x", "reasoning": "said"},
        ]
    }
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "compute"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [parsed],
            "reasoning": "need calc",
            "reasoning_content": "need calc",
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "42", "reasoning": "said", "reasoning_content": "said"},
    ]
    assert _router_ids(QWEN, body) == _vllm_ids(QWEN, conversation)
    fields = ModelChatTemplate("{{ messages[0] | tojson }}", engine="vllm")
    user = {"role": "user", "content": "u", "reasoning": "r", "tool_calls": [], "name": 5}
    assert fields.render([user]) == '{"role": "user", "content": "u"}'


def test_malformed_tool_call_arguments_read_as_an_empty_object() -> None:
    """chat_message.py:733-771 (`_postprocess_messages`): arguments that are not JSON, or JSON
    but not an object, become `{}` so the conversation can go on; no 400."""
    for arguments in ('{"x": 1', "[1, 2]", "42", ""):
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "calc", "arguments": arguments},
        }
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "compute"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        empty = {**call, "function": {"name": "calc", "arguments": {}}}
        conversation: list[dict[str, Any]] = [
            messages[0],
            {"role": "assistant", "content": "", "tool_calls": [empty]},
            messages[2],
        ]
        assert _router_ids(QWEN, {"messages": messages}) == _vllm_ids(QWEN, conversation)
        # Llama 3 prints no tool calls: the request is rendered, not refused
        assert _router_ids(LLAMA, {"messages": messages})
    with pytest.raises(RequestError) as info:
        _router_ids(QWEN, {"messages": [{"role": "assistant", "tool_calls": ["call"]}]})
    assert "messages[0].tool_calls[0]" in str(info.value)


def test_content_parts_are_read_as_vllm_reads_them() -> None:
    """chat_message.py:336-343 and 443-480: `output_text`, `refusal` and `thinking` parts are
    text (each from its own field), plain strings are text parts, a text or refusal part with
    null text is skipped, empty texts drop out of the newline join (only truthy parts are
    kept, 402-418), and an unknown part type is a 400 (548-555)."""
    content = [
        {"type": "output_text", "text": "b"},
        {"type": "refusal", "refusal": "no"},
        {"type": "thinking", "thinking": "hmm"},
        "plain",
        {"type": "text", "text": None},
        {"type": "text", "text": ""},
    ]
    body = {
        "messages": [
            {"role": "user", "content": ["hello", "world"]},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "c"},
        ]
    }
    conversation = [
        {"role": "user", "content": "hello\nworld"},
        {"role": "assistant", "content": "b\nno\nhmm\nplain"},
        {"role": "user", "content": "c"},
    ]
    assert _router_ids(LLAMA, body) == _vllm_ids(LLAMA, conversation)
    # output_text and refusal parts are no media: the prefix is predicted, not capped at 0
    # (a thinking part still caps: newer SGLang renders it, the router's SGLang mode does not)
    said = [{"role": "assistant", "content": content[:2]}, {"role": "user", "content": "c"}]
    raw = json.dumps({"messages": said}).encode()
    assert parse_request(Endpoint.CHAT, raw, _tokenizer(LLAMA)).reuse_limit is None
    with pytest.raises(RequestError) as info:
        _router_ids(LLAMA, {"messages": [{"role": "user", "content": [{"type": "blob"}]}]})
    assert "messages[0].content[0].type" in str(info.value)


def test_a_tool_messages_text_parts_are_joined_for_a_typed_parts_template() -> None:
    """chat_message.py:661-686: a tool message's parts, all text, reach even a typed-parts
    template as one string joined with a newline; a tool reference keeps the list. Other
    roles keep their parts, plain strings included (460-464)."""
    source = (
        "{% for message in messages %}<{{ message['role'] }}>{% if message['content'] is string %}"
        "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        "[{{ part['type'] }}:{{ part['text'] or part['name'] }}]{% endfor %}{% endif %}{% endfor %}"
    )
    template = ModelChatTemplate(source, engine="vllm")
    assert template.content_format == "openai"
    lines = [{"type": "text", "text": "line1"}, {"type": "output_text", "text": "line2"}]
    messages = [
        {"role": "user", "content": ["run"]},
        {"role": "tool", "tool_call_id": "c1", "content": lines},
        {"role": "tool", "content": [*lines, {"type": "tool_reference", "name": "f"}]},
        {"role": "tool", "content": None},
    ]
    assert template.render(messages) == (
        "<user>[text:run]<tool>line1\nline2<tool>[text:line1][text:line2][tool_reference:f]<tool>"
    )


def test_claude_codes_billing_line_is_dropped_from_system_text() -> None:
    """chat_message.py:575-607 and 635-636: a system text that starts with
    x-anthropic-billing-header loses its first line (a part of that line alone is dropped);
    other roles keep it."""
    header = "x-anthropic-billing-header: cc_version=1.0; cch=7f3a"
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": f"{header}\nYou are Claude Code."},
            {"role": "user", "content": "hi"},
        ]
    }
    conversation = [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "hi"},
    ]
    assert _router_ids(LLAMA, body) == _vllm_ids(LLAMA, conversation)
    parts = [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude Code."}]
    body["messages"][0] = {"role": "system", "content": parts}
    assert _router_ids(LLAMA, body) == _vllm_ids(LLAMA, conversation)
    kept: dict[str, Any] = {"messages": [{"role": "user", "content": f"{header}\nhi"}]}
    assert _router_ids(LLAMA, kept) == _vllm_ids(LLAMA, kept["messages"])
