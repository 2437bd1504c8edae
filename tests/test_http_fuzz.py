"""Fuzzing the HTTP surface: arbitrary bytes as bodies, header values and paths on every route.

Both the router (every proxied endpoint, /health, /v1/models, /metrics, every /admin route, in
front of a real reference worker) and the reference worker itself must answer every request
below 500, and every 4xx as a JSON error `{"error": {"type", "message"}}`. Requests go over raw
sockets: an HTTP client would refuse most of these bytes. Hypothesis is seeded (the seed is
printed; rerun with KVROUTE_TEST_SEED=...) and bounded (KVROUTE_FUZZ_EXAMPLES, default 250 per
server), with no example database, so CI runs the same kind of draw every time in seconds.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterator

import hypothesis
import pytest
from hypothesis import strategies as st

from router.config import (
    AdminConfig,
    HealthConfig,
    LimitsConfig,
    ListenConfig,
    RouterConfig,
    WorkerConfig,
)
from router.service import RouterService
from tests.raw_http import exchange, json_error, parse_responses
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

SEED = int(os.environ.get("KVROUTE_TEST_SEED", random.randrange(2**32)))
EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "250"))
SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,  # two shared cores: timing says nothing here
    database=None,  # no .hypothesis directory in the checkout
    print_blob=True,
    suppress_health_check=[
        hypothesis.HealthCheck.function_scoped_fixture,  # one server for all examples, on purpose
        hypothesis.HealthCheck.too_slow,
    ],
)
TOKEN = b"fuzz-admin-token"
SALT_HEADER = b"x-tenant-salt"
WORKER_ID = "w-0c3f9a51"  # no fuzzed path can name it: DELETE /admin/workers/{id} stays a 404

ROUTER_ROUTES = [
    (b"POST", b"/generate"),
    (b"POST", b"/v1/completions"),
    (b"POST", b"/v1/chat/completions"),
    (b"GET", b"/health"),
    (b"GET", b"/v1/models"),
    (b"GET", b"/metrics"),
    (b"GET", b"/admin/workers"),
    (b"POST", b"/admin/workers"),
    (b"POST", b"/admin/workers/{id}/drain"),
    (b"DELETE", b"/admin/workers/{id}"),
    (b"GET", b"/admin/namespaces"),
    (b"POST", b"/admin/namespaces/evict"),
    (b"GET", b"/admin/streams"),
    (b"POST", b"/admin/route"),
    (b"GET", b"/admin/index/dump"),
    (b"POST", b"/admin/index/load"),
]
WORKER_ROUTES = [
    (b"POST", b"/generate"),
    (b"POST", b"/v1/completions"),
    (b"POST", b"/v1/chat/completions"),
    (b"POST", b"/flush_cache"),
    (b"GET", b"/flush_cache"),
    (b"POST", b"/debug/match"),
    (b"GET", b"/health"),
    (b"GET", b"/v1/models"),
    (b"GET", b"/get_model_info"),
    (b"GET", b"/server_info"),
    (b"GET", b"/get_server_info"),
]

# JSON the request parsers look into: the fields they read, with values good and bad; numbers
# stay small so a body that is valid asks a worker for a few tokens, not millions
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=12),
    st.sampled_from(["user", "assistant", "system", "tool", "auto", "none", "function", "low"]),
)
_json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "messages", "prompt", "text", "input_ids", "cache_salt", "extra_key", "stream", "model",
    "lora_path", "sampling_params", "max_tokens", "max_new_tokens", "max_completion_tokens",
    "chat_template_kwargs", "tools", "tool_choice", "reasoning_effort", "stream_options",
    "data_parallel_rank", "rid", "n", "namespace", "flush_workers", "drain", "role", "content",
]  # fmt: skip
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": _json_values}
    ),
    max_size=3,
)
# valid bodies, so that mutating one or two of their fields reaches past the first check
_VALID: list[dict[str, object]] = [
    {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    {"input_ids": [[1, 2], [3]], "cache_salt": ["a", "b"]},
    {"prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-a"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
    {"cache_salt": "tenant-a", "flush_workers": True},
    {"drain": False},
]
_fields = st.dictionaries(st.sampled_from(_FIELDS), _json_values | _messages, max_size=5)
_mutated = st.tuples(
    st.sampled_from(_VALID),
    st.dictionaries(st.sampled_from(_FIELDS), _json_values | _messages, max_size=2),
)
_structured = st.one_of(
    _fields, _mutated.map(lambda pair: pair[0] | pair[1]), st.sampled_from(_VALID)
).map(lambda body: json.dumps(body).encode())
_bodies = st.one_of(st.just(b""), st.binary(max_size=300), _structured)

# header values: arbitrary bytes (control characters, non-UTF-8, CR/LF) and plausible ones
_header_values = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20).map(str.encode),
    st.sampled_from([b"Bearer " + TOKEN, b"tenant-a", b"chunked", b"gzip", b"100-continue"]),
)
_header_names = st.sampled_from(
    [
        b"Authorization",
        SALT_HEADER,
        b"Content-Type",
        b"Accept",
        b"Expect",
        b"Content-Encoding",
        b"Transfer-Encoding",
        b"X-Data-Parallel-Rank",
        b"X-Anything",
    ]
)
# half of the draws keep the transport clean, so the bodies reach the handlers
_headers: st.SearchStrategy[list[tuple[bytes, bytes]]] = st.one_of(
    st.just([]), st.lists(st.tuples(_header_names, _header_values), max_size=4)
)


@st.composite
def _targets(draw: st.DrawFn, routes: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """A route's method and request target, with arbitrary bytes in its id, suffix or query."""
    method, path = draw(st.sampled_from(routes))
    if b"{id}" in path:
        path = path.replace(b"{id}", draw(st.binary(min_size=1, max_size=20)))
    shape = draw(st.sampled_from(["plain", "plain", "plain", "query", "suffix", "raw"]))
    fuzz = draw(st.binary(max_size=30))
    if shape == "query":
        path += b"?" + fuzz
    elif shape == "suffix":
        path += fuzz
    elif shape == "raw":
        path = fuzz
    return method, path


