"""The rank a request names (as SGLang reads it) and the splice that tells the engine a rank."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import msgspec
import pytest

from router.config import TokenizerConfig
from router.errors import RequestError
from router.prompt.dp_rank import requested_rank, with_body_field
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer

TOK = build_tokenizer(TokenizerConfig())


def test_the_new_spelling_wins_and_the_header_overrides_the_body() -> None:
    assert requested_rank({}, None) is None
    assert requested_rank({"routed_dp_rank": 1}, None) == 1
    assert requested_rank({"data_parallel_rank": 1}, None) == 1
    assert requested_rank({"routed_dp_rank": 0, "data_parallel_rank": 1}, None) == 0
    assert requested_rank({"routed_dp_rank": None, "data_parallel_rank": 1}, None) == 1
    assert requested_rank({"routed_dp_rank": 1}, "0") == 0
    assert requested_rank({}, " 3 ") == 3  # int() of the value, as SGLang reads it


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        ({"routed_dp_rank": "1"}, None, "routed_dp_rank must be an integer"),
        ({"routed_dp_rank": True}, None, "routed_dp_rank must be an integer"),
        ({"data_parallel_rank": 1.0}, None, "data_parallel_rank must be an integer"),
        # typed fields both: a bad alias is an error even where the new spelling wins
        ({"routed_dp_rank": 0, "data_parallel_rank": "x"}, None, "data_parallel_rank"),
        ({"routed_dp_rank": -1}, None, "must not be negative"),
        ({}, "one", "invalid X-Data-Parallel-Rank header"),
        ({}, "-2", "must not be negative"),
        ({"routed_dp_rank": 1}, "", "invalid X-Data-Parallel-Rank header"),
    ],
)
def test_bad_ranks_are_request_errors(
    body: dict[str, Any], header: str | None, message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        requested_rank(body, header)


def test_generate_reads_the_body_only_and_openai_routes_the_header_too() -> None:
    gen = json.dumps({"text": "hi", "routed_dp_rank": 1}).encode()
    assert parse_request(Endpoint.GENERATE, gen, TOK, header_dp_rank="0").dp_rank == 1
    plain = json.dumps({"text": "hi"}).encode()
    assert parse_request(Endpoint.GENERATE, plain, TOK, header_dp_rank="x").dp_rank is None
    comp = json.dumps({"prompt": "hi", "data_parallel_rank": 1}).encode()
    assert parse_request(Endpoint.COMPLETIONS, comp, TOK).dp_rank == 1
    assert parse_request(Endpoint.COMPLETIONS, comp, TOK, header_dp_rank="0").dp_rank == 0
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert parse_request(Endpoint.CHAT, chat, TOK, header_dp_rank="2").dp_rank == 2


SPLICED = [
    b'{"text": "hi"}',
    b'{"text":"hi"}\n',
    b'  {\n  "text": "caf\\u00e9",\n  "sampling_params": {"temperature": 1.0e0}\n}\r\n ',
    b'{"input_ids": [1, 2, 3], "nested": {"a": {}}, "list": [[]]}',
    b'{"routed_dp_rank": null, "text": "\\"}"}',  # a null rank is no rank: the splice wins
    b"{}",
    b"{ \t }",
]


@pytest.mark.parametrize("raw", SPLICED)
def test_the_splice_adds_one_member_and_moves_no_other_byte(raw: bytes) -> None:
    out = with_body_field(raw, "routed_dp_rank", 7)
    close = raw.rstrip().rindex(b"}")
    assert out[:close] == raw[:close]  # everything before the closing brace kept as sent
    assert out.endswith(raw[close:])  # the closing brace and what follows it too
    decoded = json.loads(out)  # Python's json (FastAPI's): the last duplicate key wins
    assert decoded == {**json.loads(raw), "routed_dp_rank": 7}
    assert msgspec.json.decode(out)["routed_dp_rank"] == 7


def test_the_splice_on_random_objects() -> None:
    seed = int(os.environ.get("KVROUTE_SEED", random.randrange(1 << 30)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    space = [b"", b" ", b"\n", b"\t", b"\r\n  "]
    for _ in range(300):
        members = [
            f'"k{i}"'.encode()
            + rng.choice(space)
            + b":"
            + rng.choice(space)
            + rng.choice([b"1", b"-2.5e3", b'"x\\"}"', b"[]", b'{"a": [1, {}]}', b"null", b"true"])
            for i in range(rng.randrange(4))
        ]
        raw = (
            rng.choice(space)
            + b"{"
            + rng.choice(space)
            + (b"," + rng.choice(space)).join(members)
            + rng.choice(space)
            + b"}"
            + rng.choice(space)
        )
        out = with_body_field(raw, "routed_dp_rank", 3)
        assert json.loads(out) == {**json.loads(raw), "routed_dp_rank": 3}, (seed, raw)
        assert out.replace(b',"routed_dp_rank":3', b"").replace(b'"routed_dp_rank":3', b"") == raw


def test_the_splice_refuses_what_is_not_an_object() -> None:
    for raw in (b"[1]", b"", b"  "):
        with pytest.raises(ValueError):
            with_body_field(raw, "routed_dp_rank", 1)
