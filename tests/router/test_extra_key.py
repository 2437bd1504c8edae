"""A caller's `extra_key` isolates the worker's cache but is on no KV event: no event-based hit.

SGLang keys its radix cache by (extra_key, cache_salt) and publishes only the salt, so the
index cannot know whether pages shown by events were stored under the request's extra_key.
Predicting them would be a false hit (the issue measured: predicted 688, cached 0). Such a
request gets no event-based hit; pending marks made under its full key still steer its
siblings to the worker that just took it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest

from indexer import service
from indexer.namespace import Namespace, namespace_seed, request_keys
from router.config import IndexerSection
from router.routing.planner import unindexed_reason
from router.service import RouterService
from tests.router.conftest import AUTH, Fleet, eventually, one_worker_fleet, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_an_extra_key_request_is_never_predicted_from_events(fleet: Fleet) -> None:
    prompt = "A shared system prompt long enough for several pages. " * 6
    plain = {"prompt": prompt, "max_tokens": 1}
    _, headers, _ = await fleet.post("/v1/completions", plain)
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(plain, holder, 256), what="the prompt indexed")

    for key in ("tenant-view-1", "tenant-view-2"):
        body = {**plain, "extra_key": key}
        plan = await fleet.route(body)
        assert plan["unindexed"] == "extra_key"
        assert all(c["matched_tokens"] == 0 for c in plan["candidates"])
        status, headers, answer = await fleet.post("/v1/completions", body)
        assert status == 200
        # what the router predicted is what the worker reused: nothing (its own namespace)
        assert int(headers["x-kvroute-matched-tokens"]) == 0 == cached(answer)

    # a sibling with the same extra_key follows the first one through its pending marks
    body = {**plain, "extra_key": "tenant-view-1", "prompt": prompt + "second question"}
    first = {**plain, "extra_key": "tenant-view-3"}
    _, first_headers, _ = await fleet.post("/v1/completions", first)
    _, headers, answer = await fleet.post("/v1/completions", {**body, "extra_key": "tenant-view-3"})
    assert headers["x-kvroute-worker"] == first_headers["x-kvroute-worker"]
    assert int(headers["x-kvroute-matched-tokens"]) == 0
    assert int(headers["x-kvroute-pending-tokens"]) > 0 and cached(answer) > 0

    async with fleet.session.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvroute_unindexed_requests_total{reason="extra_key"} 4.0' in text


@pytest.mark.parametrize("layout", ["map", "array"])
async def test_an_adapters_pages_are_predicted_to_it_alone(layout: str) -> None:
    """The reference worker keeps an adapter's pages apart and names the adapter on its events
    as SGLang does (0.5.23's map layout by name, the array layout by a number, which no request
    names): the router predicts them to the adapter alone, never to the base model, also after
    an extra_key request of the adapter (it had predicted a plain request 656 tokens the worker
    did not hold, the adapter's pages filed as the base model's)."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, event_format=layout)  # type: ignore[arg-type]
    async with one_worker_fleet(cfg) as fleet:
        prompt = "An adapter's own system prompt, long enough for several pages. " * 6
        adapter = {"prompt": prompt, "max_tokens": 1, "lora_path": "sql", "cache_salt": "t"}
        await fleet.post("/v1/completions", adapter)
        if layout == "map":
            await eventually(lambda: fleet.holds(adapter, "w0", 256), what="the adapter's pages")
        _, headers, answer = await fleet.post("/v1/completions", adapter)
        predicted = int(headers["x-kvroute-matched-tokens"])
        assert predicted == (cached(answer) if layout == "map" else 0)
        assert cached(answer) >= 256
        # an extra_key request of the adapter: its pages come as the adapter's plain ones
        publisher = fleet.workers["w0"].ranks[0].publisher
        published = publisher.next_seq
        await fleet.post("/v1/completions", {**adapter, "extra_key": "view"})
        assert publisher.next_seq > published  # it stored pages of its own: events came

        async def all_applied() -> bool:  # every batch the worker published, its included
            _, streams = await fleet.admin("GET", "/streams")
            last = {s["stream"]: s["last_seq"] for s in streams["streams"]}
            return bool(last["w0#dp0"] == publisher.next_seq - 1)

        await eventually(all_applied, what="the extra_key request's events in the index")
        plain = {k: v for k, v in adapter.items() if k != "lora_path"}
        status, headers, answer = await fleet.post("/v1/completions", plain)
        assert status == 200
        assert int(headers["x-kvroute-matched-tokens"]) == 0 == cached(answer)


