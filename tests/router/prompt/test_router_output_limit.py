"""The output limit a request names, as SGLang 0.5.23 reads it (`router.prompt.output_limit`)."""

from __future__ import annotations

import json

from router.config import TokenizerConfig
from router.prompt.output_limit import (
    CLIP_OUTPUT_TOKENS,
    chat_output_limit,
    completion_output_limit,
    generate_output_limit,
)
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import build_tokenizer

TOK = build_tokenizer(TokenizerConfig())


def test_generate_reads_sampling_params_with_sglangs_default_of_128() -> None:
    assert generate_output_limit({"text": "x"}) == 128
    assert generate_output_limit({"sampling_params": {}}) == 128
    assert generate_output_limit({"sampling_params": {"max_new_tokens": 7}}) == 7
    # a batch: its first item's parameters
    assert generate_output_limit({"sampling_params": [{"max_new_tokens": 3}, {}]}) == 3
    # None runs to the end of the context: nothing to size by
    assert generate_output_limit({"sampling_params": {"max_new_tokens": None}}) is None


def test_completions_default_to_16_and_chat_names_its_own_or_nothing() -> None:
    assert completion_output_limit({"prompt": "x"}) == 16
    assert completion_output_limit({"max_tokens": 40}) == 40
    assert chat_output_limit({"messages": []}) is None
    assert chat_output_limit({"max_tokens": 9}) == 9
    assert chat_output_limit({"max_completion_tokens": 5, "max_tokens": 9}) == 5
    # SGLang reads `max_completion_tokens or max_tokens`: a zero falls through
    assert chat_output_limit({"max_completion_tokens": 0, "max_tokens": 9}) == 9


def test_large_limits_are_clipped_as_the_engine_budgets_them_and_bad_ones_ignored() -> None:
    assert completion_output_limit({"max_tokens": 100_000}) == CLIP_OUTPUT_TOKENS
    for bad in ("12", -1, 2.5, True, [3]):
        assert completion_output_limit({"max_tokens": bad}) is None
        assert generate_output_limit({"sampling_params": {"max_new_tokens": bad}}) is None
    assert generate_output_limit({"sampling_params": "fast"}) is None


def test_a_parsed_request_carries_its_output_limit() -> None:
    def parse(endpoint: Endpoint, body: dict[str, object]) -> int | None:
        return parse_request(endpoint, json.dumps(body).encode(), TOK).output_tokens

    assert (
        parse(Endpoint.GENERATE, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}})
        == 4
    )
    assert parse(Endpoint.COMPLETIONS, {"prompt": "ab"}) == 16
    messages = [{"role": "user", "content": "hi"}]
    assert parse(Endpoint.CHAT, {"messages": messages}) is None
    assert parse(Endpoint.CHAT, {"messages": messages, "max_completion_tokens": 64}) == 64
