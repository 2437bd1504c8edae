"""Model pools end to end: real reference workers of several models behind one real router.

A fleet serves models and a request goes only to the workers of the model its body names
(DESIGN.md section 9). Before pools, a worker's `model` only separated the index namespace and
every policy sent about half of one model's requests to the other model's workers.
"""

from __future__ import annotations

import contextlib
import random
import re
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import msgspec
import pytest

from indexer.engines import EngineName
from indexer.namespace import Namespace, anonymous_lora
from indexer.protocol.encode import WireLayout
from indexer.protocol.tokens import ByteTokenizer
from router.config import (
    BreakerConfig,
    HealthConfig,
    LimitsConfig,
    PolicyConfig,
    PolicyName,
    WorkerConfig,
)
from router.errors import AmbiguousModelError, UnknownModelError
from router.fleet.discovery import adapters_from_model_list
from router.routing.pool import WorkerPool
from router.service import RouterService
from tests.router.conftest import STALL_PROOF_HEALTH, Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

POLICIES: tuple[PolicyName, ...] = ("kv", "round_robin", "least_load", "random", "approx_tree")


@contextlib.asynccontextmanager
async def model_fleet(
    models: Sequence[str],
    *,
    policy: PolicyName = "kv",
    configured: bool = True,
    health: HealthConfig | None = None,
    versions: Sequence[str] = (),
    event_format: WireLayout = "map",
) -> AsyncIterator[Fleet]:
    """One reference worker per entry of `models` (worker i serves models[i]) behind a router;
    `configured`: the router's config names each worker's model, else it is discovered;
    `versions`: the SGLang version worker i plays (default: the reference worker's)."""
    async with contextlib.AsyncExitStack() as stack:
        workers: dict[str, ReferenceWorker] = {}
        for i, model in enumerate(models):
            cfg = ReferenceConfig(
                model=model, time_scale=0.0, page_size=16, event_format=event_format
            )
            if i < len(versions):
                cfg = msgspec.structs.replace(cfg, version=versions[i])
            workers[f"w{i}"] = await stack.enter_async_context(ReferenceWorker(cfg))
        entries = tuple(
            WorkerConfig(url=w.url, id=wid, model=models[i] if configured else "")
            for i, (wid, w) in enumerate(workers.items())
        )
        config = router_config([], policy=PolicyConfig(name=policy))
        # not about the health check: a stall of this loaded process must not fail one (CI)
        health = health or STALL_PROOF_HEALTH
        config = msgspec.structs.replace(config, workers=entries, health=health)
        router = await stack.enter_async_context(RouterService(config))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield Fleet(router, workers, session)


def _body(endpoint: str, model: str, text: str, salt: str) -> dict[str, Any]:
    if endpoint == "/generate":
        return {"model": model, "text": text, "cache_salt": salt, "sampling_params": {}}
    if endpoint == "/v1/chat/completions":
        messages = [{"role": "user", "content": text}]
        return {"model": model, "messages": messages, "max_tokens": 2, "cache_salt": salt}
    return {"model": model, "prompt": text, "max_tokens": 2, "cache_salt": salt}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("models", "configured"),
    [(("model-a", "model-b"), True), (("model-a", "model-a", "model-b"), False)],
    ids=["one-each-configured", "two-a-one-b-discovered"],
)
async def test_no_request_crosses_models(
    policy: PolicyName, models: tuple[str, ...], configured: bool
) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")  # a failing run is reproduced from its seed
    rng = random.Random(seed)
    # runs of one model: a policy taking turns over the whole fleet crosses on the second
    sequence = ["model-a", "model-a", "model-b", "model-b"] * 3
    sequence += [rng.choice(("model-a", "model-b")) for _ in range(36)]
    endpoints = ("/v1/completions", "/v1/chat/completions", "/generate")
    async with model_fleet(models, policy=policy, configured=configured) as fleet:
        pool = {wid: models[i] for i, wid in enumerate(fleet.workers)}
        served: Counter[str] = Counter()
        for i, model in enumerate(sequence):
            # the same prompts for both models: a cache of one is no reason to cross
            text = f"A system prompt both models are sent, long enough for pages. {i % 4}" * 3
            body = _body(endpoints[i % 3], model, text, salt=f"tenant-{i % 2}")
            status, headers, answer = await fleet.post(endpoints[i % 3], body)
            assert status == 200, answer
            worker = headers["x-kvroute-worker"]
            assert pool[worker] == model, f"request {i} for {model} went to {worker}"
            served[worker] += 1
    assert sum(served.values()) == len(sequence) >= 40
    if policy == "round_robin":  # turns are taken within each model's pool
        a_workers = [wid for wid, m in pool.items() if m == "model-a"]
        counts = [served[wid] for wid in a_workers]
        assert max(counts) - min(counts) <= 1, served