async def test_an_adapters_hit_is_predicted_with_the_default_event_format(fleet: Fleet) -> None:
    """A worker of the default config publishes SGLang 0.5.23's layout (the adapter by its
    `lora_name`, `lora_id` None), so the router predicts an adapter's hit as the worker reuses
    it (with the array layout as the default it predicted 0 while the worker reused 36 of 40
    tokens: `kvroute up` and the benchmarks never predicted a LoRA hit)."""
    assert ReferenceConfig().event_format == "map"
    body: dict[str, Any] = {"input_ids": list(range(70, 134)), "lora_path": "ad"}
    body["sampling_params"] = {"max_new_tokens": 1}
    _, headers, _ = await fleet.post("/generate", body)
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(body, holder, 48), 3.0, "the adapter's pages indexed")
    status, headers, answer = await fleet.post("/generate", body)
    assert status == 200
    assert int(headers["x-kvroute-matched-tokens"]) == answer["meta_info"]["cached_tokens"] == 48


async def test_a_bad_extra_key_is_a_400_naming_it(fleet: Fleet) -> None:
    status, _, answer = await fleet.post("/v1/completions", {"prompt": "x", "extra_key": 7})
    assert status == 400 and "extra_key" in answer["error"]["message"]


def test_the_extra_key_is_a_namespace_of_its_own_and_changes_no_other_key() -> None:
    tokens = list(range(64))
    base = Namespace("m", "lora-a", "salt")
    assert Namespace("m", "lora-a", "salt", "") == base  # "" means none, as on the worker
    keyed = Namespace("m", "lora-a", "salt", "view")
    assert request_keys(keyed, tokens, 16) != request_keys(base, tokens, 16)
    # the pieces never run into each other: (salt "a", key "b") is not (salt "ab") or swapped
    seeds = {
        namespace_seed(Namespace("m", None, "a", "b"), 16),
        namespace_seed(Namespace("m", None, "ab"), 16),
        namespace_seed(Namespace("m", None, "b", "a"), 16),
        namespace_seed(Namespace("m", None, None, "ab"), 16),
    }
    assert len(seeds) == 4


@pytest.mark.parametrize(
    ("namespace", "reason"),
    [
        (Namespace("m", None, "salt"), None),
        # the engine appends a LoRA's id to extra_key itself and publishes the adapter's name:
        # an adapter alone keeps its hits through the lora part of the namespace
        (Namespace("m", "adapter", "salt"), None),
        (Namespace("m", "adapter", None, "caller-key"), "extra_key"),
    ],
)
def test_only_the_callers_own_extra_key_turns_event_hits_off(
    namespace: Namespace, reason: str | None
) -> None:
    assert unindexed_reason(namespace) == reason


async def test_pages_stored_for_an_extra_key_are_not_a_plain_requests_hit(fleet: Fleet) -> None:
    """The events of a page stored for an `extra_key` look like a plain page of its salt: a
    plain request of that salt must not be predicted to reuse it (the worker keeps the two
    apart). Measured before the fix: predicted 320, cached 0."""
    prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
    keyed = {"input_ids": prompt, "cache_salt": "tenant-a", "extra_key": "view-1"}
    # its events came in, and the index holds its pages as plain ones of the salt
    await _sent_and_stored_as_plain(fleet, keyed, prompt, "tenant-a")

    plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
    plan = await fleet.route(plain)
    assert plan["unindexed"] is None
    assert all(c["matched_tokens"] == 0 for c in plan["candidates"]), plan["candidates"]
    status, headers, answer = await fleet.post("/generate", plain)
    assert status == 200
    assert int(headers["x-kvroute-matched-tokens"]) == 0 == answer["meta_info"]["cached_tokens"]

    # another salt's plain request is not shadowed by it; the same salt's is predicted no
    # more than the worker reuses, a plain copy there or not
    other = {"input_ids": prompt, "cache_salt": "tenant-b"}
    await fleet.post("/generate", other)
    await fleet.post("/generate", other)

    async def other_predicted() -> bool:  # once its events came in (a loaded CI is slower)
        plan = await fleet.route(other)
        return bool(max(c["matched_tokens"] for c in plan["candidates"]) > 0)

    await eventually(other_predicted, what="the other salt's plain pages predicted")
    for rid in ("again", "third"):
        status, headers, answer = await fleet.post("/generate", {**plain, "rid": rid})
        predicted = int(headers["x-kvroute-matched-tokens"])
        assert status == 200 and predicted <= answer["meta_info"]["cached_tokens"]
        await asyncio.sleep(0.2)  # its events


