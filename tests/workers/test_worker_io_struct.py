"""Request normalization: the seed's cache_salt/extra_key rules and the body checks."""

from __future__ import annotations

import pytest

from indexer.protocol import ByteTokenizer, render_chat
from workers.cache import Namespace
from workers.errors import RequestError
from workers.io_struct import (
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_GENERATE_TOKENS,
    normalize_key,
    normalize_keys,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_model_parameter,
)


def test_salt_normalization() -> None:
    assert normalize_key(None, "cache_salt") is None
    assert normalize_key("", "cache_salt") is None
    assert normalize_key("t", "cache_salt") == "t"
    for bad in (1, 1.5, True, ["t"], {"t": 1}):
        with pytest.raises(RequestError, match="cache_salt"):
            normalize_key(bad, "cache_salt")


def test_batch_takes_one_value_per_item_or_one_for_all() -> None:
    assert normalize_keys("t", "cache_salt", 3) == ["t", "t", "t"]
    assert normalize_keys(["a", "", None], "cache_salt", 3) == ["a", None, None]
    with pytest.raises(RequestError, match="cache_salt has 2 values"):
        normalize_keys(["a", "b"], "cache_salt", 3)
    with pytest.raises(RequestError, match=r"extra_key\[1\]"):
        normalize_keys(["a", 2], "extra_key", 2)


def test_generate_single_and_batch() -> None:
    one = parse_generate({"text": "hi", "cache_salt": "s", "extra_key": ""})
    assert not one.batch
    (item,) = one.items
    assert item.input_ids == ByteTokenizer().encode("hi")
    assert item.namespace == Namespace(extra_key=None, cache_salt="s")
    assert item.max_new_tokens == DEFAULT_GENERATE_TOKENS
    batch = parse_generate(
        {
            "input_ids": [[5, 6], [7]],
            "cache_salt": ["a", "b"],
            "extra_key": "k",
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 0}],
        }
    )
    assert batch.batch
    assert [i.namespace for i in batch.items] == [Namespace("k", "a"), Namespace("k", "b")]
    assert [i.max_new_tokens for i in batch.items] == [1, 0]


def test_single_request_rejects_a_list_salt() -> None:
    with pytest.raises(RequestError, match="cache_salt"):
        parse_generate({"text": "hi", "cache_salt": ["a"]})


def test_openai_bodies() -> None:
    messages = [{"role": "user", "content": "hello"}]
    chat = parse_chat({"messages": messages, "cache_salt": "s", "max_completion_tokens": 3})
    (item,) = chat.items
    assert item.input_ids == ByteTokenizer().encode(render_chat(messages), add_bos=True)
    assert item.input_ids[0] == 1  # BOS, as the router renders it
    assert item.max_new_tokens == 3
    done = parse_completion(
        {"prompt": ["text"], "stream": True, "stream_options": {"include_usage": True}}
    )
    assert done.stream and done.include_usage
    assert done.items[0].max_new_tokens == DEFAULT_COMPLETION_TOKENS
    with pytest.raises(RequestError, match="n must be 1"):
        parse_completion({"prompt": "x", "n": 2})
    with pytest.raises(RequestError, match="messages"):
        parse_chat({"messages": "hello"})


@pytest.mark.parametrize(
    ("model", "served", "version", "expected"),
    [
        # SGLang 0.5.23 keeps its served name whole, colons and all, and splits after it
        ("org/m:v1", "org/m:v1", "0.5.23", ("org/m:v1", None)),
        ("org/m:v1:L1", "org/m:v1", "0.5.23-kvroute", ("org/m:v1", "L1")),
        ("s3://bk/m", "s3://bk/m", "0.5.23", ("s3://bk/m", None)),
        ("s3://bk/m: L1 ", "s3://bk/m", "0.5.23", ("s3://bk/m", "L1")),
        ("other:L1", "s3://bk/m", "0.5.23", ("other", "L1")),  # no served name: first colon
        ("m", "m", "0.5.23", ("m", None)),
        # 0.5.17-0.5.22 split at the first ":" whatever they serve
        ("org/m:v1", "org/m:v1", "0.5.22", ("org/m", "v1")),
        ("s3://bk/m:L1", "s3://bk/m", "0.5.17", ("s3", "//bk/m:L1")),
        ("s3://bk/m:", "s3://bk/m", "0.5.20.post1", ("s3", "//bk/m:")),
    ],
)
def test_the_model_names_an_adapter_as_the_sglang_version_reads_it(
    model: str, served: str, version: str, expected: tuple[str, str | None]
) -> None:
    assert parse_model_parameter(model, served, version) == expected


def test_a_served_name_with_a_colon_is_the_base_model_on_the_openai_routes() -> None:
    # the reference worker split at the first ":": a request naming its served model `org/m:v1`
    # was cached as adapter `v1`'s, where the router (and SGLang 0.5.23) predict the base's
    body = {"model": "org/m:v1", "prompt": "hello", "lora_path": "L1"}
    (item,) = parse_completion(body, served="org/m:v1").items
    assert item.namespace == Namespace(lora="L1")
    messages = [{"role": "user", "content": "hello"}]
    chat = {"model": "s3://bk/m:L2", "messages": messages}
    (item,) = parse_chat(chat, served="s3://bk/m").items
    assert item.namespace == Namespace(lora="L2")
    (item,) = parse_chat(chat, served="s3://bk/m", version="0.5.21").items
    assert item.namespace == Namespace(lora="//bk/m:L2")


def test_a_completion_echo_with_logprobs_reuses_nothing_and_lax_values_are_refused() -> None:
    """SGLang scores the whole prompt of an echo with logprobs. The worker read both fields by
    Python's truthiness: `"echo": "no"` (false to SGLang's lax pydantic) capped the reuse
    here, so a router predicting the hit SGLang gives counted as a false hit against it. Now
    it reads JSON booleans and integers only, and refuses the rest, as its /generate does."""
    prompt = {"prompt": "hello there", "max_tokens": 1}
    assert parse_completion({**prompt, "echo": True, "logprobs": 1}).items[0].reuse_limit == 0
    for kept in ({"echo": True, "logprobs": 0}, {"echo": False, "logprobs": 2}, {}):
        assert parse_completion({**prompt, **kept}).items[0].reuse_limit is None, kept
    for lax in ({"echo": "no", "logprobs": 1}, {"echo": 1, "logprobs": 1}):
        with pytest.raises(RequestError, match="echo must be a boolean"):
            parse_completion({**prompt, **lax})
    for lax_count in ("0", 1.0, True):
        with pytest.raises(RequestError, match="logprobs must be an integer"):
            parse_completion({**prompt, "echo": True, "logprobs": lax_count})