async def test_a_failed_request_is_retried_only_within_its_model() -> None:
    # health checks too slow to notice: the proxy itself finds model-a's only worker gone
    slow = HealthConfig(interval_s=60.0, timeout_s=0.5)
    async with model_fleet(("model-a", "model-b"), health=slow) as fleet:
        await fleet.workers["w0"].__aexit__(None, None, None)
        status, _, answer = await fleet.post("/v1/completions", _body("", "model-a", "x", "t"))
        # the proxy finds it gone (502), or the check its dropped event connection brings
        # does first (503: CI, a loaded machine); either way model-b's worker is never tried
        assert (status, answer["error"]["type"]) in {
            (502, "UpstreamError"),
            (503, "NoWorkerError"),
        }, answer
        assert "w1" not in answer["error"]["message"]
        status, _, answer = await fleet.post("/v1/completions", _body("", "model-a", "x", "t"))
        assert status == 503 and answer["error"]["type"] == "NoWorkerError", answer
        status, headers, _ = await fleet.post("/v1/completions", _body("", "model-b", "x", "t"))
        assert status == 200 and headers["x-kvroute-worker"] == "w1"


async def test_a_single_model_fleet_takes_any_model_name_and_shares_its_cache() -> None:
    async with model_fleet(("m", "m")) as fleet:
        await fleet.warm()
        for model in ("default", "anything/else", "m", "m:an-adapter", ""):
            status, _, answer = await fleet.post("/v1/completions", _body("", model, "hi", "t"))
            assert status == 200, (model, answer)
        status, _, answer = await fleet.post("/v1/completions", {"prompt": "no model field"})
        assert status == 200, answer
        # "default" is the fleet's model: it matches what a request naming "m" cached
        prompt = "One tenant's long system prompt, cached under the model's own name. " * 5
        named = {"model": "m", "prompt": prompt, "max_tokens": 1}
        _, headers, _ = await fleet.post("/v1/completions", named)
        holder = headers["x-kvroute-worker"]
        default = {**named, "model": "default"}
        await eventually(lambda: fleet.holds(default, holder, 256), what="'default' to hit")
        plan = await fleet.route(default)
        assert plan["model"] == "m" and plan["lora"] is None
        assert {c["worker"] for c in plan["candidates"]} == {"w0", "w1"}
        status, headers, answer = await fleet.post("/v1/completions", default)
        assert status == 200 and headers["x-kvroute-worker"] == holder
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(headers["x-kvroute-matched-tokens"]) == cached >= 256