async def test_an_extra_key_request_hides_only_what_it_may_have_stored() -> None:
    """QA (shadow_test.sh): a plain prompt hit 624 tokens; one extra_key request whose prompt
    shared only its first page (a chat template's header) went to the same rank, and the plain
    prompt was then predicted 0 there for an hour while the worker still reused 624. Now the
    extra_key's shadow covers its own blocks: the plain prompt keeps its hit."""
    async with one_worker_fleet() as fleet:
        prompt = [(i * 11) % 200 + 5 for i in range(39 * 16 + 1)]
        plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
        await fleet.post("/generate", plain)
        await eventually(lambda: fleet.holds(plain, "w0", 624), what="the plain prompt indexed")
        keyed_prompt = prompt[:16] + [(i * 7) % 200 + 5 for i in range(10 * 16 + 1)]
        keyed = {"input_ids": keyed_prompt, "cache_salt": "tenant-a", "extra_key": "ek9"}
        await _sent_and_stored_as_plain(fleet, keyed, keyed_prompt, "tenant-a")
        status, headers, answer = await fleet.post("/generate", {**plain, "rid": "after"})
        assert status == 200
        assert int(headers["x-kvroute-matched-tokens"]) == 624 == cached_tokens(answer)
        # the extra_key's own prompt, sent plain: only the page the plain tree holds too
        status, headers, answer = await fleet.post(
            "/generate", {"input_ids": keyed_prompt, "cache_salt": "tenant-a"}
        )
        assert int(headers["x-kvroute-matched-tokens"]) == 16 == cached_tokens(answer)


async def test_a_dry_run_names_the_shadow_that_cuts_a_match() -> None:
    """Review: the shadow usually cuts a plain match to what the plain tree surely holds rather
    than hiding it whole, and /admin/route named only a shadow that hid everything: a cut
    candidate showed fewer tokens with no reason (as if they were evicted)."""
    async with one_worker_fleet() as fleet:
        prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
        plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
        await fleet.post("/generate", plain)
        await eventually(lambda: fleet.holds(plain, "w0", 320), what="the plain prompt indexed")
        # the extra_key's prompt is the first 10 pages: its tail is page 10, and what the
        # worker stores after it (its output) may be on the plain chain: cut to 160
        keyed = {"input_ids": prompt[: 10 * 16 + 5], "cache_salt": "tenant-a", "extra_key": "k"}
        status, _, _ = await fleet.post("/generate", keyed)
        assert status == 200

        async def cut() -> bool:
            plan = await fleet.route(plain)
            return bool(plan["candidates"][0]["matched_tokens"] == 160)

        await eventually(cut, what="the extra_key's copies stored: the plain match cut")
        (candidate,) = (await fleet.route(plain))["candidates"]
        assert candidate["hidden"] == "extra_key shadow"
        why = candidate["admission"]["why"]
        assert why.startswith("160 more tokens of this prompt that its entries hold are hidden")
        indexer = fleet.router.planner.indexer
        plain_ns = Namespace(fleet.router.planner.pool.get("w0").cache_model, None, "tenant-a")
        assert indexer.shadow_hidden(plain_ns, prompt, 320) == {
            s: 160 for s in indexer.stream_ids("w0")
        }


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["meta_info"]["cached_tokens"])


@pytest.mark.parametrize("extra_key", [[None, "k1"], "k1"], ids=["per-item", "for-all"])
async def test_every_item_of_a_batch_with_an_extra_key_shadows_its_prompt(
    fleet: Fleet, extra_key: object
) -> None:
    """A batch's items each store their prompt under their own extra_key: the events show each
    as a plain page of its salt. Only the first item's was shadowed: a plain request for the
    second was predicted 304 tokens the worker had cached for the extra_key (cached 0)."""
    a = [(i * 7) % 200 + 5 for i in range(20 * 16 + 1)]
    b = [(i * 13) % 200 + 5 for i in range(20 * 16 + 1)]
    batch = {"input_ids": [a, b], "cache_salt": "tenant-a", "extra_key": extra_key}
    holder = await _sent_and_stored_as_plain(fleet, batch, b, "tenant-a")
    plain = {"input_ids": b, "cache_salt": "tenant-a"}
    plan = await fleet.route(plain)
    held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
    assert held[holder] == 0


