"""End to end on 127.0.0.1: reference workers publishing KV events, the real indexer, the router.

These are the issue's acceptance tests: namespace isolation between tenants, conversation
affinity, dry runs whose numbers match the workers' cached_tokens, eviction (index and workers).
"""

from __future__ import annotations

import contextlib
from typing import Any

import aiohttp
import openai

from router.config import BreakerConfig, IndexerSection, TimeoutsConfig
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

SYSTEM = "You are the support assistant of ACME. " * 12  # ~470 tokens, 29 pages


def _chat(salt: str | None, *turns: str, max_tokens: int = 4) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": t} for t in turns]
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": max_tokens}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_tenants_sharing_a_system_prompt_never_hit_each_other(fleet: Fleet) -> None:
    a = _chat("tenant-a", "hello")
    status, headers, answer = await fleet.post("/v1/chat/completions", a)
    assert status == 200 and _cached(answer) == 0
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(a, holder, 400), what="tenant a's prefix indexed")

    b = _chat("tenant-b", "hello")
    plan = await fleet.route(b)
    assert all(c["matched_tokens"] == 0 and c["pending_tokens"] == 0 for c in plan["candidates"])
    plan_a = await fleet.route(a)
    assert plan["namespace"] != plan_a["namespace"]
    # force tenant b onto the very worker that caches tenant a's identical tokens
    other = next(w for w in fleet.workers if w != holder)
    status, _ = await fleet.admin("POST", f"/workers/{other}/drain")
    assert status == 200
    status, headers, answer = await fleet.post("/v1/chat/completions", b)
    assert status == 200 and headers["x-kvroute-worker"] == holder
    assert headers["x-kvroute-matched-tokens"] == "0" and headers["x-kvroute-pending-tokens"] == "0"
    assert _cached(answer) == 0  # and the worker agrees: no sharing across salts
    # tenant a still hits its own prefix there
    status, headers, answer = await fleet.post("/v1/chat/completions", a)
    assert int(headers["x-kvroute-matched-tokens"]) == _cached(answer) >= 400
    # unsalted traffic is its own namespace too
    plain = await fleet.route(_chat(None, "hello"))
    assert all(c["matched_tokens"] == 0 for c in plain["candidates"])


async def test_a_repeated_conversation_returns_to_its_worker(fleet: Fleet) -> None:
    first = _chat("t", "What is the refund policy?")
    status, headers, answer = await fleet.post("/v1/chat/completions", first)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(first, holder, 400), what="first turn indexed")
    follow_up = _chat("t", "What is the refund policy?", "And for digital goods?")
    for _ in range(4):  # every later turn, from either worker's view, goes back to the holder
        status, headers, answer = await fleet.post("/v1/chat/completions", follow_up)
        assert status == 200
        assert headers["x-kvroute-worker"] == holder
        assert _cached(answer) >= 400


async def test_dry_run_numbers_match_the_workers_cached_tokens(fleet: Fleet) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 10
    warm = {"prompt": text, "max_tokens": 2}
    status, headers, _ = await fleet.post("/v1/completions", warm)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(warm, holder, 400), what="prefix indexed")

    probe = {**warm, "prompt": text + "Then it sleeps."}
    runs: list[dict[str, Any]] = []

    async def two_dry_runs_with_no_event_between() -> bool:
        # a late event (a warm-up poke's store, say) changes what a worker holds between two
        # dry runs; only a pair with the index unchanged around it says what a dry run does
        before = await _last_seqs(fleet)
        runs[:] = [await fleet.route(probe), await fleet.route(probe)]
        return await _last_seqs(fleet) == before

    await eventually(two_dry_runs_with_no_event_between, what="two dry runs with no event")
    plan, again = runs
    assert plan == again  # a dry run changes nothing (no pending entries, no load, no policy)
    assert plan["worker"] == holder
    assert plan["prompt_tokens"] == len((text + "Then it sleeps.").encode())
    assert {c["worker"] for c in plan["candidates"]} == {"w0", "w1"}
    chosen = plan["candidates"][0]
    assert chosen["worker"] == holder and chosen["healthy"]
    assert chosen["matched_tokens"] == chosen["matched_blocks"] * 16 > 0

    status, headers, answer = await fleet.post("/v1/completions", probe)
    assert status == 200
    assert headers["x-kvroute-worker"] == plan["worker"]
    assert int(headers["x-kvroute-matched-tokens"]) == chosen["matched_tokens"]
    assert _cached(answer) == chosen["matched_tokens"]


