"""What a request lets the engine reuse: the caps of both engines, read from the body.

SGLang caps reuse at the first scored prompt token; vLLM reuses nothing with prompt logprobs,
a cut prompt, another special-tokens setting, or (the router cannot make the engine's media
tokens) media in chat messages. Each was a predicted hit the worker does not give.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.prompt.reuse_limit import (
    chat_reuse_limit,
    completion_reuse_limit,
    generate_reuse_limit,
)

TEXT = [{"role": "user", "content": "describe the report"}]
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "describe the report"},
        ],
    }
]


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"prompt": "x"}, None),
        ({"prompt": "x", "logprobs": 1}, None),  # output logprobs only
        ({"prompt": "x", "echo": True}, None),  # echo without logprobs scores nothing
        ({"prompt": "x", "echo": True, "logprobs": 1}, 0),
        ({"prompt": "x", "echo": True, "logprobs": 0}, 0),  # vLLM: 0 asks for them too
        ({"prompt": "x", "prompt_logprobs": 0}, 0),
        ({"prompt": "x", "truncate_prompt_tokens": 10}, 0),  # shorter than the 100 tokens
        ({"prompt": "x", "truncate_prompt_tokens": 100}, None),  # cuts nothing
        ({"prompt": "x", "truncate_prompt_tokens": -1}, None),
        ({"prompt": "x", "add_special_tokens": False}, 0),
        ({"prompt": "x", "add_special_tokens": True}, None),  # the default
        ({"prompt": "x", "session_params": {"id": "s1"}}, 0),  # SGLang: history in front
        ({"prompt": "x", "session_params": None}, None),
        ({"prompt": "x", "prompt_embeds": "AAAAAA=="}, 0),  # vLLM keys the tensors
        ({"prompt": "x", "prompt_embeds": []}, None),  # none given
    ],
)
def test_completion_caps(body: dict[str, Any], limit: int | None) -> None:
    assert completion_reuse_limit(body, 100) == limit


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"messages": TEXT}, None),
        ({"messages": TEXT, "logprobs": True, "top_logprobs": 2}, None),
        ({"messages": TEXT, "echo": True}, 0),  # vLLM: prompt_logprobs = top_logprobs (0)
        ({"messages": TEXT, "prompt_logprobs": 1}, 0),
        ({"messages": TEXT, "truncate_prompt_tokens": 5}, 0),
        ({"messages": TEXT, "add_special_tokens": True}, 0),  # chat's default is false
        ({"messages": TEXT, "add_special_tokens": False}, None),
        ({"messages": IMAGE}, 0),
        ({"messages": TEXT, "session_params": {"id": "s1", "rid": "r0"}}, 0),
    ],
)
def test_chat_caps(body: dict[str, Any], limit: int | None) -> None:
    assert chat_reuse_limit(body, 100) == limit


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"text": "x"}, None),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 3}, 3),
        ({"text": "x", "return_logprob": True}, None),  # -1 by default: the output only
        # media: the engine's pad ids come from the media's hash, where the router cannot see
        ({"text": "<image> x", "image_data": "a.png"}, 0),
        ({"text": "x", "video_data": ["v.mp4"]}, 0),
        ({"text": ["x", "y"], "audio_data": [None, ["a.wav"]]}, 0),  # the second item's
        ({"text": "x", "image_data": None}, None),
        ({"text": ["x", "y"], "image_data": [None, []]}, None),  # no item holds one
        # SGLang puts the session's earlier prompt and output in front
        ({"text": "x", "session_params": {"id": "s1"}}, 0),
        ({"text": "x", "session_id": "s1"}, None),  # an identity only: the prompt as sent
        # SGLang matches no prefix for embedding overrides (nor caches the request)
        ({"text": "x", "positional_embed_overrides": {"positions": [0], "embeds": [[0.1]]}}, 0),
        ({"text": ["x", "y"], "positional_embed_overrides": [None, {"positions": [0]}]}, 0),
        ({"text": "x", "positional_embed_overrides": None}, None),
    ],
)
def test_generate_caps(body: dict[str, Any], limit: int | None) -> None:
    assert generate_reuse_limit(body) == limit


# The values pydantic's lax mode reads as a bool or an int: the engines' models take them so
# (vLLM's and SGLang's OpenAI routes; SGLang's `GenerateReqInput`, behind 0.5.23's strict
# contract check). Before, only JSON true and integers counted: each of these capping was a
# predicted hit the engine does not give.
@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"text": "x", "return_logprob": 1, "logprob_start_len": 3}, 3),
        ({"text": "x", "return_logprob": "true", "logprob_start_len": "5"}, 5),
        ({"text": "x", "return_logprob": "Yes", "logprob_start_len": 2.0}, 2),
        ({"text": "x", "return_logprob": [1.0], "logprob_start_len": [" 4 "]}, 4),
        ({"text": "x", "return_logprob": True, "logprob_start_len": "6.00"}, 6),
        ({"text": "x", "return_logprob": True, "logprob_start_len": True}, 1),
        ({"text": "x", "return_logprob": True, "logprob_start_len": "-1"}, None),
        # read neither way the router knows: the engine should refuse it, but nothing is
        # predicted meanwhile (fail closed)
        ({"text": "x", "return_logprob": True, "logprob_start_len": "soon"}, 0),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 1.5}, 0),
        ({"text": "x", "return_logprob": 2, "logprob_start_len": 3}, 3),
        ({"text": "x", "return_logprob": "maybe", "logprob_start_len": 3}, 3),
        # what pydantic reads as false
        ({"text": "x", "return_logprob": 0, "logprob_start_len": 3}, None),
        ({"text": "x", "return_logprob": "false", "logprob_start_len": 3}, None),
        ({"text": "x", "return_logprob": "OFF", "logprob_start_len": 3}, None),
        ({"text": "x", "return_logprob": None, "logprob_start_len": 3}, None),
    ],
)
def test_generate_reads_flags_and_lengths_as_the_engine_does(
    body: dict[str, Any], limit: int | None
) -> None:
    assert generate_reuse_limit(body) == limit


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"prompt": "x", "echo": 1, "logprobs": 1}, 0),
        ({"prompt": "x", "echo": "true", "logprobs": "0"}, 0),
        ({"prompt": "x", "echo": True, "logprobs": False}, 0),  # vLLM: false is 0
        ({"prompt": "x", "echo": "false", "logprobs": 1}, None),
        ({"prompt": "x", "echo": 0, "logprobs": 1}, None),
        ({"prompt": "x", "truncate_prompt_tokens": "10"}, 0),
        ({"prompt": "x", "truncate_prompt_tokens": 10.0}, 0),
        ({"prompt": "x", "truncate_prompt_tokens": "100"}, None),
        ({"prompt": "x", "truncate_prompt_tokens": "a few"}, 0),  # unreadable: fail closed
        ({"prompt": "x", "add_special_tokens": "false"}, 0),
        ({"prompt": "x", "add_special_tokens": 0}, 0),
        ({"prompt": "x", "add_special_tokens": "bogus"}, 0),
        ({"prompt": "x", "add_special_tokens": "true"}, None),
        ({"prompt": "x", "add_special_tokens": 1}, None),
    ],
)
def test_completion_reads_flags_and_lengths_as_the_engine_does(
    body: dict[str, Any], limit: int | None
) -> None:
    assert completion_reuse_limit(body, 100) == limit


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"messages": TEXT, "echo": 1}, 0),
        ({"messages": TEXT, "echo": "true"}, 0),
        ({"messages": TEXT, "echo": "y"}, 0),
        ({"messages": TEXT, "echo": "no"}, None),
        ({"messages": TEXT, "echo": 0.0}, None),
        ({"messages": TEXT, "add_special_tokens": "true"}, 0),
        ({"messages": TEXT, "add_special_tokens": "f"}, None),
        ({"messages": TEXT, "truncate_prompt_tokens": "5"}, 0),
    ],
)
def test_chat_reads_flags_and_lengths_as_the_engine_does(
    body: dict[str, Any], limit: int | None
) -> None:
    assert chat_reuse_limit(body, 100) == limit


# JSON values a client may send for a flag or a length, against pydantic itself (what the
# engines' request models are built on), where it is installed
_LAX_VALUES: list[object] = [
    True, False, 0, 1, 2, -1, 3, 0.0, 1.0, 1.5, 3.0, "", "1", "0", "3", " 3 ", "3.0", "+3",
    "-1", "1_0", "true", "True", "TRUE", "false", "yes", "no", "on", "off", "t", "f", "y",
    "n", " true", "maybe", "0x3", "3e0", [], {}, [True], ["3"],
]  # fmt: skip


def _read(adapter: Any, value: object) -> tuple[bool, object]:
    """(whether pydantic takes `value`, its reading: a list's first item)."""
    pydantic = pytest.importorskip("pydantic")
    try:
        read = pydantic.TypeAdapter(adapter).validate_python(value)
    except pydantic.ValidationError:
        return False, None
    return True, (read[0] if isinstance(read, list) and read else read)


@pytest.mark.parametrize("value", _LAX_VALUES)
def test_the_lax_readings_cap_whatever_pydantic_takes(value: object) -> None:
    """Where pydantic reads the value, the cap is the one its reading asks for; where it
    refuses it, the engine refuses the request and any cap will do. /generate's fields as
    SGLang's `GenerateReqInput` types them (a value or one per batch item), the OpenAI
    routes' as vLLM's and SGLang's models do (one value)."""
    taken, flag = _read(bool | list[bool] | None, value)
    if taken:
        capped = generate_reuse_limit({"return_logprob": value, "logprob_start_len": 3})
        assert capped == (3 if flag is True else None), flag
    taken, length = _read(int | list[int] | None, value)
    if taken:
        capped = generate_reuse_limit({"return_logprob": True, "logprob_start_len": value})
        assert capped == (length if isinstance(length, int) and length >= 0 else None), length
    taken, flag = _read(bool | None, value)
    if taken:
        assert chat_reuse_limit({"messages": TEXT, "echo": value}, 100) == (0 if flag else None)
        echoed = completion_reuse_limit({"prompt": "x", "echo": value, "logprobs": 0}, 100)
        assert echoed == (0 if flag else None), flag
        special = chat_reuse_limit({"messages": TEXT, "add_special_tokens": value}, 100)
        assert special == (0 if flag else None), flag
    taken, length = _read(int | None, value)
    if taken:
        cut = completion_reuse_limit({"prompt": "x", "truncate_prompt_tokens": value}, 100)
        assert cut == (0 if isinstance(length, int) and 0 <= length < 100 else None), length