MODEL = "kvroute/reference-byte-lm"  # what the reference worker serves


@pytest.mark.parametrize(
    ("endpoint", "batch", "lora"),
    [
        # item 1 names no adapter of its own: the base model's pages, not item 0's adapter's
        ("/generate", {"lora_path": ["ad", ""], "extra_key": [None, "k1"]}, None),
        ("/generate", {"lora_path": ["ad", None], "extra_key": "k1"}, None),
        # the model's adapter wins over lora_path for every item (SGLang's OpenAI routes)
        (
            "/v1/completions",
            {"model": f"{MODEL}:ad", "lora_path": ["x", "y"], "extra_key": [None, "k1"]},
            "ad",
        ),
    ],
    ids=["base-item", "base-item-key-for-all", "model-adapter"],
)
async def test_a_batch_items_shadow_is_in_the_adapter_the_worker_stores_it_under(
    fleet: Fleet, endpoint: str, batch: dict[str, Any], lora: str | None
) -> None:
    """QA: an item with an extra_key was shadowed under another adapter than the worker
    stored it under (one naming none took the first item's; on an OpenAI route its
    `lora_path` won over the model's adapter), and a plain request of its namespace was
    predicted the extra_key's pages: 288 tokens, 0 cached."""
    a = [(i * 7) % 200 + 5 for i in range(20 * 16 + 1)]
    b = [(i * 13) % 200 + 5 for i in range(20 * 16 + 1)]
    field = "input_ids" if endpoint == "/generate" else "prompt"
    body = {**batch, field: [a, b], "cache_salt": "tenant-a"}
    if endpoint != "/generate":
        body["max_tokens"] = 1
    status, headers, _ = await fleet.post(endpoint, body)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    indexer = fleet.router.planner.indexer
    (stream,) = indexer.stream_ids(holder)
    model = fleet.router.planner.pool.get(holder).cache_model
    plain_ns = Namespace(model, lora, "tenant-a")

    async def stored() -> bool:  # item 1's pages, plain ones of its namespace to the events
        keys = indexer.block_keys(stream, plain_ns, b)
        return bool(keys) and all(indexer.index.holds(stream, keys))

    await eventually(stored, what="the extra_key item's pages in the index as plain ones")
    plain: dict[str, Any] = {field: b, "cache_salt": "tenant-a"}
    if endpoint != "/generate":
        plain.update(model=batch["model"], max_tokens=1)
    plan = await fleet.route(plain, endpoint)
    held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
    assert held[holder] == 0, plan["candidates"]
    status, headers, answer = await fleet.post(endpoint, plain)
    assert status == 200
    worker_cached = cached_tokens(answer) if endpoint == "/generate" else cached(answer)
    assert int(headers["x-kvroute-matched-tokens"]) == 0 == worker_cached


async def _sent_and_stored_as_plain(
    fleet: Fleet, body: dict[str, Any], prompt: list[int], salt: str
) -> str:
    """Send `body` to /generate; once the index holds `prompt`'s pages as plain pages of
    `salt` on the worker it went to (its events came in), that worker."""
    status, headers, _ = await fleet.post("/generate", body)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    indexer = fleet.router.planner.indexer
    (stream,) = indexer.stream_ids(holder)
    model = fleet.router.planner.pool.get(holder).cache_model
    plain_ns = Namespace(model, None, salt)

    async def stored() -> bool:
        keys = indexer.block_keys(stream, plain_ns, prompt)
        return bool(keys) and all(indexer.index.holds(stream, keys))

    await eventually(stored, what="the extra_key pages in the index as plain ones")
    return str(holder)


async def _dump(fleet: Fleet) -> bytes:
    async with fleet.session.get(fleet.url + "/admin/index/dump", headers=AUTH) as resp:
        assert resp.status == 200
        return await resp.read()


