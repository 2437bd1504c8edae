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
