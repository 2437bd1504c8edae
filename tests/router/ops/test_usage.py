"""Reading the worker's own cached_tokens from its answers, whole bodies and stream tails."""

from __future__ import annotations

import json

import hypothesis
from hypothesis import strategies as st

from router.http.usage import StreamTail, cached_tokens


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def test_openai_and_generate_bodies() -> None:
    openai = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 48}}}
    assert cached_tokens(json.dumps(openai).encode()) == 48
    generate = {"text": "x", "meta_info": {"prompt_tokens": 9, "cached_tokens": 16}}
    assert cached_tokens(json.dumps(generate).encode()) == 16
    assert cached_tokens(b'{"usage": {"prompt_tokens": 3}}') is None


def test_a_key_quoted_inside_generated_text_is_not_the_usage() -> None:
    text = 'the model wrote "cached_tokens": 999 here'
    body = {"choices": [{"text": text}], "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
    assert cached_tokens(json.dumps(body).encode()) == 0
    only_text = {"choices": [{"text": text}]}
    assert cached_tokens(json.dumps(only_text).encode()) is None


def test_null_falls_back_to_an_earlier_count_and_batches_have_none() -> None:
    assert cached_tokens(b'{"a": {"cached_tokens": 5}, "b": {"cached_tokens": null}}') == 5
    batch = [{"meta_info": {"cached_tokens": 1}}, {"meta_info": {"cached_tokens": 2}}]
    assert cached_tokens(json.dumps(batch).encode()) is None


def test_stream_tail_reads_the_final_usage_chunk_even_split_over_reads() -> None:
    events = [{"choices": [{"delta": {"content": "hi" * 50}}]} for _ in range(200)]
    stream = _sse(
        *events, {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}}
    )
    for size in (1, 7, 64, len(stream)):
        tail = StreamTail()
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        for chunk in chunks:
            tail.feed(chunk)
        assert tail.cached_tokens() == 64
    assert StreamTail().cached_tokens() is None


def test_stream_of_generate_events_ends_with_the_last_count() -> None:
    stream = _sse(*({"text": "a" * i, "meta_info": {"cached_tokens": 32}} for i in range(5)))
    tail = StreamTail()
    tail.feed(stream)
    assert tail.cached_tokens() == 32


def _last_count(node: object) -> int | None:
    """The reference: the last `cached_tokens` key in document order whose value is a count
    (an int of at most 12 digits; not a bool, a float, null or anything else)."""
    found: int | None = None
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "cached_tokens" and type(value) is int and 0 <= value < 10**12:
                found = value
            inner = _last_count(value)  # written after its key
            if inner is not None:
                found = inner
    elif isinstance(node, list):
        for item in node:
            inner = _last_count(item)
            if inner is not None:
                found = inner
    return found


_TRICKY_TEXT = st.sampled_from(
    ['"cached_tokens": 7', "cached_tokens", '{"cached_tokens": 8}', "\\", "é ✓", ""]
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**14), 10**14),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    _TRICKY_TEXT,
)
_KEYS = st.sampled_from(["cached_tokens", "prompt_tokens", "usage", "meta_info", "text", "x"])
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=5)),
    max_leaves=15,
)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(document=st.dictionaries(_KEYS, _DOCUMENTS, max_size=6), spaced=st.booleans())
def test_the_count_read_in_place_is_the_one_a_json_decoder_finds(
    document: dict[str, object], spaced: bool
) -> None:
    # read without decoding, the answer must say what decoding it says: the last count, and
    # none where the last keys hold a float, a negative, a huge number or no number at all
    body = json.dumps(document, separators=(", ", ": ") if spaced else (",", ":")).encode()
    assert cached_tokens(body) == _last_count(document), body