async def test_generate_with_input_ids_routes_by_those_ids(fleet: Fleet) -> None:
    ids = list(range(10, 10 + 160))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "cache_salt": "g"}
    status, headers, _ = await fleet.post("/generate", body)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(body, holder, 144), what="ids indexed")
    status, headers, answer = await fleet.post("/generate", {**body, "input_ids": [*ids, 5, 6]})
    assert status == 200 and headers["x-kvroute-worker"] == holder
    assert answer["meta_info"]["cached_tokens"] == int(headers["x-kvroute-matched-tokens"]) == 160


async def test_a_batched_completion_routes_by_its_first_prompt(fleet: Fleet) -> None:
    """A list of prompts (SGLang runs each): routed by the first, as a batched `/generate`; its
    answer is every item's, so no one prediction is held against its usage."""
    first = "The first prompt of a batch decides where the batch goes, " * 4
    body = {"model": "m", "prompt": [first, "a second item"], "max_tokens": 2, "cache_salt": "b"}
    status, headers, answer = await fleet.post("/v1/completions", body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    holder = headers["x-kvroute-worker"]
    single = {"model": "m", "prompt": first, "max_tokens": 2, "cache_salt": "b"}
    await eventually(lambda: fleet.holds(single, holder, 160), what="the first prompt indexed")
    status, headers, _ = await fleet.post("/v1/completions", body)
    assert status == 200 and headers["x-kvroute-worker"] == holder


async def test_namespace_eviction_clears_index_and_workers(fleet: Fleet) -> None:
    body = _chat("evict-me", "hi")
    status, headers, _ = await fleet.post("/v1/chat/completions", body)
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(body, holder, 400), what="namespace indexed")
    fingerprint = (await fleet.route(body))["namespace"]
    _, listed = await fleet.admin("GET", "/namespaces")
    row = next(r for r in listed["namespaces"] if r["id"] == fingerprint)
    assert row["salted"] and row["holders"].get(holder, 0) >= 25 and row["tokens"] >= 400
    assert "evict-me" not in str(listed)  # salts never leave the router

    status, result = await fleet.admin(
        "POST", "/namespaces/evict", {"cache_salt": "evict-me", "flush_workers": True}
    )
    assert status == 200, result
    assert result["namespaces"] == [fingerprint] and result["entries_dropped"] > 0
    assert result["flushed"] == {"w0": "ok", "w1": "ok"}
    _, listed = await fleet.admin("GET", "/namespaces")
    assert fingerprint not in {r["id"] for r in listed["namespaces"]}
    async with fleet.session.post(
        fleet.workers[holder].url + "/debug/match", json={**body, "max_tokens": 1}
    ) as resp:
        assert (await resp.json())["cached_tokens"] == 0
    # the same salt again starts cold
    status, _, answer = await fleet.post("/v1/chat/completions", body)
    assert status == 200 and _cached(answer) == 0


async def test_evicting_a_salt_drops_the_pending_marks_of_its_extra_keys(fleet: Fleet) -> None:
    """An extra_key's namespace holds pending marks alone (no event shows its pages). Before,
    an eviction by salt reached only the namespaces with indexed blocks: after it flushed the
    worker, the marks still predicted the whole prompt pending there (QA: matched 0 + pending
    208, cached 0) until they expired."""
    body = {"prompt": "an extra_key tenant's prompt " * 10, "max_tokens": 1}
    body |= {"cache_salt": "ev-salt", "extra_key": "ev-key"}
    status, headers, _ = await fleet.post("/v1/completions", body)
    assert status == 200
    plan = await fleet.route(body)
    assert max(int(c["pending_tokens"]) for c in plan["candidates"]) >= 256  # marked

    status, result = await fleet.admin(
        "POST", "/namespaces/evict", {"cache_salt": "ev-salt", "flush_workers": True}
    )
    assert status == 200, result
    assert result["flushed"] == {"w0": "ok", "w1": "ok"}
    after = await fleet.route(body)
    assert all(c["pending_tokens"] == 0 == c["matched_tokens"] for c in after["candidates"])
    # the extra_key's namespace is named among the evicted, by fingerprint only
    assert plan["namespace"] in result["namespaces"] and "ev-salt" not in str(result)
    status, headers, answer = await fleet.post("/v1/completions", body)
    assert status == 200 and _cached(answer) == 0
    assert headers["x-kvroute-matched-tokens"] == "0" == headers["x-kvroute-pending-tokens"]