async def test_an_unknown_model_is_a_404_listing_the_served_models() -> None:
    async with model_fleet(("model-a", "model-b")) as fleet:
        for endpoint, model in [
            ("/v1/chat/completions", "model-c"),
            ("/v1/completions", "default"),
            ("/v1/completions", "model-c:an-adapter"),
            ("/generate", ""),
        ]:
            status, _, answer = await fleet.post(endpoint, _body(endpoint, model, "hi", "t"))
            assert status == 404, answer
            error = answer["error"]
            assert error["type"] == "UnknownModelError"
            assert error["models"] == ["model-a", "model-b"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert "'model-a', 'model-b'" in error["message"]
        status, answer = await fleet.admin("POST", "/route", {"model": "model-c", "prompt": "x"})
        assert status == 404 and answer["error"]["models"] == ["model-a", "model-b"]
        async with fleet.session.get(fleet.url + "/metrics") as resp:
            assert "kvroute_requests_total{" not in await resp.text()  # none was forwarded


async def test_v1_models_is_the_union_of_the_routable_workers_models() -> None:
    async with model_fleet(("model-a", "model-a", "model-b"), configured=False) as fleet:
        async with fleet.session.get(fleet.url + "/v1/models") as resp:
            listed = await resp.json()
        assert listed["object"] == "list"
        assert [card["id"] for card in listed["data"]] == ["model-a", "model-b"]
        assert all(card["object"] == "model" for card in listed["data"])
        status, _ = await fleet.admin("POST", "/workers/w2/drain")
        assert status == 200
        async with fleet.session.get(fleet.url + "/v1/models") as resp:
            assert [card["id"] for card in (await resp.json())["data"]] == ["model-a"]


async def test_a_lora_adapter_is_a_model_of_its_base() -> None:
    async with model_fleet(("model-a", "model-a", "model-b")) as fleet:
        a_pool = {"w0", "w1"}
        chat = _body("/v1/chat/completions", "model-a:my-lora", "hi there", "t")
        plan = await fleet.route(chat)
        assert (plan["model"], plan["lora"]) == ("model-a", "my-lora")
        assert {c["worker"] for c in plan["candidates"]} == a_pool
        # the namespace is the base model's with the adapter, as `lora_path` names it
        by_path = await fleet.route({**chat, "model": "model-a", "lora_path": "my-lora"})
        bare = await fleet.route({**chat, "model": "model-a"})
        assert plan["namespace"] == by_path["namespace"] != bare["namespace"]
        # SGLang: the model's adapter wins over lora_path on its OpenAI routes
        both = await fleet.route({**chat, "lora_path": "other-lora"})
        assert both["lora"] == "my-lora" and both["namespace"] == plan["namespace"]
        # its /generate takes no `model`: the string picks the pool, only lora_path the adapter
        generate = _body("/generate", "model-a:my-lora", "hi there", "t")
        plan = await fleet.route(generate)
        assert (plan["model"], plan["lora"]) == ("model-a", None)
        plan = await fleet.route({**generate, "lora_path": "my-lora"})
        assert plan["lora"] == "my-lora"
        status, answer = await fleet.admin("POST", "/route", {**chat, "model": "model-c:my-lora"})
        assert status == 404, answer
        for i in range(24):
            body = _body("/v1/completions", "model-a:my-lora", f"prompt {i}", f"t{i % 3}")
            status, headers, answer = await fleet.post("/v1/completions", body)
            assert status == 200 and headers["x-kvroute-worker"] in a_pool, (i, headers)


async def test_a_single_model_fleet_reads_the_adapter_as_sglang_does() -> None:
    async with model_fleet(("m",)) as fleet:
        # SGLang ignores the base it does not serve and keeps the adapter
        plan = await fleet.route({"model": "default:lora-1", "prompt": "x"})
        assert (plan["model"], plan["lora"]) == ("m", "lora-1")
        plan = await fleet.route({"model": "m: lora-2 ", "prompt": "x"})  # stripped
        assert plan["lora"] == "lora-2"
        plan = await fleet.route({"model": "m:", "prompt": "x"})  # an empty adapter is none
        assert plan["lora"] is None


_PROMPT = "A tenant's long system prompt, cached under one adapter or none at all. " * 5


async def _predicted_and_cached(fleet: Fleet, body: dict[str, Any]) -> tuple[int, int, int]:
    """(tokens the router predicted, matched and pending, and the worker reported cached)."""
    status, headers, answer = await fleet.post("/v1/completions", body)
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    matched = int(headers["x-kvroute-matched-tokens"])
    return matched, int(headers["x-kvroute-pending-tokens"]), cached


@pytest.mark.parametrize(
    ("served", "seeded_lora", "model"),
    [("org/m:v1", None, "org/m:v1"), ("s3://bk/m", "L1", "s3://bk/m:L1")],
    ids=["served-name-with-colon", "uri-with-adapter"],
)
async def test_a_served_name_with_a_colon_is_predicted_as_sglang_0_5_23_caches_it(
    served: str, seeded_lora: str | None, model: str
) -> None:
    # the reference worker split the model at its first ":" (SGLang before 0.5.23, whose
    # version it advertises): predicted the pages /generate seeded, it reported none cached
    async with model_fleet((served,)) as fleet:
        await fleet.warm()
        seed = {"text": _PROMPT, "sampling_params": {"max_new_tokens": 1}}
        status, _, answer = await fleet.post("/generate", {**seed, "lora_path": seeded_lora})
        assert status == 200, answer
        probe = {"model": model, "prompt": _PROMPT, "max_tokens": 1}
        await eventually(lambda: fleet.holds(probe, "w0", 256), what="the seed indexed")
        plan = await fleet.route(probe)
        assert (plan["model"], plan["lora"]) == (served, seeded_lora)
        assert plan["candidates"][0]["unpredicted"] is None
        matched, pending, cached = await _predicted_and_cached(fleet, probe)
        assert matched + pending == cached >= 256


@pytest.mark.parametrize("version", ["0.5.22", "0.5.17", "", "0.6.0rc1"])
async def test_a_worker_not_known_to_split_after_the_served_name_is_predicted_no_hit(
    version: str,
) -> None:
    # SGLang 0.5.17-0.5.22 read "s3://bk/m:L1" as adapter "//bk/m:L1" of "s3": the router
    # predicted adapter L1's pages there (false hit); a version it does not know may too
    async with model_fleet(("s3://bk/m",), versions=(version,)) as fleet:
        await fleet.warm()
        seed = {"text": _PROMPT, "lora_path": "L1", "sampling_params": {"max_new_tokens": 1}}
        status, _, answer = await fleet.post("/generate", seed)
        assert status == 200, answer
        await eventually(lambda: fleet.holds(seed, "w0", 256), what="the seed indexed")
        probe = {"model": "s3://bk/m:L1", "prompt": _PROMPT, "max_tokens": 1}
        plan = await fleet.route(probe)
        (candidate,) = plan["candidates"]
        assert plan["lora"] == "L1" and candidate["matched_tokens"] == 0
        assert "no hit predicted" in candidate["unpredicted"], candidate
        assert (version or "not advertised") in candidate["unpredicted"]
        # an old worker caches it under its own reading, another reads it as the router: no
        # false hit either way
        matched, pending, cached = await _predicted_and_cached(fleet, probe)
        assert matched == pending == 0
        assert (cached == 0) == (version in ("0.5.22", "0.5.17")), cached
        # and nothing is marked pending in the router's reading of it
        fresh = {**probe, "prompt": "Another prompt, sent once by its adapter's model. " * 6}
        await _predicted_and_cached(fleet, fresh)
        plan = await fleet.route({"text": fresh["prompt"], "lora_path": "L1"})
        assert plan["candidates"][0]["pending_tokens"] == 0, plan
        # a model no release splits otherwise is predicted as the index holds it
        plan = await fleet.route({**seed, "model": "s3://bk/m"})
        assert plan["candidates"][0]["matched_tokens"] >= 256


async def test_a_client_cannot_name_the_anonymous_adapter_of_the_array_layout() -> None:
    # SGLang <= 0.5.19's arrays name an adapter by its id alone: the index files its pages
    # under `anonymous_lora(id)`, a name a client could send as its own adapter and be
    # predicted that adapter's pages (a false hit, and a probe of another tenant's cache)
    async with model_fleet(("m-d",), event_format="array") as fleet:
        await fleet.warm()
        body = {"model": "m-d", "prompt": _PROMPT, "max_tokens": 1, "lora_path": "L1"}
        status, _, answer = await fleet.post("/v1/completions", body)
        assert status == 200, answer
        anonymous = anonymous_lora(zlib.crc32(b"L1") or 1)
        indexer = fleet.router.planner.indexer
        tokens = ByteTokenizer().encode(_PROMPT)

        async def indexed() -> bool:
            held = indexer.query(Namespace("m-d", anonymous), tokens).get("w0")
            return held is not None and held.matched_tokens >= 256

        await eventually(indexed, what="the adapter's pages indexed by its id")
        chat = [{"role": "user", "content": _PROMPT}]
        for path, sent, field in [
            ("/v1/completions", {**body, "lora_path": anonymous}, "lora_path"),
            ("/generate", {"text": [_PROMPT, "x"], "lora_path": ["L1", anonymous]}, "[1]"),
            ("/v1/chat/completions", {"model": "m-d:" + anonymous, "messages": chat}, "model"),
            ("/v1/kv/query", {"model": "m-d", "lora": anonymous, "text": _PROMPT}, "lora"),
            ("/v1/kv/query", {"model": "m-d:" + anonymous, "text": _PROMPT}, "model"),
        ]:
            status, _, answer = await fleet.post(path, sent)
            assert status == 400, (path, answer)
            assert answer["error"]["type"] == "RequestError", answer
            message = answer["error"]["message"]
            assert field in message and "NUL" in message, (path, message)
        # the adapter by its name is still served (its pages: another namespace, no hit)
        status, _, answer = await fleet.post("/v1/completions", body)
        assert status == 200, answer


async def test_adapter_names_are_bounded_everywhere_they_enter() -> None:
    # the QA report: a 2 MB lora_path, `model` "base:" + 2 MB, or /v1/kv/query's lora were
    # taken, and on reference workers (which cache any name) the name became a namespace:
    # /admin/namespaces and /dashboard/state grew to 2.1 MB
    limit = LimitsConfig().max_adapter_name_bytes
    # (under 1 MiB a body: aiohttp's client warns of a larger one sent as bytes)
    huge, at_limit = "L" * 1_000_000, "A" * limit
    async with model_fleet(("m-e",)) as fleet:
        await fleet.warm()
        chat = [{"role": "user", "content": _PROMPT}]
        completion = {"model": "m-e", "prompt": _PROMPT, "max_tokens": 1}
        for path, sent, field in [
            ("/v1/completions", {**completion, "lora_path": huge}, "lora_path"),
            ("/v1/chat/completions", {"model": "m-e", "messages": chat, "lora_path": huge},
             "lora_path"),
            ("/generate", {"text": [_PROMPT, "x"], "lora_path": ["L1", huge]}, "lora_path[1]"),
            ("/generate", {"input_ids": [[1, 2]], "lora_path": [huge]}, "lora_path[0]"),
            ("/v1/completions", {**completion, "model": "m-e:" + huge}, "model"),
            ("/v1/chat/completions", {"model": "m-e:" + huge, "messages": chat}, "model"),
            ("/v1/kv/query", {"model": "m-e", "lora": huge, "text": _PROMPT}, "lora"),
            ("/v1/kv/query", {"model": "m-e:" + huge, "text": _PROMPT}, "model"),
        ]:  # fmt: skip
            status, _, answer = await fleet.post(path, sent)
            assert status == 400, (path, field, answer)
            assert answer["error"]["type"] == "RequestError", answer
            assert answer["error"]["message"] == (
                f"{field} names a LoRA adapter longer than limits.max_adapter_name_bytes "
                f"({limit} bytes)"
            ), (path, answer)
        status, answer = await fleet.admin("POST", "/route", {**completion, "lora_path": huge})
        assert status == 400 and "lora_path names" in answer["error"]["message"], answer
        # a name as long as the limit is an adapter like any other, by lora_path or by model
        for sent in ({**completion, "lora_path": at_limit}, {**completion, "model": "m-e:A"}):
            status, _, answer = await fleet.post("/v1/completions", sent)
            assert status == 200, answer
        plan = await fleet.route({**completion, "model": "m-e:" + at_limit})
        assert plan["lora"] == at_limit

        async def adapter_indexed() -> bool:
            _, listed = await fleet.admin("GET", "/namespaces")
            return any(row["lora"] == at_limit for row in listed["namespaces"])

        await eventually(adapter_indexed, what="the adapter at the limit indexed")
        _, listed = await fleet.admin("GET", "/namespaces")
        assert max(len(row["lora"] or "") for row in listed["namespaces"]) == limit


_LABEL = re.compile(r'model="([^"]*)"')


async def test_model_labels_name_served_models_only() -> None:
    async with model_fleet(("model-a", "model-b")) as fleet:
        for i in range(4):
            for model in ("model-a", "model-b", f"made-up-{i}", "model-a:some-adapter"):
                await fleet.post("/v1/completions", _body("", model, f"p{i}", "t"))
        async with fleet.session.post(fleet.url + "/v1/completions", data=b"{") as resp:
            assert resp.status == 400
        async with fleet.session.get(fleet.url + "/metrics") as resp:
            text = await resp.text()
    assert set(_LABEL.findall(text)) == {"model-a", "model-b", "(unknown)", ""}
    assert "made-up" not in text and "some-adapter" not in text
    requests = r'kvroute_requests_total\{code="200",endpoint="/v1/completions",model="model-a"'
    assert re.search(requests + r',worker="w0"\} 8\.0', text), text
    assert re.search(r'kvroute_request_duration_seconds_count\{[^}]*model="model-b"\} 4\.0', text)
    assert (
        'kvroute_rejected_requests_total{endpoint="/v1/completions",error="UnknownModelError",'
        'model="(unknown)"} 4.0'
    ) in text
    async with model_fleet(("m",)) as fleet:
        for model in ("default", "whatever-1", "whatever-2"):
            await fleet.post("/v1/completions", _body("", model, "p", "t"))
        async with fleet.session.get(fleet.url + "/metrics") as resp:
            text = await resp.text()
    assert set(_LABEL.findall(text)) == {"m"}


def test_a_vllm_fleet_reads_a_name_it_does_not_serve_as_a_lora_adapter() -> None:
    """vLLM takes a request for another name only as a LoRA adapter's (its events name the
    adapter as `lora_name`): read as the base model, the base's pages were predicted."""
    cases: list[tuple[EngineName, str | None]] = [("vllm", "sql-lora"), ("sglang", None)]
    for engine, lora in cases:
        pool = WorkerPool(BreakerConfig())
        pool.add(WorkerConfig(url="http://127.0.0.1:1", id="w", engine=engine, model="base"))
        choice = pool.resolve("sql-lora")
        assert (choice.model, choice.cache_model, choice.adapter) == ("base", "base", lora)
        assert pool.resolve("base").adapter is None


def test_a_vllm_adapter_its_base_lists_goes_to_that_base_in_a_fleet_of_several() -> None:
    """vLLM's /v1/models lists an adapter as a card whose `parent` is its base: a request
    naming it goes to that base's pool, in the adapter's namespace (it was refused as an
    unknown model)."""
    pool = WorkerPool(BreakerConfig())
    a = pool.add(WorkerConfig(url="http://127.0.0.1:1", id="a", engine="vllm", model="base-a"))
    pool.add(WorkerConfig(url="http://127.0.0.1:2", id="b", engine="vllm", model="base-b"))
    pool.set_models(a, ("base-a",), {"sql-lora": "base-a"})
    choice = pool.resolve("sql-lora")
    assert (choice.model, choice.cache_model, choice.adapter) == ("base-a", "base-a", "sql-lora")
    with pytest.raises(UnknownModelError):
        pool.resolve("other-lora")  # listed by no worker: never read as a base
    assert adapters_from_model_list(
        {"data": [{"id": "base-a"}, {"id": "sql-lora", "parent": "base-a"}, {"id": 3}]}
    ) == {"sql-lora": "base-a"}


def test_an_adapter_two_base_models_list_is_refused_whatever_the_worker_order() -> None:
    """vLLM lists an adapter by name with its `parent`: when workers of two base models list
    one name, the last worker's base won, so removing an unrelated worker (v3, base-v) moved
    the name's requests from base-v to base-w while v1 still served it."""
    listed = {"v1": "base-v", "v2": "base-w", "v3": "base-v"}
    pool = WorkerPool(BreakerConfig())
    for i, (wid, base) in enumerate(listed.items()):
        entry = pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=wid, engine="vllm"))
        adapters = {"shared": base} | ({"sql-lora": base} if base == "base-v" else {})
        pool.set_models(entry, (base,), adapters)
    for removed in ("", "v3"):
        if removed:
            pool.remove(removed)
        with pytest.raises(AmbiguousModelError) as refused:
            pool.resolve("shared")
        assert refused.value.bases == ("base-v", "base-w")
        assert pool.ambiguous_adapters() == {"shared": ("base-v", "base-w")}
        # an adapter of one base is that base's, and the `base:adapter` spelling is unchanged
        assert pool.resolve("sql-lora").model == "base-v"
        assert (pool.resolve("base-w:shared").model, pool.resolve("base-w").adapter) == (
            "base-w",
            None,
        )
    pool.remove("v2")  # only base-v lists it now: it is base-v's again
    choice = pool.resolve("shared")
    assert (choice.model, choice.adapter, pool.ambiguous_adapters()) == ("base-v", "shared", {})


