"""POST /v1/kv/query for other gateways, in the router and in `kvroute indexer` (no proxy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.commands.cli import build_parser
from router.config import QueryConfig, TokenizerConfig, load_config
from router.http.app import create_app
from router.http.keys import RELOADER
from router.http.reload import ConfigSource
from router.prompt.tokenizer import build_tokenizer
from router.service import RouterService
from tests.router.chat_routing import FIXTURES as CHAT_FIXTURES
from tests.router.conftest import AUTH, Fleet, eventually, one_worker_fleet, router_config
from tests.router.test_router_pd import PAGE, PROMPT, reference, warm
from tests.router.vllm_stub import vllm_payload, vllm_stub
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

QUERY_TOKEN = "gateway-token"
QAUTH = {"Authorization": f"Bearer {QUERY_TOKEN}"}
_A = TypeVar("_A")
TEXT = "An endpoint picker asks kvroute which worker holds this prompt already. " * 5


@pytest.fixture
async def query_fleet() -> AsyncIterator[Fleet]:
    """Two reference workers and a kv router whose query API has its own token."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config(
            [("w0", w0.url), ("w1", w1.url)], query=QueryConfig(token=QUERY_TOKEN)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            yield fleet


async def _query(fleet: Fleet, body: object, headers: Any = QAUTH) -> tuple[int, Any]:
    async with fleet.session.post(fleet.url + "/v1/kv/query", json=body, headers=headers) as r:
        return r.status, await r.json()


def _by_worker(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["worker"]: row for row in answer["workers"]}