async def test_evicting_a_namespace_with_a_flush_forgets_the_whole_salt(fleet: Fleet) -> None:
    """A worker's flush empties the whole salt (every extra_key and model of it), so the
    index forgets the whole salt too. Before, only the namespace named went: the salt's
    extra_key namespace still predicted the prompt (QA: 196 tokens predicted, 0 reused)."""
    keyed = {"prompt": "a flushed tenant's prompt " * 10, "max_tokens": 1}
    keyed |= {"cache_salt": "fp-salt", "extra_key": "fp-key"}
    plain = {k: v for k, v in keyed.items() if k != "extra_key"}
    for body in (keyed, plain):
        status, _, answer = await fleet.post("/v1/completions", body)
        assert status == 200, answer
    marked = await fleet.route(keyed)
    assert max(int(c["pending_tokens"]) for c in marked["candidates"]) >= 240
    fingerprint = (await fleet.route(plain))["namespace"]
    assert fingerprint != marked["namespace"]

    evict = {"namespace": fingerprint, "flush_workers": True}
    status, result = await fleet.admin("POST", "/namespaces/evict", evict)
    assert status == 200, result
    assert result["flushed"] == {"w0": "ok", "w1": "ok"}
    assert sorted(result["namespaces"]) == sorted([fingerprint, marked["namespace"]])
    assert "fp-salt" not in str(result)  # fingerprints only
    after = await fleet.route(keyed)
    assert all(c["pending_tokens"] == 0 == c["matched_tokens"] for c in after["candidates"])
    status, headers, answer = await fleet.post("/v1/completions", keyed)
    assert status == 200 and _cached(answer) == 0
    assert headers["x-kvroute-matched-tokens"] == "0" == headers["x-kvroute-pending-tokens"]


async def test_evict_by_fingerprint_and_unknown_fingerprint(fleet: Fleet) -> None:
    body = {"prompt": "z" * 64, "max_tokens": 1, "cache_salt": "fp"}
    status, headers, _ = await fleet.post("/v1/completions", body)
    holder = headers["x-kvroute-worker"]
    await eventually(lambda: fleet.holds(body, holder, 48), what="indexed")  # last token: never
    fingerprint = (await fleet.route(body))["namespace"]
    status, result = await fleet.admin("POST", "/namespaces/evict", {"namespace": fingerprint})
    assert status == 200 and result["entries_dropped"] > 0 and result["flushed"] == {}
    status, result = await fleet.admin("POST", "/namespaces/evict", {"namespace": fingerprint})
    assert status == 404 and result["error"]["type"] == "NotFoundError"
    # a salt typed into the wrong field is not sent back (before: "no namespace 'fp-secret'")
    status, result = await fleet.admin("POST", "/namespaces/evict", {"namespace": "fp-secret"})
    assert status == 404 and "fp-secret" not in str(result), result
    assert "cache_salt" in result["error"]["message"]  # the field it belongs in
    status, result = await fleet.admin("POST", "/namespaces/evict", {"flush_workers": True})
    assert status == 400


async def test_streaming_through_the_router_with_the_openai_client(fleet: Fleet) -> None:
    async with openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="unused") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            stream=True,
            extra_body={"cache_salt": "openai-tenant"},
        )
        assert raw.headers["x-kvroute-worker"] in ("w0", "w1")
        stream = raw.parse()
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len(pieces) > 1 and "".join(pieces)
        completion = await client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=3, extra_body={"cache_salt": "x"}
        )
        assert completion.choices[0].text and completion.usage is not None