def test_an_adapter_listed_under_aliases_of_one_pool_is_not_ambiguous() -> None:
    """Two names of the same workers (vLLM `--served-model-name a b`, listed in another order
    on each) are one pool: an adapter whose cards name either is that pool's."""
    pool = WorkerPool(BreakerConfig())
    for i, (names, parent) in enumerate([(("a", "b"), "a"), (("b", "a"), "b")]):
        entry = pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=f"w{i}", engine="vllm"))
        pool.set_models(entry, names, {"lora": parent})
    pool.add(WorkerConfig(url="http://127.0.0.1:3", id="c", engine="vllm", model="c"))
    choice = pool.resolve("lora")
    assert (choice.model, choice.cache_model, choice.adapter) == ("a", "a", "lora")
    assert pool.ambiguous_adapters() == {}


@pytest.mark.parametrize(
    ("names", "matched_under"),
    [
        ({"a": ("X", "x"), "b": ("X", "x")}, {"X": "X", "x": "X"}),  # listed alike: both X's
        ({"a": ("X", "x"), "b": ("x",)}, {"X": "X", "x": "x"}),  # x is b's first name
        ({"a": ("X", "x"), "c": ("X",)}, {"X": "X", "x": "x"}),  # only some list x
        ({"a": ("X", "x"), "b": ("x", "X")}, {"X": "X", "x": "X"}),  # b's pages are x's
    ],
    ids=["alike", "another-first-name", "some-list-it", "another-order"],
)
def test_an_alias_is_matched_under_the_first_name_only_when_listed_alike(
    names: dict[str, tuple[str, ...]], matched_under: dict[str, str]
) -> None:
    """What docs/router.md ("Model pools") says of aliases: a request is matched under one name,
    its workers' first name only when that name has exactly the alias's workers, so a worker
    gets KV matching only when its own first name (its events' namespace) is that name."""
    pool = WorkerPool(BreakerConfig())
    pool.add(WorkerConfig(url="http://127.0.0.1:9", id="other", model="Y"))  # several models
    for i, (wid, served) in enumerate(names.items()):
        pool.add(WorkerConfig(url=f"http://127.0.0.1:{i + 1}", id=wid, models=served))
    assert {name: pool.resolve(name).cache_model for name in matched_under} == matched_under
