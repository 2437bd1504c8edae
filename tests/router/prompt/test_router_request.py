"""Request parsing: namespace fields validated like the workers do, tokens like the workers make."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from indexer.protocol.tokens import ByteTokenizer, render_chat
from router.config import LimitsConfig, TokenizerConfig
from router.errors import RequestError
from router.prompt.request import Endpoint, detect_endpoint, parse_body, parse_request
from router.prompt.tokenizer import build_tokenizer

TOK = build_tokenizer(TokenizerConfig())
BYTES = ByteTokenizer()


def _parse(endpoint: Endpoint, body: object, header: str | None = None):  # type: ignore[no-untyped-def]
    return parse_request(endpoint, json.dumps(body).encode(), TOK, header_salt=header)


def test_chat_prompts_tokenize_like_the_workers() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parsed = _parse(Endpoint.CHAT, {"messages": messages, "cache_salt": "t1", "stream": True})
    assert parsed.tokens == BYTES.encode(render_chat(messages), add_bos=True)
    assert parsed.salt == "t1" and parsed.stream


def test_completion_and_generate_text_have_no_bos() -> None:
    assert _parse(Endpoint.COMPLETIONS, {"prompt": "abc"}).tokens == BYTES.encode("abc")
    assert _parse(Endpoint.COMPLETIONS, {"prompt": ["abc", "d"]}).tokens == BYTES.encode("abc")
    assert _parse(Endpoint.COMPLETIONS, {"prompt": [5, 6]}).tokens == [5, 6]
    assert _parse(Endpoint.GENERATE, {"text": "abc"}).tokens == BYTES.encode("abc")
    assert _parse(Endpoint.GENERATE, {"input_ids": [7, 8, 9]}).tokens == [7, 8, 9]
    assert _parse(Endpoint.GENERATE, {"input_ids": [[7, 8], [9]]}).tokens == [7, 8]


def test_vllm_prompt_embeds_stand_in_for_the_prompt_and_predict_nothing() -> None:
    # vLLM 0.33 serves `prompt_embeds` without a `prompt` (`--enable-prompt-embeds`)
    for body in (
        {"prompt_embeds": "AAAAAA=="},
        {"prompt_embeds": ["AAAAAA==", "AAAAAA=="], "prompt": ""},
    ):
        parsed = _parse(Endpoint.COMPLETIONS, body)
        assert parsed.tokens == [] and parsed.reuse_limit == 0
    with_text = _parse(Endpoint.COMPLETIONS, {"prompt": "abc", "prompt_embeds": "AAAAAA=="})
    assert with_text.reuse_limit == 0
    with pytest.raises(RequestError, match="prompt must be"):
        _parse(Endpoint.COMPLETIONS, {"prompt_embeds": []})  # neither, as vLLM refuses


def test_body_is_forwarded_untouched_without_a_trusted_header() -> None:
    raw = b'{"prompt": "x",   "cache_salt": "s"}'
    assert parse_request(Endpoint.COMPLETIONS, raw, TOK).body is raw


def test_trusted_header_overrides_and_rewrites_the_salt() -> None:
    parsed = _parse(Endpoint.COMPLETIONS, {"prompt": "x", "cache_salt": "body"}, header="hdr")
    assert parsed.salt == "hdr"
    assert json.loads(parsed.body)["cache_salt"] == "hdr"
    cleared = _parse(Endpoint.COMPLETIONS, {"prompt": "x", "cache_salt": "body"}, header="")
    assert cleared.salt is None and "cache_salt" not in json.loads(cleared.body)
    # the body's own is replaced whatever it is: not the client's to get right (was a 400,
    # "cache_salt must be a string"), also a batch's list of another length
    for body_salt in (5, ["a"], {"x": 1}):
        parsed = _parse(
            Endpoint.COMPLETIONS, {"prompt": "x", "cache_salt": body_salt}, header="hdr"
        )
        assert parsed.salt == "hdr" and json.loads(parsed.body)["cache_salt"] == "hdr"
    batch = {"input_ids": [[1, 2], [3, 4]], "cache_salt": ["a"]}
    assert _parse(Endpoint.GENERATE, batch, header="hdr").salt == "hdr"
    with pytest.raises(RequestError, match="cache_salt has 1 items for a batch of 2"):
        _parse(Endpoint.GENERATE, batch)
    # a completion's list of prompts alike (was routed for the worker to refuse)
    listed = {"prompt": ["a", "b"], "cache_salt": ["a", "b", "c"]}
    assert _parse(Endpoint.COMPLETIONS, listed, header="hdr").salt == "hdr"
    with pytest.raises(RequestError, match="cache_salt has 3 items for a batch of 2"):
        _parse(Endpoint.COMPLETIONS, listed)


def test_empty_salt_means_none_and_batches_carry_one_per_item() -> None:
    assert _parse(Endpoint.GENERATE, {"text": "x", "cache_salt": ""}).salt is None
    batched = _parse(Endpoint.GENERATE, {"text": ["a", "b"], "cache_salt": ["s1", "s2"]})
    assert batched.salt == "s1"
    # a completion's list of prompts is a batch as well (SGLang's CompletionRequest), a list
    # of one too
    prompts: list[list[object]] = [["a", "b"], [[1, 2], [3, 4]], ["a"], [[1, 2]]]
    for prompt in prompts:
        listed = _parse(
            Endpoint.COMPLETIONS,
            {
                "prompt": prompt,
                "cache_salt": ["s1", "s2"][: len(prompt)],
                "extra_key": ["k1", "k2"][: len(prompt)],
            },
        )
        assert (listed.salt, listed.extra_key) == ("s1", "k1")
    # one prompt takes one salt; a chat request is one conversation
    singles: list[tuple[Endpoint, dict[str, object]]] = [
        (Endpoint.COMPLETIONS, {"prompt": "a", "cache_salt": ["s1"]}),
        (Endpoint.COMPLETIONS, {"prompt": [1, 2], "cache_salt": ["s1"]}),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": "a"}], "cache_salt": ["s1"]}),
    ]
    for endpoint, body in singles:
        with pytest.raises(RequestError, match="cache_salt must be a string"):
            _parse(endpoint, body)


def test_a_null_or_absent_model_names_none() -> None:
    for body in ({"prompt": "x"}, {"prompt": "x", "model": None}, {"prompt": "x", "model": ""}):
        assert _parse(Endpoint.COMPLETIONS, body).model == ""
    assert _parse(Endpoint.COMPLETIONS, {"prompt": "x", "model": "m"}).model == "m"


def test_lora_path_is_a_string_or_one_per_batch_item() -> None:
    hi = [{"role": "user", "content": "hi"}]
    assert _parse(Endpoint.CHAT, {"messages": hi, "lora_path": "a"}).lora == "a"
    assert _parse(Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": ""}).lora is None
    batched = _parse(Endpoint.GENERATE, {"text": ["a", "b"], "lora_path": ["l1", None]})
    assert batched.lora == "l1"
    assert _parse(Endpoint.GENERATE, {"text": ["a"], "lora_path": [None]}).lora is None


def test_lora_path_is_bounded_by_max_adapter_name_bytes_every_item() -> None:
    # the QA report: a 2 MB lora_path became a namespace (a reference worker caches any name)
    limit = LimitsConfig().max_adapter_name_bytes
    assert limit == 4096  # Linux's PATH_MAX: an adapter named by its path is at most that
    at_limit, over = "L" * limit, "L" * (limit - 1) + "é"  # é is 2 bytes: one byte over
    assert _parse(Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": at_limit}).lora == at_limit
    too_long = "names a LoRA adapter longer than limits.max_adapter_name_bytes (4096 bytes)"
    for endpoint, body, field in [
        (Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": over}, "lora_path"),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": "x"}], "lora_path": over},
            "lora_path",
        ),
        (Endpoint.GENERATE, {"text": ["a", "b"], "lora_path": [at_limit, over]}, "lora_path[1]"),
        (Endpoint.GENERATE, {"input_ids": [[1], [2]], "lora_path": [over, None]}, "lora_path[0]"),
        (Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": "L" * 2_000_000}, "lora_path"),
    ]:
        with pytest.raises(RequestError) as info:
            _parse(endpoint, body)
        assert str(info.value) == f"{field} {too_long}" and info.value.status == 400
    small = LimitsConfig(max_adapter_name_bytes=2)
    raw = json.dumps({"prompt": "x", "lora_path": "abc"}).encode()
    with pytest.raises(RequestError, match=r"lora_path names .* \(2 bytes\)"):
        parse_request(Endpoint.COMPLETIONS, raw, TOK, limits=small)


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        (Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": 5}, "lora_path"),
        (Endpoint.GENERATE, {"text": ["a", "b"], "lora_path": ["l", 5]}, "lora_path[1]"),
        # the index's name for an adapter known by id alone (`anonymous_lora`): never a client's
        (Endpoint.COMPLETIONS, {"prompt": "x", "lora_path": "\x00lora_id:7"}, "lora_path"),
        (Endpoint.GENERATE, {"text": ["a", "b"], "lora_path": [None, "\x00x"]}, "lora_path[1]"),
        (Endpoint.COMPLETIONS, {"prompt": "x", "cache_salt": 5}, "cache_salt"),
        (Endpoint.COMPLETIONS, {"prompt": "x", "cache_salt": ["a"]}, "cache_salt"),
        (Endpoint.GENERATE, {"text": ["a"], "cache_salt": [1]}, "cache_salt[0]"),
        (Endpoint.GENERATE, {"input_ids": [1, "2"]}, "input_ids"),
        (Endpoint.GENERATE, {"input_ids": [1, 2, True]}, "got `bool` - at `$[2]`"),
        (Endpoint.GENERATE, {"input_ids": [[1.5]]}, "input_ids[0] must be a list of integers"),
        (Endpoint.COMPLETIONS, {"prompt": [7, None]}, "got `null` - at `$[1]`"),
        (Endpoint.GENERATE, {}, "text"),
        (Endpoint.COMPLETIONS, {"prompt": 3}, "prompt"),
        (Endpoint.COMPLETIONS, {"prompt": []}, "prompt"),
        (Endpoint.CHAT, {"messages": "hi"}, "messages"),
        (Endpoint.CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
        # read as no model before: a 404 "names no model" in a fleet of several models
        (Endpoint.COMPLETIONS, {"prompt": "x", "model": 123}, "model must be a string, not a n"),
        (Endpoint.CHAT, {"messages": "hi", "model": ["m"]}, "model must be a string, not an array"),
        (Endpoint.GENERATE, {"text": "x", "model": {"m": 1}}, "model must be a string, not an o"),
        (Endpoint.GENERATE, {"text": "x", "model": True}, "model must be a string, not a boolean"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(endpoint: Endpoint, body: object, field: str) -> None:
    with pytest.raises(RequestError) as info:
        _parse(endpoint, body)
    assert field in str(info.value)
    assert info.value.status == 400


_MUST_BE_IDS = "must be a list of integers"
_STRING_OR_IDS = "must be a string or a list of token ids"


@pytest.mark.parametrize(
    ("endpoint", "body", "said"),
    [
        (Endpoint.GENERATE, {"text": ["a", 5]}, "text[1] must be a string"),
        (Endpoint.GENERATE, {"text": ["a", ["b"]]}, "text[1] must be a string"),
        (Endpoint.GENERATE, {"input_ids": [[1], "b"]}, f"input_ids[1] {_MUST_BE_IDS}"),
        (Endpoint.GENERATE, {"input_ids": [[1], [True]]}, f"input_ids[1] {_MUST_BE_IDS} ("),
        (Endpoint.COMPLETIONS, {"prompt": ["a", 5]}, f"prompt[1] {_STRING_OR_IDS}"),
        (Endpoint.COMPLETIONS, {"prompt": [[1], {}]}, f"prompt[1] {_STRING_OR_IDS}"),
        (Endpoint.COMPLETIONS, {"prompt": [[1], ["x"]]}, f"prompt[1] {_MUST_BE_IDS} ("),
    ],
)
def test_a_bad_later_item_of_a_keyed_batch_names_its_field_and_index(
    endpoint: Endpoint, body: dict[str, object], said: str
) -> None:
    # the items after the first that carry an extra_key are tokenized (each shadows its own
    # prompt): a bad one said "[1] must be a list of integers", naming no field, for text too
    for extra_key in ("k", ["k", "k"], None):
        # without one too: every item is held to what the first is (a text item is not read)
        if extra_key is None and "text" in body:
            _parse(endpoint, body)
            continue
        with pytest.raises(RequestError) as info:
            _parse(endpoint, {**body, "extra_key": extra_key})
        assert str(info.value).startswith(said), str(info.value)


def test_the_later_items_of_a_keyed_batch_are_read_as_their_kind() -> None:
    keyed = _parse(Endpoint.COMPLETIONS, {"prompt": ["a", [5, 6], "bc"], "extra_key": "k"})
    assert [item.tokens for item in keyed.keyed] == [[5, 6], BYTES.encode("bc")]
    keyed = _parse(Endpoint.GENERATE, {"text": ["a", "bc"], "extra_key": [None, "k"]})
    assert [item.tokens for item in keyed.keyed] == [BYTES.encode("bc")]
    keyed = _parse(Endpoint.GENERATE, {"input_ids": [[1], [2, 3]], "extra_key": "k"})
    assert [item.tokens for item in keyed.keyed] == [[2, 3]]


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"", "request body is empty"),
        (b" \r\n", "request body is empty"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b'"s"', "must be a JSON object"),
        (b"\xff\xfe", "not valid JSON"),
        # a whole body with a lone surrogate escape: msgspec calls it truncated
        (b'{"cache_salt": "x\\ud800"}', "not valid JSON: a \\\\u escape is a lone UTF-16"),
        (b'{"cache_salt": "x\\udfff"}', "invalid utf-16 surrogate pair"),
        (b'{"cache_salt": "x\\ud800', "Input data was truncated"),  # cut: still said so
    ],
)
def test_non_object_bodies_are_rejected(raw: bytes, said: str) -> None:
    with pytest.raises(RequestError, match=said):
        parse_body(raw)


def test_dry_run_endpoint_detection() -> None:
    assert detect_endpoint({"messages": []}) is Endpoint.CHAT
    assert detect_endpoint({"prompt": "x"}) is Endpoint.COMPLETIONS
    assert detect_endpoint({"input_ids": [1]}) is Endpoint.GENERATE
    with pytest.raises(RequestError):
        detect_endpoint({"foo": 1})


@pytest.mark.parametrize(
    ("endpoint", "field", "body"),
    [
        (Endpoint.GENERATE, "input_ids", lambda ids: {"input_ids": ids}),
        (Endpoint.GENERATE, "input_ids[0]", lambda ids: {"input_ids": [ids, [1]]}),
        (Endpoint.GENERATE, "input_ids[1]", lambda ids: {"input_ids": [[1], ids]}),
        (Endpoint.COMPLETIONS, "prompt", lambda ids: {"prompt": ids}),
        (Endpoint.COMPLETIONS, "prompt[0]", lambda ids: {"prompt": [ids]}),
        (Endpoint.COMPLETIONS, "prompt[2]", lambda ids: {"prompt": ["a", [1], ids]}),
    ],
)
def test_token_ids_out_of_any_vocabulary_are_refused_as_the_query_api_refuses_them(
    endpoint: Endpoint, field: str, body: Callable[[list[int]], object]
) -> None:
    """No engine's vocabulary has a negative id or one past 32 bits: the proxy passed them on
    (the worker's to refuse, or to fail on) where `/v1/kv/query` refused them, and read a
    batch's first item only (QA: a later item's 2**32 reached the worker, which answered 200)."""
    edges = [0, 5, (1 << 32) - 1]
    assert _parse(endpoint, body(edges)).tokens in (edges, [1], BYTES.encode("a"))
    for bad in (-1, 1 << 32):
        with pytest.raises(RequestError) as info:
            _parse(endpoint, body([5, bad]))
        said = str(info.value)
        assert said.startswith(f"{field} must be a list of integers"), said
        assert "`$[1]`" in said, said