async def test_a_stale_stream_attracts_no_cache_affinity() -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config(
            [("w0", w0.url), ("w1", w1.url)], indexer=IndexerSection(stale_after_s=0.5)
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            body = {"prompt": "stale " * 40, "max_tokens": 1}
            _, headers, _ = await fleet.post("/v1/completions", body)
            holder = headers["x-kvroute-worker"]
            await eventually(lambda: fleet.holds(body, holder, 224), what="indexed")

            async def stale() -> bool:
                plan = await fleet.route(body)
                return plan["candidates"][0]["stream_state"] == "stale" or any(
                    c["worker"] == holder and c["stream_state"] == "stale"
                    for c in plan["candidates"]
                )

            # no event for stale_after_s: the index's picture of that worker is not trusted
            await eventually(stale, what="the holder's stream to go stale")
            plan = await fleet.route(body)
            held = next(c for c in plan["candidates"] if c["worker"] == holder)
            # the index does not vouch for a stale stream's entries: they match nothing, and
            # the explanation says why (its state)
            assert held["matched_tokens"] == 0 and held["stream_state"] == "stale"
            assert held["score"] == 0.0


async def _last_seqs(fleet: Fleet) -> dict[str, int | None]:
    _, streams = await fleet.admin("GET", "/streams")
    return {s["stream"]: s["last_seq"] for s in streams["streams"]}


async def test_prompt_logprobs_cap_what_is_predicted_as_the_engine_caps_its_reuse(
    fleet: Fleet,
) -> None:
    """SGLang reuses nothing from the first prompt token whose logprob a request asks for:
    the prediction stops there too (it predicted the whole held prefix: 320 against 0)."""
    prompt = [(i * 13) % 200 + 7 for i in range(20 * 16 + 1)]
    status, headers, _ = await fleet.post("/generate", {"input_ids": prompt})
    assert status == 200
    holder = headers["x-kvroute-worker"]
    await eventually(
        lambda: fleet.holds({"input_ids": prompt}, holder, 320), what="the prompt indexed"
    )
    cases = [
        ("/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0}, 0),
        ("/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 40}, 32),
        ("/generate", {"input_ids": prompt, "return_logprob": True}, 320),  # the output's only
        ("/generate", {"input_ids": prompt, "logprob_start_len": 0}, 320),  # no logprobs asked
        ("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1}, 0),
        ("/v1/completions", {"prompt": prompt, "logprobs": 1}, 320),
    ]
    for path, body, expected in cases:
        plan = await fleet.route(body, endpoint=path)
        held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
        assert held[holder] == expected, (path, body.keys(), held)
        status, headers, answer = await fleet.post(path, body)
        assert status == 200, answer
        cached = (
            answer["meta_info"]["cached_tokens"]
            if path == "/generate"
            else answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
        predicted = int(headers["x-kvroute-matched-tokens"])
        assert predicted == cached, (path, body.keys(), predicted, cached)


async def test_an_eviction_does_not_flush_a_worker_that_cannot_flush_one_salt() -> None:
    """SGLang's /flush_cache takes no salt: calling it to evict one tenant would empty every
    tenant's pages there. Such a worker (its /server_info does not say `flush_cache_by_salt`)
    is skipped, and says so; a worker that flushes by salt is flushed."""
    by_salt = ReferenceConfig(time_scale=0.0, page_size=16)
    whole = ReferenceConfig(time_scale=0.0, page_size=16, flush_by_salt=False)
    async with ReferenceWorker(by_salt) as w0, ReferenceWorker(whole) as w1:
        config = router_config([("w0", w0.url), ("w1", w1.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0, "w1": w1}, session)
            await fleet.warm()
            prompt = [(i * 5) % 200 + 9 for i in range(8 * 16 + 1)]
            for salt in ("evict-me", "keep-me"):
                for worker in (w0, w1):  # straight to each worker: both hold both tenants
                    async with session.post(
                        worker.url + "/generate", json={"input_ids": prompt, "cache_salt": salt}
                    ) as resp:
                        assert resp.status == 200, await resp.text()
            status, result = await fleet.admin(
                "POST", "/namespaces/evict", {"cache_salt": "evict-me", "flush_workers": True}
            )
            assert status == 200, result
            assert result["flushed"]["w0"] == "ok"
            assert result["flushed"]["w1"].startswith("skipped: ")

            async def cached(worker: ReferenceWorker, salt: str) -> int:
                body = {"input_ids": prompt, "cache_salt": salt}
                async with session.post(worker.url + "/debug/match", json=body) as resp:
                    return int((await resp.json())["cached_tokens"])

            assert await cached(w0, "evict-me") == 0 and await cached(w0, "keep-me") == 128
            # the other tenant's pages are still on the worker that was not called
            assert await cached(w1, "keep-me") == 128


async def test_a_stream_cut_at_the_deadline_or_left_by_its_client_is_no_worker_failure() -> None:
    """A worker streaming when the request deadline passes, or when its client leaves, was
    answering: before, the cut counted as a failure and, one failure being the threshold here
    (as it is for a recovering worker's half-open circuit), made the worker unroutable."""
    slow = ReferenceConfig(time_scale=1.0, page_size=16, decode_ms_per_token=50.0)
    async with ReferenceWorker(slow) as w0:
        config = router_config(
            [("w0", w0.url)],
            timeouts=TimeoutsConfig(request_s=0.5),
            breaker=BreakerConfig(failure_threshold=1, cooldown_s=60.0),
        )
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            entry = router.planner.pool.get("w0")
            body = {
                "input_ids": list(range(40, 80)),
                "sampling_params": {"max_new_tokens": 100},  # ~5 s: cut at 0.5 s
                "stream": True,
            }
            async with session.post(router.url + "/generate", json=body) as resp:
                assert resp.status == 200
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    await resp.read()  # truncated at the deadline
            assert entry.breaker.failures == 0 and entry.routable(router.planner.clock())
            # a half-open circuit (as after a cooldown) is closed by a stream its client left
            entry.breaker.failure(router.planner.clock(), hard=True)
            entry.breaker.reconfigure(1, 0.0)  # the cooldown over at once: half-open
            async with session.post(router.url + "/generate", json=body) as resp:
                assert resp.status == 200
                await resp.content.readany()
            await eventually(
                lambda: _closed(entry), what="the circuit to close on the stream its client left"
            )


async def _closed(entry: Any) -> bool:
    return bool(entry.breaker.failures == 0)
