"""Hostile request bodies and headers against the real router: always a 4xx JSON error.

Deep nesting, header bytes that are not UTF-8, duplicated or oversized salts: each one was a 500
(or worse, accepted) before; each is now refused naming the problem, and never the value.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.config import LimitsConfig
from router.errors import RequestError
from router.prompt.request import parse_body
from router.service import RouterService
from tests.raw_http import exchange, json_error, parse_responses, request_bytes
from tests.router.conftest import TOKEN, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

SALT_HEADER = "x-tenant-salt"
PROXIED = (b"/generate", b"/v1/completions", b"/v1/chat/completions")


@pytest.fixture
async def router() -> AsyncIterator[RouterService]:
    """A router without workers: what it accepts is a 503, what it refuses a 4xx."""
    async with RouterService(router_config([], salt_header=SALT_HEADER)) as running:
        yield running


def _port(service: RouterService | ReferenceWorker) -> int:
    return int(service.url.rsplit(":", 1)[1])


async def _call(
    service: RouterService | ReferenceWorker,
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]] = [],  # noqa: B006 - never mutated
    body: bytes = b"",
) -> tuple[int, dict[str, Any]]:
    (response,) = parse_responses(
        await exchange(_port(service), request_bytes(method, target, headers, body))
    )
    return response.status, json_error(response) if response.status >= 400 else {}


def _nested(depth: int) -> bytes:
    """A valid body whose `extra` field nests `depth - 1` lists (the body object is level 1)."""
    return (
        b'{"prompt": "x", "text": "x", "messages": [{"role": "user", "content": "x"}], "extra": '
        + (b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")
    )


# --------------------------------------------------------------------------- nesting (item 4)


async def test_deeply_nested_json_is_a_400_naming_the_limit(router: RouterService) -> None:
    limit = LimitsConfig().max_json_depth
    for path in (*PROXIED, b"/admin/route"):
        auth = [(b"Authorization", b"Bearer " + TOKEN.encode())]
        # ~2 KB, 1,000 levels: the decoder's RecursionError used to escape as a 500
        for depth in (1000, limit + 1):
            status, error = await _call(router, b"POST", path, auth, _nested(depth))
            assert status == 400, (path, depth, error)
            assert error["type"] == "RequestError"
            assert "max_json_depth" in error["message"], error
        status, error = await _call(router, b"POST", path, auth, _nested(limit))
        # at the limit the body parses: the proxy then finds no worker, the dry run plans
        assert status in (200, 503), (path, error)


async def test_the_reference_worker_answers_deep_json_with_a_json_400() -> None:
    async with ReferenceWorker(ReferenceConfig(time_scale=0)) as worker:
        for path in (*PROXIED, b"/flush_cache", b"/debug/match"):
            status, error = await _call(worker, b"POST", path, body=_nested(1000))
            assert status == 400, (path, error)
            assert "nests" in error["message"]


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _random_json(rng: random.Random, budget: int) -> object:
    """Nested lists and objects whose strings are full of brackets, quotes and escapes."""
    roll = rng.random()
    if budget <= 0 or roll < 0.3:
        return rng.choice(['[{"', '\\"]', "}\\\\", "", 7, None, True, "{[", '"[', "\\u005b"])
    items = [_random_json(rng, budget - 1) for _ in range(rng.randrange(4))]
    if roll < 0.65:
        return items
    return {f"k{i}{rng.choice(['[', '{', '}', ''])}": item for i, item in enumerate(items)}


def test_the_nesting_check_agrees_with_the_decoded_depth() -> None:
    seed = random.randrange(2**32)
    print(f"nesting seed={seed}")
    rng = random.Random(seed)
    for _ in range(3000):
        body = {"a": _random_json(rng, rng.randrange(16))}
        raw = json.dumps(body, indent=rng.choice([None, 1])).encode()
        depth = _depth(body)
        limit = rng.randrange(8, 14)
        if depth > limit:
            with pytest.raises(RequestError, match="max_json_depth"):
                parse_body(raw, LimitsConfig(max_json_depth=limit))
        else:
            assert parse_body(raw, LimitsConfig(max_json_depth=limit)) == body


# ---------------------------------------------------------------- admin authorization (item 5)

ADMIN_ROUTES = (
    (b"GET", b"/admin/workers"),
    (b"POST", b"/admin/workers"),
    (b"POST", b"/admin/workers/w0/drain"),
    (b"DELETE", b"/admin/workers/w0"),
    (b"GET", b"/admin/namespaces"),
    (b"POST", b"/admin/namespaces/evict"),
    (b"GET", b"/admin/streams"),
    (b"POST", b"/admin/route"),
    (b"GET", b"/admin/index/dump"),
    (b"POST", b"/admin/index/load"),
)


async def test_a_non_utf8_authorization_header_is_a_401_on_every_admin_route(
    router: RouterService,
) -> None:
    for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer " + TOKEN.encode() + b"\x80"):
        for method, path in ADMIN_ROUTES:
            status, error = await _call(router, method, path, [(b"Authorization", value)], b"{}")
            assert status == 401, (method, path, value, error)
            assert error["type"] == "AuthError"


# ------------------------------------------------------------ the salt header (item 6, hardening)

BODY = b'{"prompt": "x", "text": "x", "messages": [{"role": "user", "content": "x"}]}'
SECRET = b"tenant-SECRET-4242"


async def test_a_non_utf8_salt_header_is_a_400_naming_the_header_not_the_value(
    router: RouterService,
) -> None:
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    for path in (*PROXIED, b"/admin/route"):
        for value in (SECRET + b"\xff", b"\xc3\x28" + SECRET, b"\xed\xa0\x80"):
            status, error = await _call(
                router, b"POST", path, [auth, (SALT_HEADER.encode(), value)], BODY
            )
            assert status == 400, (path, value, error)
            assert error["type"] == "RequestError"
            assert SALT_HEADER in error["message"] and "UTF-8" in error["message"]
            assert SECRET.decode() not in json.dumps(error)


async def test_a_duplicated_salt_header_is_refused_not_resolved_to_its_first_value(
    router: RouterService,
) -> None:
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    for path in (*PROXIED, b"/admin/route"):
        for names in ((b"x-tenant-salt", b"x-tenant-salt"), (b"X-Tenant-Salt", b"x-TENANT-salt")):
            headers = [auth, (names[0], b"tenant-a"), (names[1], SECRET)]
            status, error = await _call(router, b"POST", path, headers, BODY)
            assert status == 400, (path, error)
            assert SALT_HEADER in error["message"] and "2 times" in error["message"]
            assert SECRET.decode() not in json.dumps(error)
        # once is fine: the proxy then finds no worker, the dry run plans
        status, _ = await _call(router, b"POST", path, [auth, (b"x-tenant-salt", SECRET)], BODY)
        assert status in (200, 503)


# --------------------------------------------------------------------- salt length (item 8)


async def test_salts_over_max_salt_bytes_are_refused_everywhere_naming_the_limit(
    router: RouterService,
) -> None:
    limit = LimitsConfig().max_salt_bytes
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    at_limit, over = "s" * limit, "s" * (limit - 1) + "é"  # é is 2 bytes: one byte over
    for path in (*PROXIED, b"/admin/route"):
        for salt, ok in ((at_limit, True), (over, False)):
            body = json.loads(BODY) | {"cache_salt": salt}
            status, error = await _call(router, b"POST", path, [auth], json.dumps(body).encode())
            assert (status in (200, 503)) is ok, (path, len(salt), error)
            header = [auth, (SALT_HEADER.encode(), salt.encode())]
            status, error = await _call(router, b"POST", path, header, BODY)
            assert (status in (200, 503)) is ok, (path, len(salt), error)
            if not ok:
                assert "limits.max_salt_bytes" in error["message"] and salt not in error["message"]
        batched = {"text": ["a", "b"], "cache_salt": ["t", over]}
        status, error = await _call(router, b"POST", path, [auth], json.dumps(batched).encode())
        if path in (b"/generate", b"/admin/route"):
            assert status == 400 and "cache_salt[1]" in error["message"], error
    evict = json.dumps({"cache_salt": over}).encode()
    status, error = await _call(router, b"POST", b"/admin/namespaces/evict", [auth], evict)
    assert status == 400 and "limits.max_salt_bytes" in error["message"], error


# ------------------------------------------------------------------ adapter name length


async def test_adapter_names_over_the_configured_limit_are_refused_on_every_route() -> None:
    # the configured limit, not the default, on each route an adapter name enters by: the
    # proxy's, the dry run and the query API (each reads its config's limits per request)
    limits = LimitsConfig(max_adapter_name_bytes=8)
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    over = "adapter-9"
    async with RouterService(router_config([], limits=limits)) as router:
        for path in (*PROXIED, b"/admin/route", b"/v1/kv/query"):
            query = path == b"/v1/kv/query"
            base = {"text": "x"} if query else json.loads(BODY)
            lora = "lora" if query else "lora_path"
            named = [(lora, over), ("model", "m:" + over)]
            for field, value in named[:1] if path == b"/generate" else named:  # no model read
                body = json.dumps(base | {field: value}).encode()
                status, error = await _call(router, b"POST", path, [auth], body)
                said = f"{field} names a LoRA adapter longer than limits.max_adapter_name_bytes"
                assert (status, error.get("message")) == (400, said + " (8 bytes)"), (path, error)
                fits = json.dumps(base | {field: value[:8]}).encode()
                status, error = await _call(router, b"POST", path, [auth], fits)
                assert status != 400, (path, field, error)  # no worker: 503 (or a dry run's 200)


async def test_a_bad_later_item_of_a_keyed_batch_is_a_400_naming_field_and_index(
    router: RouterService,
) -> None:
    # was "[1] must be a list of integers" for all three, a text item's too
    for path, body, said in [
        (b"/generate", {"text": ["a", 5], "extra_key": "k"}, "text[1] must be a string"),
        (
            b"/v1/completions",
            {"prompt": ["a", "b", {}], "extra_key": ["k", "k", "k"]},
            "prompt[2] must be a string or a list of token ids",
        ),
        (
            b"/generate",
            {"input_ids": [[1], [2], "c"], "extra_key": "k"},
            "input_ids[2] must be a list of integers",
        ),
    ]:
        status, error = await _call(router, b"POST", path, body=json.dumps(body).encode())
        assert (status, error) == (400, {"type": "RequestError", "message": said}), path


async def test_a_completion_batch_with_a_salt_list_of_another_length_is_the_routers_400() -> None:
    """As a batched `/generate`'s is: SGLang (0.5.23) hands a completion's lists to
    `GenerateReqInput`, which refuses a list of another length than the batch. Before, the
    router routed it (with a prediction, by its first item) and the worker refused it (QA)."""
    prompts = ["the batch's first prompt, of a few tokens", "other"]
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0)) as worker,
        RouterService(router_config([("w0", worker.url)], salt_header=SALT_HEADER)) as router,
    ):
        for field, value in [
            ("cache_salt", ["A"]),
            ("cache_salt", ["A", "B", "C"]),
            ("extra_key", ["k"]),
        ]:
            body = {"prompt": prompts, field: value, "max_tokens": 1}
            request = request_bytes(b"POST", b"/v1/completions", [], json.dumps(body).encode())
            (response,) = parse_responses(await exchange(_port(router), request))
            said = (
                f"{field} has {len(value)} items for a batch of 2 prompts: give one per prompt, "
                "or one string for all"
            )
            assert (response.status, json_error(response)) == (
                400,
                {"type": "RequestError", "message": said},
            ), (field, value)
            assert "x-kvroute-worker" not in response.headers  # never routed
        # one per prompt, or a salt header in place of the body's list: routed and answered
        body = {"prompt": prompts, "cache_salt": ["A", "B"], "max_tokens": 1}
        for headers in ([], [(SALT_HEADER.encode(), b"tenant")]):
            salted = dict(body, cache_salt=["A"]) if headers else body
            raw = json.dumps(salted).encode()
            request = request_bytes(b"POST", b"/v1/completions", headers, raw)
            (response,) = parse_responses(await exchange(_port(router), request))
            assert response.status == 200, (headers, response)
            assert response.headers["x-kvroute-worker"] == "w0"


# ------------------------------------------------------- the dry run is as strict as the proxy

_VALUES: dict[str, list[Any]] = {
    "messages": [[{"role": "user", "content": "hi"}], [], "hi", [{"role": 5}], [[]], None],
    "prompt": ["x", ["x", "y"], [1, 2], [], [[1], [2]], 5, [None], None],
    "text": ["x", ["x"], [], [5], 5, None],
    "input_ids": [[1, 2], [[1], [2]], [], ["a"], [True], "1", None],
    "cache_salt": ["t", "", None, 5, ["t", "u"], [5], "s" * 300],
    "stream": [True, False, "yes", None],
    "model": ["m", 5, None],
    "lora_path": ["l", 5, None],
    "chat_template_kwargs": [{}, {"messages": []}, {"tokenize": True}, [], None],
    "tools": [[], [{"function": {"name": "f"}}], [5], {}, None],
    "tool_choice": ["auto", "bogus", {"function": {"name": "f"}}, None],
    "reasoning_effort": ["low", "extreme", 0.5, None],
}
_RAW_BODIES = [b"", b"{", b"[]", b"null", b'"x"', b"\xff", _nested(600), b"x" * 5000]
_SALT_HEADERS: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"x-tenant-salt", b"good")],
    [(b"x-tenant-salt", b"\xff")],
    [(b"x-tenant-salt", b"a"), (b"x-tenant-salt", b"b")],
    [(b"x-tenant-salt", b"s" * 300)],
]


async def test_the_dry_run_refuses_exactly_what_the_proxy_refuses() -> None:
    seed = random.randrange(2**32)
    print(f"dry-run seed={seed}")
    rng = random.Random(seed)
    config = router_config([], salt_header=SALT_HEADER, limits=LimitsConfig(max_body_bytes=4096))
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    async with RouterService(config) as router:
        refused = 0
        for i in range(150):
            if i % 5 == 0:
                raw = rng.choice(_RAW_BODIES)
            else:
                fields = rng.sample(sorted(_VALUES), rng.randrange(1, 5))
                body = {f: rng.choice(_VALUES[f]) for f in fields}
                raw = json.dumps(body).encode()
            headers = rng.choice(_SALT_HEADERS)
            path = rng.choice(PROXIED)
            proxy = await _call(router, b"POST", path, headers, raw)
            dry = await _call(
                router, b"POST", b"/admin/route?endpoint=" + path, [auth, *headers], raw
            )
            if proxy[0] == 503:  # accepted: no worker to send it to
                assert dry[0] == 200, (path, raw, headers, dry)
            else:
                refused += 1
                assert 400 <= proxy[0] < 500, (path, raw, headers, proxy)
                assert (dry[0], dry[1]["type"]) == (proxy[0], proxy[1]["type"]), (
                    path,
                    raw,
                    headers,
                )
        assert refused > 50  # the draw exercised refusals, not just acceptances


async def test_many_distinct_long_salts_are_refused_and_leave_nothing_behind(
    router: RouterService,
) -> None:
    import gc
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100):
            # the report: 400 such requests (each salt 256 KiB) kept 100 MiB in the memo
            salt = f"{i:06d}" + "s" * (256 * 1024)
            body = json.dumps({"prompt": "x", "cache_salt": salt}).encode()
            status, error = await _call(router, b"POST", b"/v1/completions", body=body)
            assert status == 400 and "limits.max_salt_bytes" in error["message"], error
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2 * 1024 * 1024, grown  # 25 MiB of salts were sent