async def test_query_answers_what_the_router_routes_by(query_fleet: Fleet) -> None:
    fleet = query_fleet
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2, "cache_salt": "tenant-a"}
    status, headers, _ = await fleet.post("/v1/completions", body)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    query = {"model": "m", "text": TEXT, "cache_salt": "tenant-a"}

    async def indexed() -> bool:
        status, answer = await _query(fleet, query)
        assert status == 200, answer
        return bool(_by_worker(answer)[holder]["matched_tokens"] >= 300)

    await eventually(indexed, what="the prompt indexed")
    _, answer = await _query(fleet, query)
    assert answer["version"] == 1 and answer["best"] == {"worker": holder, "dp_rank": None}
    # a null model names none, as on the proxy (it was a 400 here: "Expected `str`, got null")
    for unnamed in (None, ""):
        status, same = await _query(fleet, {**query, "model": unnamed})
        assert status == 200 and _by_worker(same) == _by_worker(answer), same
    assert answer["model"] == "kvroute/reference-byte-lm" and answer["prompt_tokens"] > 300
    row = _by_worker(answer)[holder]
    assert row["tiers"] == {"GPU": row["matched_blocks"]} and row["stream_state"] == "synced"
    assert row["routable"] is True and row["matched_tokens"] == 16 * row["matched_blocks"]
    # the same prompt as token ids, and the router's next request agrees with the answer
    ids = (await fleet.route({"model": "m", "prompt": TEXT}))["prompt_tokens"]
    assert ids == answer["prompt_tokens"]
    status, headers, again = await fleet.post("/v1/completions", body)
    assert int(headers["x-kvroute-matched-tokens"]) == row["matched_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == row["matched_tokens"]
    # another tenant's namespace holds nothing of it
    _, other = await _query(fleet, {**query, "cache_salt": "tenant-b"})
    assert all(r["matched_tokens"] == 0 and r["pending_tokens"] == 0 for r in other["workers"])
    assert other["namespace"] != answer["namespace"]


async def test_the_salt_header_names_the_querys_namespace_as_on_the_proxy() -> None:
    """`salt_header` set (a trusted gateway salts by it): a query carrying the header is
    answered in the namespace the proxy caches such a request in, the header over the body's
    `cache_salt`. Before, the query ignored it: a gateway asking about a request salted by the
    header got the unsalted namespace's hits (false hits), and the salted one's none."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config(
            [("w0", w0.url), ("w1", w1.url)],
            query=QueryConfig(token=QUERY_TOKEN),
            salt_header="X-Tenant",
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            # cached unsalted, and again in tenant-a's namespace (the header's)
            body = {"model": "m", "prompt": TEXT, "max_tokens": 2}
            status, _, _ = await fleet.post("/v1/completions", body)
            assert status == 200
            status, headers, _ = await fleet.post(
                "/v1/completions", {**body, "cache_salt": "ignored"}, headers={"X-Tenant": "a"}
            )
            assert status == 200
            holder = headers["x-kvroute-worker"]

            def tenant(salt: str) -> dict[str, str]:
                return {**QAUTH, "X-Tenant": salt}

            query = {"model": "m", "text": TEXT}

            async def indexed() -> bool:
                status, answer = await _query(fleet, query, tenant("a"))
                assert status == 200, answer
                return bool(_by_worker(answer)[holder]["matched_tokens"] >= 300)

            await eventually(indexed, what="the header's namespace indexed")
            _, by_header = await _query(fleet, {**query, "cache_salt": "b"}, tenant("a"))
            assert _by_worker(by_header)[holder]["matched_tokens"] >= 300, by_header
            _, by_body = await _query(fleet, {**query, "cache_salt": "a"})
            assert by_body["namespace"] == by_header["namespace"]
            # another tenant's header: nothing, whatever the body says or the unsalted holds
            _, other = await _query(fleet, {**query, "cache_salt": "a"}, tenant("b"))
            assert all(r["matched_tokens"] == 0 for r in other["workers"]), other
            _, plain = await _query(fleet, query)
            assert plain["namespace"] not in (by_header["namespace"], other["namespace"])
            assert any(r["matched_tokens"] >= 300 for r in plain["workers"]), plain
            # the header given twice is refused naming it, as on the proxy
            twice = [*QAUTH.items(), ("X-Tenant", "a"), ("X-Tenant", "b")]
            async with session.post(fleet.url + "/v1/kv/query", json=query, headers=twice) as r:
                status, error = r.status, await r.json()
            assert status == 400 and "X-Tenant header is given 2 times" in error["error"]["message"]


async def test_query_token_and_bad_input(query_fleet: Fleet) -> None:
    fleet = query_fleet
    ok = {"token_ids": [1, 2, 3]}
    twice = CIMultiDict([("Authorization", QAUTH["Authorization"]), ("Authorization", "x")])
    for headers in ({}, AUTH, {"Authorization": "Bearer nope"}, twice):
        status, error = await _query(fleet, ok, headers)
        assert status == 401 and error["error"]["type"] == "AuthError"
    status, answer = await _query(fleet, ok)
    assert status == 200 and answer["prompt_tokens"] == 3
    cases = [
        ({"text": "a", "token_ids": [1]}, 400, "exactly one of token_ids, text or messages"),
        ({}, 400, "exactly one"),
        ({"token_ids": [1], "salt": "x"}, 400, "unknown field `salt`"),
        ({"token_ids": [-1]}, 400, "token_ids[0]"),
        ({"token_ids": [1], "cache_salt": "s" * 300}, 400, "max_salt_bytes"),
        ({"token_ids": [1], "lora": 7}, 400, "Expected `str | null`"),
    ]
    for body, code, message in cases:
        status, error = await _query(fleet, body)
        assert status == code, (body, error)
        assert message in error["error"]["message"], error
    status, chat = await _query(fleet, {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["prompt_tokens"] > 2
    # nesting is bounded as on the proxy: a 400 naming the limit, never a 500 (at 2,000 levels
    # msgspec's own recursion gave up first)
    for depth in (200, 2000):
        deep = b'{"messages": [{"role": "user", "content": "hi", "x": %s0%s}]}' % (
            b"[" * depth,
            b"]" * depth,
        )
        async with fleet.session.post(fleet.url + "/v1/kv/query", data=deep, headers=QAUTH) as r:
            status, error = r.status, await r.json()
        assert status == 400 and "max_json_depth (128)" in error["error"]["message"], error


async def test_a_query_without_prompt_tokens_is_a_400(query_fleet: Fleet) -> None:
    """`"token_ids": []` and `"text": ""` were a 200 that every worker matched nothing of (and a
    `/v1/kv/routed` of them a 200): an answer about a request no engine runs (the proxy
    forwards such a prompt, and the worker refuses it with its own 400)."""
    fleet = query_fleet
    routed = {"worker": "w0"}
    for body, said in (
        ({"token_ids": []}, "token_ids gives no prompt tokens (an empty list)"),
        ({"text": ""}, "text gives no prompt tokens (an empty string)"),
    ):
        for path, extra in (("/v1/kv/query", {}), ("/v1/kv/routed", routed)):
            status, _, error = await fleet.post(path, {**body, **extra}, headers=QAUTH)
            assert status == 400, (path, body, error)
            assert error["error"]["type"] == "RequestError", error
            assert error["error"]["message"].startswith(said), error
    # the proxy leaves an empty prompt to the engine, which refuses it: the query agrees
    status, _, error = await fleet.post("/generate", {"text": ""})
    assert status == 400 and "non-empty" in error["error"]["message"], error


async def test_a_chat_the_template_renders_to_nothing_is_a_400(tmp_path: Path) -> None:
    """Messages a chat template renders to no tokens: the query's 400 names them (it was a
    200 matching nothing)."""
    template = tmp_path / "contents.jinja"  # the messages' contents, nothing around them
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as worker:
        tokenizer = TokenizerConfig(chat_template=str(template))
        config = router_config([("w0", worker.url)], tokenizer=tokenizer)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def query(content: str) -> tuple[int, Any]:
                body = {"messages": [{"role": "user", "content": content}]}
                async with session.post(router.url + "/v1/kv/query", json=body) as resp:
                    return resp.status, await resp.json()

            status, answer = await query("hi")
            assert status == 200 and answer["prompt_tokens"] == 2, answer
            status, error = await query("")
            assert status == 400 and error["error"]["type"] == "RequestError", error
            assert error["error"]["message"].startswith(
                "messages gives no prompt tokens (the chat template renders them to no tokens)"
            ), error


async def test_off_loopback_the_query_token_is_read_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_QUERY_TOKEN", raising=False)
    path = tmp_path / "router.toml"

    def write(token: str) -> None:
        # an address others reach; the app itself is served on 127.0.0.1 below
        path.write_text(
            f'[listen]\nhost = "0.0.0.0"\n[admin]\ntoken = "a"\n[query]\ntoken = "{token}"\n'
        )

    write("")
    app = create_app(
        load_config(path), config_source=ConfigSource(str(path), lambda: load_config(path))
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/kv/query"
    body = {"token_ids": [1, 2, 3]}
    try:
        async with aiohttp.ClientSession() as session:

            async def status(headers: dict[str, str]) -> tuple[int, str]:
                async with session.post(url, json=body, headers=headers) as resp:
                    return resp.status, (await resp.json())["error"][
                        "message"
                    ] if resp.status != 200 else ""

            code, message = await status({})
            assert code == 401 and "not loopback" in message
            write(QUERY_TOKEN)  # a reload that sets the token opens it
            assert "query.token" in (await app[RELOADER].reload()).changed
            assert await status(QAUTH) == (200, "")
            assert (await status({}))[0] == 401
            write("")  # and one that empties it closes it again
            assert "query.token" in (await app[RELOADER].reload()).changed
            code, message = await status({})
            assert code == 401 and "not loopback" in message
    finally:
        await runner.cleanup()


async def test_indexer_mode_serves_the_index_without_the_proxy() -> None:
    parser, verb = build_parser(["indexer", "--config", "x.toml"])
    assert verb is not None and parser.parse_args(["indexer", "--config", "x.toml"]).config
    async with ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as worker:
        config = router_config([("w0", worker.url)])
        async with RouterService(config, proxy=False) as indexer, aiohttp.ClientSession() as s:
            async with s.post(indexer.url + "/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 404  # no proxy here
            ids = list(range(5, 80))
            async with s.post(worker.url + "/generate", json={"input_ids": ids}) as resp:
                assert resp.status == 200  # straight to the worker: the gateway routed it

            async def held() -> bool:
                async with s.post(indexer.url + "/v1/kv/query", json={"token_ids": ids}) as r:
                    answer = await r.json()
                return bool(answer["workers"][0]["matched_tokens"] == 64)

            await eventually(held, what="the worker's events in the standalone index")
            async with s.get(indexer.url + "/metrics") as resp:
                assert "kvroute_stream_state" in await resp.text()


async def test_a_base_adapter_model_queries_the_adapters_namespace(query_fleet: Fleet) -> None:
    fleet = query_fleet
    model = "kvroute/reference-byte-lm"
    _, base = await _query(fleet, {"model": model, "text": TEXT})
    _, named = await _query(fleet, {"model": f"{model}:ad", "text": TEXT})
    _, given = await _query(fleet, {"model": model, "lora": "ad", "text": TEXT})
    routed = await fleet.route({"model": f"{model}:ad", "prompt": TEXT})
    # the adapter's namespace, as the proxy routes it: never the base model's pages
    assert named["lora"] == given["lora"] == routed["lora"] == "ad"
    assert named["namespace"] == given["namespace"] == routed["namespace"] != base["namespace"]


async def test_lora_names_no_adapter_on_vllm_workers_as_on_the_proxy() -> None:
    """vLLM ignores a body's `lora_path` and serves the base model; its adapter is named by
    `model`. A gateway copying a client's lora_path into `lora` was answered with the
    adapter's pages, which the request it routes would not reuse there (a false hit)."""
    tokens = list(range(1, 17))  # 4 pages of 4

    async with vllm_stub(model="base-v") as (vllm, pub):
        config = msgspec.structs.replace(router_config([]), workers=(vllm,))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:

            async def ask(body: dict[str, Any]) -> Any:
                async with session.post(router.url + "/v1/kv/query", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            async def live() -> bool:
                await pub.publish_payload(vllm_payload())
                (stream,) = router.indexer.streams()
                return stream.state == "synced" and stream.last_seq is not None

            await eventually(live, what="the stream to be live")
            # the adapter's pages, as vLLM publishes them: its name in every block's keys
            await pub.publish_payload(vllm_payload(_adapter_pages(tokens, "sql-lora")))
            prompt = [*tokens, 99]
            named = {"model": "sql-lora", "token_ids": prompt}

            async def indexed() -> bool:
                return bool((await ask(named))["workers"][0]["matched_tokens"] == 16)

            await eventually(indexed, what="the adapter's pages indexed")
            adapter = await ask(named)
            base = await ask({"model": "base-v", "token_ids": prompt})
            given = await ask({"model": "base-v", "lora": "sql-lora", "token_ids": prompt})
            async with session.post(
                router.url + "/admin/route",
                json={"model": "base-v", "prompt": prompt, "lora_path": "sql-lora"},
                headers=AUTH,
            ) as resp:
                routed = await resp.json()
            # `lora` is read as the proxy reads lora_path: the base model's namespace
            assert given["lora"] is routed["lora"] is base["lora"] is None
            assert given["namespace"] == routed["namespace"] == base["namespace"]
            assert given["workers"][0]["matched_tokens"] == 0
            assert routed["candidates"][0]["matched_tokens"] == 0
            assert adapter["lora"] == "sql-lora" and adapter["namespace"] != base["namespace"]


def _adapter_pages(tokens: list[int], adapter: str) -> dict[str, Any]:
    blocks = len(tokens) // 4
    return {
        "type": "BlockStored",
        "block_hashes": list(range(11, 11 + blocks)),
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": adapter,
        "extra_keys": [[adapter]] * blocks,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }


async def test_a_gateways_extra_key_request_is_told_and_plain_ones_are_not_predicted_it(
    query_fleet: Fleet,
) -> None:
    """A gateway sends an extra_key request to a worker itself: SGLang publishes its pages
    under the plain hashes, so the index would predict them to a plain request of the same
    prompt (it answered 336, the worker cached 0). Asked about the extra_key request, the
    query says `unindexed` and predicts nothing; told through /v1/kv/routed, it shadows the
    plain twin there, as for the requests the router routes itself."""
    fleet = query_fleet
    w0 = fleet.workers["w0"]
    ids = list(("Gateway extra_key probe, a system prompt long enough for pages. " * 5).encode())
    sent = {"input_ids": ids, "cache_salt": "gw", "extra_key": "conv-1"}
    async with fleet.session.post(
        w0.url + "/generate", json={**sent, "sampling_params": {"max_new_tokens": 1}}
    ) as resp:
        assert resp.status == 200
    plain = {"model": "", "cache_salt": "gw", "token_ids": ids}

    async def indexed() -> bool:  # the events show the pages as plain ones
        _, answer = await _query(fleet, plain)
        return bool(_by_worker(answer)["w0"]["matched_tokens"] >= 256)

    await eventually(indexed, what="the extra_key pages in the events")
    status, keyed = await _query(fleet, {**plain, "extra_key": "conv-1"})
    assert status == 200 and keyed["unindexed"] == "extra_key", keyed
    assert all(r["matched_tokens"] == 0 for r in keyed["workers"])
    assert keyed["namespace"] != (await _query(fleet, plain))[1]["namespace"]

    routed = {**plain, "extra_key": "conv-1", "worker": "w0"}
    async with fleet.session.post(fleet.url + "/v1/kv/routed", json=routed) as resp:
        assert resp.status == 401  # the query token, as for the query
    async with fleet.session.post(fleet.url + "/v1/kv/routed", json=routed, headers=QAUTH) as resp:
        assert resp.status == 200, await resp.text()
        told = await resp.json()
    assert told["version"] == 1 and told["shadowed"] is True and told["worker"] == "w0"
    _, answer = await _query(fleet, plain)
    assert _by_worker(answer)["w0"]["matched_tokens"] == 0
    # what the worker says: its plain copy of the prompt holds nothing
    async with fleet.session.post(
        w0.url + "/debug/match", json={"input_ids": ids, "cache_salt": "gw"}
    ) as resp:
        assert (await resp.json())["cached_tokens"] == 0

    # a plain request needs no word (its pages are in the events); mistakes are 400s
    async with fleet.session.post(
        fleet.url + "/v1/kv/routed", json={**plain, "worker": "w0"}, headers=QAUTH
    ) as resp:
        assert resp.status == 200 and (await resp.json())["shadowed"] is False
    for body, message in (
        ({**routed, "worker": "nope"}, "no worker 'nope'"),
        ({**routed, "dp_rank": 3}, "no dp rank 3"),
        ({**plain, "extra_key": "k"}, "Object missing required field `worker`"),
    ):
        async with fleet.session.post(
            fleet.url + "/v1/kv/routed", json=body, headers=QAUTH
        ) as resp:
            error = await resp.json()
            assert resp.status == 400 and message in error["error"]["message"], error


async def test_a_model_served_by_pairs_is_answered_with_its_prefill_workers() -> None:
    """A prefill/decode model: the rows are its prefill workers, ranked as the pair's prefill
    side is (`/admin/route`), in the router and in `kvroute indexer` alike. Before, both
    planned for `both` workers, which such a model has none of: `"best": null, "workers": []`
    while the proxy's next request matched the prefill worker's 96 tokens."""
    async with (
        ReferenceWorker(reference("prefill")) as p0,
        ReferenceWorker(reference("prefill")) as p1,
        ReferenceWorker(reference("decode")) as d0,
    ):
        workers = {"p0": p0, "p1": p1, "d0": d0}
        config = router_config([(name, w.url) for name, w in workers.items()])
        async with (
            RouterService(config) as router,
            RouterService(config, proxy=False) as indexer,
            aiohttp.ClientSession() as session,
        ):
            await warm(session, router, [p0, p1], [d0])
            await warm(session, indexer, [p0, p1], [d0])
            body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
            async with session.post(router.url + "/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                holder = resp.headers["x-kvroute-prefill-worker"]
            other = "p1" if holder == "p0" else "p0"
            # the indexer's gateway sends a pair straight to the workers: the other prefill
            direct = [t + 1 for t in PROMPT]
            pair = {**body, "input_ids": direct, "bootstrap_host": "127.0.0.1", "bootstrap_room": 7}
            pair["bootstrap_port"] = workers[other].disagg.bootstrap_port
            sent = await asyncio.gather(
                session.post(workers[other].url + "/generate", json=pair),
                session.post(d0.url + "/generate", json=pair),
            )
            for resp in sent:
                assert resp.status == 200, await resp.text()
                resp.release()
            fleet = Fleet(router, workers, session)

            async def query(url: str, ids: list[int]) -> Any:
                async with session.post(url + "/v1/kv/query", json={"token_ids": ids}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def held() -> bool:
                plan = await fleet.route(body)
                return bool(plan["prefill"]["candidates"][0]["matched_tokens"] == 6 * PAGE)

            await eventually(held, what="the prefill's pages in the router's index")
            answer = await query(router.url, PROMPT)
            plan = await fleet.route(body)
            assert answer["best"] == {"worker": holder, "dp_rank": None}, answer
            assert answer["role"] == "prefill"
            rows = _by_worker(answer)
            assert set(rows) == {"p0", "p1"}  # the decode worker is no row
            assert rows[holder]["matched_tokens"] == 6 * PAGE
            assert {c["worker"]: c["matched_tokens"] for c in plan["prefill"]["candidates"]} == {
                w: row["matched_tokens"] for w, row in rows.items()
            }
            async with session.post(router.url + "/generate", json=body) as resp:
                assert int(resp.headers["x-kvroute-matched-tokens"]) == 6 * PAGE

            async def in_indexer() -> bool:
                answer = await query(indexer.url, direct)
                return bool(answer["best"] == {"worker": other, "dp_rank": None})

            await eventually(in_indexer, what="the gateway's pair in the standalone index")
            alone = await query(indexer.url, direct)
            assert alone["role"] == "prefill" and set(_by_worker(alone)) == {"p0", "p1"}
            assert _by_worker(alone)[other]["matched_tokens"] == 6 * PAGE


async def _stalled(answer: Awaitable[_A]) -> tuple[_A, float]:
    """`answer`'s result, and the loop's longest stall (seconds) while it was awaited."""
    longest = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    try:
        result = await answer
    finally:
        done.set()
        await ticker  # its last tick counts the stall that ended as the answer came
    return result, longest


async def test_a_long_query_is_tokenized_off_the_loop() -> None:
    """A long `text` or `messages` is decoded and tokenized on the tokenizer's threads, as the
    proxy's long bodies are, so the loop keeps answering other requests. Before, the query API
    tokenized on the loop: a 1.5 MB prompt held every other request for ~0.7 s."""
    pytest.importorskip("tokenizers")
    hf = TokenizerConfig(kind="hf", path=str(CHAT_FIXTURES / "qwen3-0.6b" / "tokenizer.json"))
    text = TEXT * 2000  # 720 KB, a few hundred ms of encode
    alone = build_tokenizer(hf)
    try:
        started = time.perf_counter()
        ids = alone.text(text)
        encode_s = time.perf_counter() - started
    finally:
        alone.close()
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0:
        config = router_config([("w0", w0.url)], query=QueryConfig(token=QUERY_TOKEN), tokenizer=hf)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            for body in ({"text": text}, {"messages": [{"role": "user", "content": text}]}):
                (status, answer), longest = await _stalled(_query(fleet, body))
                assert status == 200, answer
                assert answer["prompt_tokens"] >= len(ids)
                # on the loop it stalled for the whole encode (0.31 of 0.36 s; 0.017 s now)
                assert longest < encode_s / 2, (longest, encode_s)


def _prose(tag: str, chars: int) -> str:
    return ((tag + " ") * (chars // (len(tag) + 1) + 1))[:chars]


async def test_a_rows_predicted_tokens_is_what_the_proxy_predicts_at_admission() -> None:
    """A prefix the requests queued ahead will evict before the worker admits the prompt: the
    proxy predicts none of it, and the worker reuses none. The query gave only the raw match
    (QA: 592 tokens), which a gateway took for the hit; `predicted_tokens` says the proxy's."""
    # one request runs at a time in a 2,048-token pool: a 1,500-token prompt queued behind a
    # long decode evicts a 600-token prefix before anything after it is admitted
    cfg = ReferenceConfig(
        time_scale=1.0,
        page_size=16,
        capacity_tokens=2048,
        max_running_requests=1,
        prefill_ms_per_token=0.05,
        decode_ms_per_token=10.0,
    )
    prefix = {"text": _prose("prefix", 600), "sampling_params": {"max_new_tokens": 1}}
    async with one_worker_fleet(cfg, query=QueryConfig(token=QUERY_TOKEN)) as fleet:
        status, _, _ = await fleet.post("/generate", prefix)
        assert status == 200
        await eventually(lambda: fleet.holds(prefix, "w0", 592), what="the prefix indexed")
        running = asyncio.create_task(
            fleet.post("/generate", {"text": "C", "sampling_params": {"max_new_tokens": 400}})
        )
        big = {"text": _prose("big", 1500), "sampling_params": {"max_new_tokens": 5}}
        try:
            await asyncio.sleep(0.2)  # the decode admitted first: it holds the one place
            queued_big = asyncio.create_task(fleet.post("/generate", big))
            rows: list[dict[str, Any]] = []

            async def big_in_flight() -> bool:  # routed: in the router's in-flight view
                status, answer = await _query(fleet, {"text": prefix["text"]})
                assert status == 200
                rows[:] = answer["workers"]
                return int(rows[0]["queued_prefill_tokens"]) >= 1000

            await eventually(big_in_flight, what="the big prompt in flight")
            (row,) = rows
            (planned,) = (await fleet.route(prefix))["candidates"]
            status, headers, sent = await fleet.post("/generate", {**prefix, "rid": "again"})
            await queued_big
        finally:
            await running
    assert row["matched_tokens"] == 592  # the raw match: what the events show
    held = planned["matched_tokens"] + planned["pending_tokens"]
    assert row["predicted_tokens"] == min(held, planned["admission"]["kept_tokens"]) == 0, planned
    assert status == 200
    predicted = int(headers["x-kvroute-matched-tokens"]) + int(headers["x-kvroute-pending-tokens"])
    assert predicted == 0 == sent["meta_info"]["cached_tokens"]