def _request(
    target: tuple[bytes, bytes], headers: list[tuple[bytes, bytes]], body: bytes, auth: bool
) -> bytes:
    method, path = target
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    if auth:
        lines.append(b"Authorization: Bearer " + TOKEN)
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def _check(port: int, raw: bytes) -> None:
    answer = await exchange(port, raw, timeout_s=15)
    responses = [r for r in parse_responses(answer) if r.status >= 200]
    assert responses, f"no answer to {raw[:200]!r}"
    for response in responses:
        assert response.status < 500, (response, raw[:300])
        if response.status >= 400:
            json_error(response)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    print(f"fuzz seed={SEED} (rerun with KVROUTE_TEST_SEED={SEED})")
    async with ReferenceWorker(ReferenceConfig(time_scale=0, page_size=4)) as running:
        yield running


@pytest.fixture
async def router(worker: ReferenceWorker) -> AsyncIterator[RouterService]:
    config = RouterConfig(
        listen=ListenConfig(port=0),
        admin=AdminConfig(token=TOKEN.decode()),
        salt_header=SALT_HEADER.decode(),
        # a request the fuzz leaves unfinished (a chunked body never sent) ends in a second
        limits=LimitsConfig(header_timeout_s=1.0, body_timeout_s=1.0),
        # the event loop stands still while hypothesis draws and shrinks, so a health check in
        # flight would time out and /health turn 503 for want of a worker: only the startup
        # check runs, since the worker's health is not what this test is about
        health=HealthConfig(interval_s=3600.0, timeout_s=30.0),
        workers=(WorkerConfig(url=worker.url, id=WORKER_ID),),
    )
    async with RouterService(config) as running:
        yield running


@hypothesis.seed(SEED)
@SETTINGS
@hypothesis.given(
    target=_targets(ROUTER_ROUTES), headers=_headers, body=_bodies, auth=st.booleans()
)
async def test_every_router_route_answers_arbitrary_bytes_below_500_in_json(
    router: RouterService,
    target: tuple[bytes, bytes],
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    auth: bool,
) -> None:
    await _check(_port(router.url), _request(target, headers, body, auth))


@hypothesis.seed(SEED)
@SETTINGS
@hypothesis.given(target=_targets(WORKER_ROUTES), headers=_headers, body=_bodies)
async def test_every_worker_route_answers_arbitrary_bytes_below_500_in_json(
    worker: ReferenceWorker,
    target: tuple[bytes, bytes],
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> None:
    await _check(_port(worker.url), _request(target, headers, body, auth=False))