async def _load(fleet: Fleet, data: bytes) -> None:
    url = fleet.url + "/admin/index/load"
    async with fleet.session.post(url, data=data, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_router_that_loads_a_dump_keeps_its_extra_key_shadows() -> None:
    """A snapshot carried no shadows: a router that loaded another's dump (or a replica that
    started from the cluster's snapshot with no other replica left to send them again)
    predicted an `extra_key` request's pages, plain ones to its events, to a plain request of
    its salt. On the old code: predicted 320 tokens, cached 0."""
    async with one_worker_fleet() as fleet:
        prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
        keyed = {"input_ids": prompt, "cache_salt": "tenant-a", "extra_key": "view-1"}
        await _sent_and_stored_as_plain(fleet, keyed, prompt, "tenant-a")
        plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
        assert all(c["matched_tokens"] == 0 for c in (await fleet.route(plain))["candidates"])
        data = await _dump(fleet)

        config = router_config([("w0", fleet.workers["w0"].url)])
        async with RouterService(config) as router:
            fresh = Fleet(router, fleet.workers, fleet.session)
            await fresh.warm()
            # started afresh, it replayed the worker's history: the extra_key's pages are
            # plain ones to it (the gap a router without the dump keeps, documented)
            await eventually(lambda: fresh.holds(plain, "w0", 320), what="the replayed pages")
            await _load(fresh, data)

            async def proven() -> bool:  # a loaded stream predicts once its fence is proven
                _, streams = await fresh.admin("GET", "/streams")
                return all(s["state"] == "synced" for s in streams["streams"])

            await eventually(proven, what="the loaded stream proven")
            other = {"input_ids": prompt, "cache_salt": "tenant-b"}
            await fresh.post("/generate", other)
            # the other salt's plain copy is predicted (the load did not hide the stream)...
            await eventually(lambda: fresh.holds(other, "w0", 320), what="the other salt's pages")
            # ...and the salt of the extra_key's request is predicted what the worker reuses
            plan = await fresh.route(plain)
            assert all(c["matched_tokens"] == 0 for c in plan["candidates"]), plan["candidates"]
            status, headers, answer = await fresh.post("/generate", plain)
            assert status == 200
            assert int(headers["x-kvroute-matched-tokens"]) == 0 == cached_tokens(answer)


async def _found_a_new_process(fleet: Fleet) -> None:
    """Until w0's stream has found its publisher a new process (a restart counted) and is
    synced again, and the worker is ready again. The shadows are judged by a batch applied
    synced; one applied while the stream still proves or rebuilds proves nothing, and when the
    request's store was all the new process published, a loaded machine (CI) left them
    standing (the tests sent it at once and failed there about half the time beside two busy
    loops). A health check made while the old process was gone marks the worker unhealthy
    until the next one passes: a request sent before then is a 503 (CI, once)."""

    async def found() -> bool:
        _, streams = await fleet.admin("GET", "/streams")
        rows = streams["streams"]
        return bool(rows) and all(r["state"] == "synced" and r["restarts"] >= 1 for r in rows)

    async def ready() -> bool:
        _, listed = await fleet.admin("GET", "/workers")
        return all(w["status"] == "ready" for w in listed["workers"])

    await eventually(found, what="the stream synced after finding a new process")
    await eventually(ready, what="the worker ready again after its restart")


def _ports_of(worker: ReferenceWorker) -> dict[str, int]:
    """What a new process of `worker` binds to be it again: its HTTP, events and replay ports."""
    return {
        "port": int(worker.url.rstrip("/").rsplit(":", 1)[1]),
        "events_port": worker.kv_events.endpoint_port_base,
        "replay_port": worker.kv_events.replay_endpoint_port_base,
    }


async def _keyed_after_a_run(fleet: Fleet, plain: dict[str, Any]) -> dict[str, Any]:
    """Six batches of other salts (this process's seq runs ahead of a next one's), then
    `plain` sent with an extra_key, its pages in the index as plain ones; that request."""
    for n in range(6):
        await fleet.post("/generate", {**plain, "cache_salt": f"other-{n}"})
    keyed = {**plain, "extra_key": "view-1"}
    await _sent_and_stored_as_plain(fleet, keyed, plain["input_ids"], plain["cache_salt"])
    return keyed


async def test_a_loaded_dumps_shadows_go_when_the_worker_is_a_new_process() -> None:
    """The shadows a dump kept covered the cache of the process it followed: a worker
    restarted since (a new process on the same ports, its batches numbered from 0 again) holds
    none of those pages, and its own plain pages of the prompt are predicted as it reuses
    them (kept, they would be predicted nothing until they lapsed: a missed hit an hour)."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
    plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
    async with one_worker_fleet(cfg) as fleet:
        first = fleet.workers["w0"]
        ports = _ports_of(first)
        await _keyed_after_a_run(fleet, plain)
        data = await _dump(fleet)
    async with one_worker_fleet(msgspec.structs.replace(cfg, **ports)) as fleet:
        await _load(fleet, data)
        await _found_a_new_process(fleet)
        # the new process stores the prompt plain: its first batch after the load, applied
        # synced, shows it is not the process the dump followed
        status, _, _ = await fleet.post("/generate", plain)
        assert status == 200
        await eventually(lambda: fleet.holds(plain, "w0", 320), what="the plain pages predicted")
        status, headers, answer = await fleet.post("/generate", {**plain, "rid": "again"})
        assert status == 200
        assert int(headers["x-kvroute-matched-tokens"]) == 320 == cached_tokens(answer)


async def test_a_restarted_workers_extra_key_shadows_go_with_the_process_that_stored_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shadows of an `extra_key` request's pages cover the process that stored them: the
    worker restarted (a new process on the same ports, its batches numbered from 0 again)
    holds none of those pages, and the prompt it then stores plain is predicted as it reuses
    it. Before, the shadows stayed while the stream held their keys: the new process's plain
    pages of the prompt were predicted nothing for as long as the prompt stayed hot (on the
    old code: predicted 0, cached 320, for good). Shadows marked within `RESTART_DOUBT_S` of
    the restart stay (their requests may have reached the new process): shortened here."""
    monkeypatch.setattr(service, "RESTART_DOUBT_S", 1.0)
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
    plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
    async with one_worker_fleet(cfg) as fleet, contextlib.AsyncExitStack() as stack:
        first = fleet.workers["w0"]
        ports = _ports_of(first)
        keyed = await _keyed_after_a_run(fleet, plain)
        await asyncio.sleep(1.1)  # marked before the doubt
        await first.__aexit__(None, None, None)
        second = ReferenceWorker(msgspec.structs.replace(cfg, **ports))
        fleet.workers["w0"] = await stack.enter_async_context(second)
        await _found_a_new_process(fleet)
        # its first batch applied synced, numbered behind the old process's last, judges
        status, _, answer = await fleet.post("/generate", plain)
        assert status == 200 and cached_tokens(answer) == 0  # a new process: nothing cached
        await eventually(lambda: fleet.holds(plain, "w0", 320), what="the plain pages predicted")
        status, headers, answer = await fleet.post("/generate", {**plain, "rid": "again"})
        assert status == 200
        assert int(headers["x-kvroute-matched-tokens"]) == 320 == cached_tokens(answer)
        # the extra_key's own request is still never predicted from events
        status, headers, _ = await fleet.post("/generate", {**keyed, "rid": "keyed-again"})
        assert status == 200 and int(headers["x-kvroute-matched-tokens"]) == 0


async def test_a_loaded_dump_keeps_the_copies_that_tell_a_plain_page_apart() -> None:
    """A prompt sent plain and with an `extra_key`: the worker holds two copies of each page,
    one of them plain, and the plain request is predicted its whole hit. A dump did not keep
    how many copies each page has: the router that loaded it predicted the plain prompt
    nothing until the worker stored its copies again (a missed hit; 0 of 320 on the old
    code)."""
    async with one_worker_fleet() as fleet:
        prompt = [(i * 13) % 200 + 5 for i in range(20 * 16 + 1)]
        plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
        await fleet.post("/generate", plain)
        await eventually(lambda: fleet.holds(plain, "w0", 320), what="the plain pages")
        keyed = {**plain, "extra_key": "view-1"}
        status, _, _ = await fleet.post("/generate", keyed)
        assert status == 200
        indexer = fleet.router.planner.indexer
        (stream,) = indexer.stream_ids("w0")

        async def copied() -> bool:  # the extra_key's copies are in: each page held twice
            return len(indexer.index.extra_copies(stream)) >= 20

        await eventually(copied, what="the extra_key's copies stored")
        assert await fleet.holds(plain, "w0", 320)
        data = await _dump(fleet)

        async with RouterService(router_config([("w0", fleet.workers["w0"].url)])) as router:
            fresh = Fleet(router, fleet.workers, fleet.session)
            await fresh.warm()
            await _load(fresh, data)
            await eventually(lambda: fresh.holds(plain, "w0", 320), what="the plain hit")
            status, headers, answer = await fresh.post("/generate", {**plain, "rid": "again"})
            assert status == 200
            assert int(headers["x-kvroute-matched-tokens"]) == 320 == cached_tokens(answer)
            # the extra_key's own prompt, sent plain, is still told apart
            keyed_only = [(i * 17) % 200 + 5 for i in range(20 * 16 + 1)]
            only = {"input_ids": keyed_only, "cache_salt": "tenant-a", "extra_key": "view-2"}
            await _sent_and_stored_as_plain(fresh, only, keyed_only, "tenant-a")
            status, headers, answer = await fresh.post(
                "/generate", {"input_ids": keyed_only, "cache_salt": "tenant-a"}
            )
            assert int(headers["x-kvroute-matched-tokens"]) == 0 == cached_tokens(answer)


@pytest.mark.parametrize("when", ["configured", "added after the load"])
async def test_a_dump_loaded_where_the_worker_has_another_id_keeps_its_shadows(when: str) -> None:
    """QA: the dump's shadows stayed under the dumping router's stream id (`w0#dp0`): a router
    that calls the same server `wx` (or adds it later through the admin API under that id)
    predicted the extra_key's pages to a plain request (320 tokens, 0 cached). A shadow is of
    the server's cache: it goes with the server the stream followed, as a renamed worker's."""
    async with one_worker_fleet() as fleet:
        prompt = [(i * 11) % 200 + 5 for i in range(20 * 16 + 1)]
        keyed = {"input_ids": prompt, "cache_salt": "tenant-a", "extra_key": "view-1"}
        await _sent_and_stored_as_plain(fleet, keyed, prompt, "tenant-a")
        data = await _dump(fleet)
        url = fleet.workers["w0"].url
        workers = [("wx", url)] if when == "configured" else []
        async with RouterService(router_config(workers)) as router:
            fresh = Fleet(router, {"wx": fleet.workers["w0"]}, fleet.session)
            if when == "configured":
                await fresh.warm()
            await _load(fresh, data)
            if when != "configured":
                status, answer = await fresh.admin("POST", "/workers", {"id": "wx", "url": url})
                assert status in (201, 202), answer
                await fresh.warm()
            plain = {"input_ids": prompt, "cache_salt": "tenant-a"}
            other = {"input_ids": prompt, "cache_salt": "tenant-b"}
            await fresh.post("/generate", other)
            # its events are in (the other salt's copy predicted), the plain one still hidden
            await eventually(lambda: fresh.holds(other, "wx", 320), what="the other salt's pages")
            assert not await fresh.holds(plain, "wx", 16)
            status, headers, answer = await fresh.post("/generate", plain)
            assert status == 200
            assert int(headers["x-kvroute-matched-tokens"]) == 0 == cached_tokens(answer)


async def _clears(fleet: Fleet) -> int:
    """How many times w0's stream had its entries dropped wholesale."""
    _, streams = await fleet.admin("GET", "/streams")
    (row,) = streams["streams"]
    return int(row["clears"])


@pytest.mark.parametrize("loss", ["flush", "restart"])
async def test_a_keyed_requests_pending_marks_go_when_its_worker_loses_its_cache(
    loss: str,
) -> None:
    """An `extra_key` request's pending marks steer its siblings to the worker that took it,
    and no event takes them back (none shows its pages). A flush or a restart of the worker
    dropped the stream's entries and left the marks: until they lapsed the same request was
    predicted its whole prompt pending there, 0 cached (QA: 256 tokens, at the default 2 s).
    A clear drops them now (they live 60 s here: past the test on the code before)."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    prompt = [(i * 7) % 200 + 5 for i in range(20 * 16 + 1)]
    keyed = {"input_ids": prompt, "cache_salt": "tenant-a", "extra_key": "view-1"}
    ttl = IndexerSection(pending_ttl_s=60.0)
    async with one_worker_fleet(cfg, indexer=ttl) as fleet, contextlib.AsyncExitStack() as stack:
        first = fleet.workers["w0"]
        status, _, answer = await fleet.post("/generate", keyed)
        assert status == 200 and cached_tokens(answer) == 0
        (before,) = (await fleet.route(keyed))["candidates"]
        assert before["pending_tokens"] == 320  # what steers its siblings there

        if loss == "flush":
            # counted from here: a stall of a loaded machine may have had the stream cleared
            # and rebuilt already
            clears = await _clears(fleet)
            async with fleet.session.post(first.url + "/flush_cache") as resp:
                assert resp.status == 200

            async def cleared() -> bool:
                return await _clears(fleet) > clears

            await eventually(cleared, what="the flush applied")
        else:
            ports = _ports_of(first)
            await first.__aexit__(None, None, None)
            second = ReferenceWorker(msgspec.structs.replace(cfg, **ports))
            fleet.workers["w0"] = await stack.enter_async_context(second)
            await _found_a_new_process(fleet)
        (after,) = (await fleet.route(keyed))["candidates"]
        assert after["pending_tokens"] == 0, after
        status, headers, answer = await fleet.post("/generate", {**keyed, "rid": "again"})
        assert status == 200
        assert int(headers["x-kvroute-pending-tokens"]) == 0 == cached_tokens(answer)


@pytest.mark.parametrize("removal", ["salt_flush", "eviction"])
async def test_a_keyed_requests_pending_marks_go_with_the_pages_its_worker_removes(
    removal: str,
) -> None:
    """No event takes an `extra_key` request's pending marks back, so a worker that removed
    its pages (its own flush of the salt, or an LRU eviction) within the TTL was predicted
    them pending, 0 cached (QA: 144 tokens). A removal of the plain pages they stand for drops
    them from the block it took on: here the eviction of one prompt's own leaf leaves the
    prefix it shares with its sibling marked, as the worker keeps it."""
    head = [(i * 7) % 200 + 5 for i in range(10 * 16)]
    first, second = (
        {
            "input_ids": head + [start + i for i in range(10 * 16 + 1)],
            "cache_salt": "tenant-a",
            "extra_key": "view-1",
            "sampling_params": {"max_new_tokens": 1},
        }
        for start in (300, 600)
    )
    # 40 pages: the two prompts (30) and a plain one of 10 evict the older leaf (10 pages)
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, capacity_tokens=640)
    ttl = IndexerSection(pending_ttl_s=60.0)  # past the test: only a removal drops them
    async with one_worker_fleet(cfg, indexer=ttl) as fleet:
        for body in (first, second):
            status, _, _ = await fleet.post("/generate", body)
            assert status == 200
        (before,) = (await fleet.route(first))["candidates"]
        assert before["pending_tokens"] == 320
        if removal == "salt_flush":
            url = fleet.workers["w0"].url + "/flush_cache"
            async with fleet.session.post(url, json={"cache_salt": "tenant-a"}) as resp:
                assert resp.status == 200
            kept = 0
        else:
            plain = {"input_ids": list(range(1000, 1160)), "cache_salt": "tenant-a"}
            status, _, _ = await fleet.post("/generate", plain)
            assert status == 200
            kept = 160

        async def dropped() -> bool:
            (row,) = (await fleet.route(first))["candidates"]
            return int(row["pending_tokens"]) < 320

        await eventually(dropped, what="the removal applied")
        (after,) = (await fleet.route(first))["candidates"]
        assert after["pending_tokens"] == kept, after
        status, headers, answer = await fleet.post("/generate", {**first, "rid": "again"})
        assert status == 200
        assert int(headers["x-kvroute-pending-tokens"]) == kept == cached_tokens(answer)


@pytest.mark.parametrize("keyed", [True, False])
async def test_a_request_of_an_adapter_is_not_marked_where_events_number_adapters(
    keyed: bool,
) -> None:
    """An array-layout worker (SGLang <= 0.5.19) names an adapter by number: the pages of a
    request of adapter `sql` came under `anonymous_lora(id)`, so an `extra_key` request's
    marks were tied to the name's pages and no removal dropped them (QA, critical: 160 tokens
    predicted after the worker flushed the salt, 0 cached), and a plain request's were never
    taken back by their store. Once its events number adapters, no such mark stands there:
    the request is predicted nothing, as the worker gives after the flush."""
    cfg = ReferenceConfig(time_scale=0.0, page_size=16, event_format="array")
    body: dict[str, Any] = {
        "input_ids": [(i * 7) % 200 + 5 for i in range(10 * 16 + 1)],
        "cache_salt": "tenant-a",
        "lora_path": "sql",
        "sampling_params": {"max_new_tokens": 1},
    }
    if keyed:
        body["extra_key"] = "view-1"
    ttl = IndexerSection(pending_ttl_s=60.0)
    async with one_worker_fleet(cfg, indexer=ttl) as fleet:
        status, _, _ = await fleet.post("/generate", body)
        assert status == 200

        async def numbered() -> bool:
            (row,) = (await fleet.route(body))["candidates"]
            return int(row["pending_tokens"]) == 0

        await eventually(numbered, what="its pages' events applied")
        url = fleet.workers["w0"].url + "/flush_cache"
        async with fleet.session.post(url, json={"cache_salt": "tenant-a"}) as resp:
            assert resp.status == 200
        status, headers, answer = await fleet.post("/generate", {**body, "rid": "again"})
        assert status == 200
        assert int(headers["x-kvroute-pending-tokens"]) == 0 == cached_tokens(answer)
