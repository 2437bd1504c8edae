"""Admission-time prediction end to end: a small reference worker behind a real router.

A prompt is cached; then requests for two other prompts queue behind a long-running one, and
their allocations will push the first prompt out before the worker admits it again. The index
still holds it when that request is routed (the raw match), but the router predicts what the
worker will hold at admission, and that equals the worker-reported `cached_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from router.config import IndexerSection, PolicyConfig, WorkerConfig
from router.service import RouterService
from tests.router.conftest import AUTH, Fleet, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

PAGE = 16


def prompt(i: int, pages: int = 8, out: int = 1) -> dict[str, Any]:
    """A prompt of `pages` pages and a token, sharing no page with the others."""
    ids = [(i * 37 + k) % 200 + 3 for k in range(pages * PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": out}}


async def test_the_prediction_at_admission_equals_what_the_worker_reuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=24 * PAGE,
        max_running_requests=1,  # one at a time: the others wait in the worker's queue
        prefill_ms_per_token=0.01,
        decode_ms_per_token=40.0,
        time_scale=1.0,
    )
    async with _one_worker(cfg) as (fleet, w0):
        w0.flush_all()  # the warm-up pokes went around the router: start empty
        await eventually(lambda: _empty(fleet), what="the flush to reach the index")
        caplog.set_level(logging.DEBUG, logger="router.http.observe")
        await _admission_case(fleet, w0)
    # the request line says the prediction, the raw match beside it (it said "matched 128,
    # cached 0": a false hit to whoever reads the log)
    lines = [r.getMessage() for r in caplog.records if r.name == "router.http.observe"]
    assert any(f"matched 0 (held {8 * PAGE}), cached 0" in line for line in lines), lines


@contextlib.asynccontextmanager
async def _one_worker(
    cfg: ReferenceConfig, **overrides: Any
) -> AsyncIterator[tuple[Fleet, ReferenceWorker]]:
    """One reference worker behind a real router (its config's `overrides`), its stream
    live."""
    async with ReferenceWorker(cfg) as w0:
        config = router_config([("w0", w0.url)], **overrides)
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            yield fleet, w0


async def _empty(fleet: Fleet) -> bool:
    plan = await fleet.route(prompt(99))
    (only,) = plan["candidates"]
    return bool(only["admission"]["held_tokens"] == 0)


async def _admission_case(fleet: Fleet, w0: ReferenceWorker) -> None:
    a = prompt(0)
    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    assert answer["meta_info"]["cached_tokens"] == 0
    await eventually(lambda: fleet.holds(a, "w0", 8 * PAGE), what="prompt A indexed")

    # a long request runs (max_running_requests = 1), and B and C queue behind it
    long_one = asyncio.create_task(fleet.post("/generate", prompt(1, pages=2, out=60)))
    await eventually(lambda: _queued(w0, running=1, waiting=0), what="the long request to run")
    queued = [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (2, 3)]
    await eventually(lambda: _queued(w0, running=1, waiting=2), what="B and C to queue")

    # A is still held now, but B and C will have evicted it when A is admitted again
    plan = await fleet.route(a)
    (only,) = plan["candidates"]
    forecast = only["admission"]
    assert only["matched_tokens"] == 8 * PAGE  # the raw match, per the events
    assert forecast["raw_tokens"] == 8 * PAGE and forecast["kept_tokens"] == 0
    assert forecast["capacity_tokens"] == 24 * PAGE
    assert "evicted least recently used first" in forecast["why"]

    before = await _matched_total(fleet)
    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    assert int(headers["x-kvroute-raw-matched-tokens"]) == 8 * PAGE
    predicted = int(headers["x-kvroute-matched-tokens"]) + int(headers["x-kvroute-pending-tokens"])
    assert predicted == answer["meta_info"]["cached_tokens"] == 0
    assert headers["x-kvroute-forecast-lost"] == "evicted"  # why the raw match is not predicted
    await _counted_as_predicted(fleet, headers, before)
    for task in [long_one, *queued]:
        status, _, _ = await task
        assert status == 200

    # with nothing queued, A (cached again by its last request) is predicted in full, once its
    # events are in (on a loaded machine they may trail the answer)
    await eventually(lambda: fleet.holds(a, "w0", 8 * PAGE), what="prompt A indexed again")
    status, headers, answer = await fleet.post("/generate", a)
    assert status == 200
    predicted = int(headers["x-kvroute-matched-tokens"])
    assert predicted == answer["meta_info"]["cached_tokens"] == 8 * PAGE


async def _queued(w0: ReferenceWorker, *, running: int, waiting: int) -> bool:
    return w0.ranks[0].load == (running, waiting)


async def _matched_total(fleet: Fleet) -> float:
    """`kvroute_matched_tokens_total`, every worker's and model's."""
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvroute_matched_tokens_total{")
    )


async def _counted_as_predicted(fleet: Fleet, headers: dict[str, str], before: float) -> None:
    """The request that answered with `headers`, its raw match not predicted, is counted in
    `kvroute_matched_tokens_total` (`before` it) and in the dashboard's recent decisions with
    its prediction, as x-kvroute-matched-tokens says it. Both counted the raw match: under KV
    pressure the predicted hit rate counted prefixes the forecast said would be evicted."""
    (request_id,) = [v for k, v in headers.items() if k.lower() == "x-request-id"]
    rows: list[dict[str, Any]] = []

    async def told() -> bool:  # a decision is told once its request is counted
        async with fleet.session.get(fleet.url + "/dashboard/state", headers=AUTH) as resp:
            assert resp.status == 200
            decisions = (await resp.json())["decisions"]
        rows[:] = [d for d in decisions if d["request_id"] == request_id]
        return bool(rows) and rows[0]["status"] is not None

    await eventually(told, what="the request's decision to be told")
    predicted = int(headers["x-kvroute-matched-tokens"])
    raw = int(headers["x-kvroute-raw-matched-tokens"])
    assert predicted < raw  # the case: part of the raw match not predicted
    # the other requests in flight match nothing
    assert await _matched_total(fleet) - before == predicted
    assert rows[0]["matched_tokens"] == predicted
    assert rows[0]["raw_matched_tokens"] == raw  # the index's, beside it


async def test_a_pair_counts_its_prefill_sides_prediction_not_the_raw_match() -> None:
    """As a whole request under KV pressure (`_admission_case`), a pair's request: its
    prefill side's prediction is what the metric and the dashboard count."""
    from tests.router.test_router_pd import reference, warm

    pressed = reference(
        "prefill",
        capacity_tokens=24 * PAGE,
        max_running_requests=1,  # one at a time: the others wait in the worker's queue
        prefill_ms_per_token=10.0,  # a 9-page prompt prefills in about 1.3 s
        time_scale=1.0,
        kv_transfer_timeout_s=30.0,  # the decodes wait for the queued prefills (5 s: a 504)
    )
    patient = reference("decode", capacity_tokens=64 * PAGE, kv_transfer_timeout_s=30.0)
    async with (
        ReferenceWorker(pressed) as p0,
        ReferenceWorker(patient) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            await warm(session, router, [p0], [d0])
            fleet = Fleet(router, {"p0": p0, "d0": d0}, session)
            p0.flush_all()  # the warm-up pokes went around the router: start empty
            await eventually(lambda: _empty(fleet), what="the flush to reach the index")
            a = prompt(0)
            assert (await fleet.post("/generate", a))[0] == 200
            await eventually(lambda: fleet.holds(a, "p0", 8 * PAGE), what="prompt A indexed")
            # a prefill runs, two queue behind it: their allocations will evict A first
            ahead = [asyncio.create_task(fleet.post("/generate", prompt(1)))]
            await eventually(lambda: _queued(p0, running=1, waiting=0), what="a prefill to run")
            ahead += [asyncio.create_task(fleet.post("/generate", prompt(i))) for i in (2, 3)]
            await eventually(lambda: _queued(p0, running=1, waiting=2), what="two to queue")
            before = await _matched_total(fleet)
            status, headers, body = await fleet.post("/generate", a)
            assert status == 200 and headers["x-kvroute-prefill-worker"] == "p0", body
            assert headers["x-kvroute-forecast-lost"] == "evicted"
            await _counted_as_predicted(fleet, headers, before)
            for task in ahead:
                assert (await task)[0] == 200


def sibling(shared: int, question: int) -> dict[str, Any]:
    """A prompt of 8 pages of prefix `shared` (as `prompt`) and a page of its own question."""
    ids = prompt(shared)["input_ids"][: 8 * PAGE]
    ids += [(question * 53 + k) % 200 + 3 for k in range(PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}


async def test_a_sibling_in_the_same_batch_is_predicted_no_reuse_and_one_after_is() -> None:
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=64 * PAGE,  # no KV pressure: only batching decides
        max_running_requests=8,
        prefill_ms_per_token=4.0,  # a 9-page prompt takes about 0.6 s to prefill
        decode_ms_per_token=1.0,
        time_scale=1.0,
    )
    async with _one_worker(cfg) as (fleet, w0):
        await _same_batch_case(fleet, w0)
        await _later_batch_case(fleet, w0)


async def _same_batch_case(fleet: Fleet, w0: ReferenceWorker) -> None:
    # a prefill runs; the first sibling queues behind it and marks the shared prefix pending
    blocker = asyncio.create_task(fleet.post("/generate", prompt(40)))
    await eventually(lambda: _queued(w0, running=1, waiting=0), what="the blocker to run")
    first = asyncio.create_task(fleet.post("/generate", sibling(10, 1)))
    await eventually(lambda: _queued(w0, running=1, waiting=1), what="the sibling to queue")

    # the second sibling will be admitted with the first, when the blocker's prefill ends:
    # the prefix they share is not in the cache for either
    status, headers, answer = await fleet.post("/generate", sibling(10, 2))
    assert status == 200
    assert int(headers["x-kvroute-raw-pending-tokens"]) == 8 * PAGE  # the index's mark
    predicted = int(headers["x-kvroute-matched-tokens"]) + int(headers["x-kvroute-pending-tokens"])
    assert predicted == answer["meta_info"]["cached_tokens"] == 0
    assert headers["x-kvroute-forecast-lost"] == "batched"
    for task in (blocker, first):
        status, _, reply = await task
        assert status == 200 and reply["meta_info"]["cached_tokens"] == 0


_Answer = tuple[int, dict[str, str], Any]


async def _first_sibling_taken_in(
    fleet: Fleet, w0: ReferenceWorker, blocker: int, shared: int
) -> asyncio.Task[_Answer]:
    """A prefill (`prompt(blocker)`) runs, the first sibling of `shared` queues behind it, and
    the blocker answers: the worker has taken the sibling in, and prefills it (its task)."""
    running = asyncio.create_task(fleet.post("/generate", prompt(blocker)))
    await eventually(lambda: _queued(w0, running=1, waiting=0), what="the blocker to run")
    first = asyncio.create_task(fleet.post("/generate", sibling(shared, 1)))
    await eventually(lambda: _queued(w0, running=1, waiting=1), what="the sibling to queue")
    status, _, _ = await running
    assert status == 200
    return first


async def _later_batch_case(fleet: Fleet, w0: ReferenceWorker) -> None:
    first = await _first_sibling_taken_in(fleet, w0, 41, 11)
    # the blocker answered: the worker took the first sibling in and prefills it now, so
    # the second one comes in a later batch and finds the prefix the first one stores
    plan = await fleet.route(sibling(11, 2))
    (only,) = plan["candidates"]
    assert only["pending_tokens"] == 8 * PAGE
    assert only["admission"]["kept_tokens"] == 8 * PAGE, only["admission"]["why"]
    status, headers, answer = await fleet.post("/generate", sibling(11, 2))
    assert status == 200
    assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 8 * PAGE
    assert "x-kvroute-forecast-lost" not in headers  # nothing dropped
    status, _, _ = await first
    assert status == 200


async def test_behind_an_overlap_schedulers_prefill_a_sibling_is_predicted_nothing_it_brings() -> (
    None
):
    # a worker that forms its next batch while a prefill runs (SGLang's default), before
    # that prefill's prompts are cached, and says so in its server info
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=64 * PAGE,
        max_running_requests=8,
        prefill_ms_per_token=4.0,
        decode_ms_per_token=1.0,
        time_scale=1.0,
        overlap_schedule=True,
    )
    async with _one_worker(cfg) as (fleet, w0):
        first = await _first_sibling_taken_in(fleet, w0, 42, 12)
        # the first sibling went into the batch formed while the blocker ran, and prefills
        # now; the second is formed into a batch before that prefill's prompt is cached
        plan = await fleet.route(sibling(12, 2))
        (only,) = plan["candidates"]
        assert only["pending_tokens"] == 8 * PAGE  # the index's mark
        assert only["admission"]["kept_tokens"] == 0
        assert "overlap scheduler" in only["admission"]["why"], only["admission"]["why"]
        status, headers, answer = await fleet.post("/generate", sibling(12, 2))
        assert status == 200
        # before, 128 predicted (the rule of a worker that caches before it batches again)
        assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 0
        assert headers["x-kvroute-forecast-lost"] == "batched"
        status, _, reply = await first
        assert status == 200 and reply["meta_info"]["cached_tokens"] == 0
        # answered, its prompt is cached: a sibling sent now finds it
        status, headers, answer = await fleet.post("/generate", sibling(12, 3))
        assert status == 200
        assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 8 * PAGE


@pytest.mark.parametrize("where", ["queued", "prefilling"])
async def test_a_request_whose_client_left_before_its_answer_marks_nothing_pending(
    where: str,
) -> None:
    # its client leaves while it waits in the worker's queue, or while the worker prefills it
    # on an overlapping scheduler: the worker drops it (or forms the next batch before
    # caching it), and a sibling sent right after finds none of its prompt
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=64 * PAGE,
        max_running_requests=1 if where == "queued" else 8,
        prefill_ms_per_token=4.0,
        decode_ms_per_token=20.0,
        time_scale=1.0,
        overlap_schedule=where == "prefilling",
    )
    async with _one_worker(cfg) as (fleet, w0):
        blocker = None
        if where == "queued":
            decoding = {
                "input_ids": prompt(43)["input_ids"],
                "sampling_params": {"max_new_tokens": 40},
            }
            blocker = asyncio.create_task(fleet.post("/generate", decoding))
            await eventually(lambda: _queued(w0, running=1, waiting=0), what="the blocker to run")
        first = asyncio.create_task(fleet.post("/generate", sibling(13, 1)))
        running, waiting = (1, 1) if where == "queued" else (1, 0)
        await eventually(
            lambda: _queued(w0, running=running, waiting=waiting), what="the sibling to reach it"
        )
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.02)
        status, headers, answer = await fleet.post("/generate", sibling(13, 2))
        assert status == 200
        # before, its pending marks stood through their grace: 128 predicted
        assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 0
        if blocker is not None:
            status, _, _ = await blocker
            assert status == 200


def long_sibling(shared: int, question: int) -> dict[str, Any]:
    """A prompt of 20 pages of prefix `shared` and a page of its own question (337 tokens),
    8 tokens out: 22 pages of KV."""
    ids = prompt(shared, pages=20)["input_ids"][: 20 * PAGE]
    ids += [(question * 53 + k) % 200 + 3 for k in range(PAGE + 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}


async def test_a_request_waiting_for_kv_room_is_not_taken_as_admitted() -> None:
    cfg = ReferenceConfig(
        page_size=PAGE,
        capacity_tokens=64 * PAGE,
        max_running_requests=8,  # the running cap leaves room: only the KV pool holds back
        prefill_ms_per_token=2.0,  # a 21-page prompt takes about 0.7 s to prefill
        decode_ms_per_token=10.0,
        time_scale=1.0,
    )
    # a decode step of 1 ms: the router takes a request sent beside a decoding one as
    # admitted almost at once, had the pool room for it or not (before: no matter); pending
    # marks that outlive the long request's 2.4 s
    policy = PolicyConfig(admission_batch_window_ms=1.0)
    indexer = IndexerSection(pending_ttl_s=10.0)
    async with _one_worker(cfg, policy=policy, indexer=indexer) as (fleet, w0):
        await _waits_for_room_case(fleet, w0, shared=70)
        await _room_came_case(fleet, w0, shared=71)


async def _hog(fleet: Fleet, i: int) -> tuple[asyncio.Task[None], asyncio.Event]:
    """A 481-token prompt streaming 240 tokens (46 of the pool's 64 pages, until it ends),
    once it has answered (its first token out)."""
    body = prompt(i, pages=30) | {"stream": True}
    body["sampling_params"] = {"max_new_tokens": 240}
    answered = asyncio.Event()

    async def run() -> None:
        async with fleet.session.post(fleet.url + "/generate", json=body) as resp:
            assert resp.status == 200
            async for _ in resp.content.iter_any():
                answered.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(answered.wait(), 10.0)
    return task, answered


async def _predicted(headers: dict[str, str]) -> int:
    return int(headers["x-kvroute-matched-tokens"]) + int(headers["x-kvroute-pending-tokens"])


async def _waits_for_room_case(fleet: Fleet, w0: ReferenceWorker, shared: int) -> None:
    # a long request decodes, holding 46 pages; the first sibling needs 22 of the 18 left:
    # the worker keeps it waiting until the long one ends
    hog, _ = await _hog(fleet, 60)
    first = asyncio.create_task(fleet.post("/generate", long_sibling(shared, 1)))
    await eventually(lambda: _queued(w0, running=1, waiting=1), what="the sibling to wait")
    # the second sibling waits behind it, and both go in one batch when the long one ends:
    # neither finds the prefix. Before, the first was taken as admitted a decode step after
    # it was sent, and the second was predicted the 320 tokens it marked pending
    plan = await fleet.route(long_sibling(shared, 2))
    (only,) = plan["candidates"]
    assert only["pending_tokens"] == 20 * PAGE
    forecast = only["admission"]
    assert forecast["kept_tokens"] == 0 and forecast["awaiting_room"] == 1, forecast
    assert "wait for KV room" in forecast["why"] or "for KV room: 1" in forecast["why"]
    status, headers, answer = await fleet.post("/generate", long_sibling(shared, 2))
    assert status == 200
    assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 0
    assert headers["x-kvroute-forecast-lost"] == "batched"
    status, _, reply = await first
    assert status == 200 and reply["meta_info"]["cached_tokens"] == 0
    await hog


async def _room_seen(fleet: Fleet, body: dict[str, Any]) -> bool:
    """Whether the router has seen the long request end (the client may see it first)."""
    (only,) = (await fleet.route(body))["candidates"]
    return bool(only["running"] == 1 and only["admission"]["awaiting_room"] == 0)


async def _room_came_case(fleet: Fleet, w0: ReferenceWorker, shared: int) -> None:
    # the same, but the long request ends before the second sibling is routed: the router
    # sees the pages come free, takes the first sibling as admitted on the worker's next
    # step, and the second, which comes in after its prefill, is predicted the prefix
    hog, _ = await _hog(fleet, 61)
    first = asyncio.create_task(fleet.post("/generate", long_sibling(shared, 1)))
    await eventually(lambda: _queued(w0, running=1, waiting=1), what="the sibling to wait")
    await hog
    await eventually(lambda: _queued(w0, running=1, waiting=0), what="the sibling to go in")
    await eventually(lambda: _room_seen(fleet, long_sibling(shared, 2)), what="the hog's end")
    status, headers, answer = await fleet.post("/generate", long_sibling(shared, 2))
    assert status == 200
    assert await _predicted(headers) == answer["meta_info"]["cached_tokens"] == 20 * PAGE
    status, _, _ = await first
    assert status == 200


async def test_a_worker_whose_streams_are_spelled_out_still_tells_its_capacity() -> None:
    # `kvroute up`, and configs that name every stream: no discovery needed for the streams,
    # but the KV pool is in no config; without it there is no forecast and no holding
    cfg = ReferenceConfig(page_size=PAGE, capacity_tokens=24 * PAGE, time_scale=0.0)
    async with ReferenceWorker(cfg) as w0:
        kv = w0.kv_events
        spelled = WorkerConfig(
            url=w0.url,
            id="w0",
            events=kv.endpoints[0],
            replay=kv.replay_endpoints[0],
            block_size=PAGE,
        )
        config = msgspec.structs.replace(router_config([]), workers=(spelled,))
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            (only,) = (await fleet.route(prompt(1)))["candidates"]
    assert only["admission"]["capacity_tokens"] == 24 * PAGE


@pytest.mark.parametrize("block_size", [PAGE, None], ids=["spelled-out", "discovered"])
async def test_a_replay_socket_of_another_worker_is_refused_not_trusted(
    block_size: int | None,
) -> None:
    # its event sockets are the ones it advertises, its replay socket is not: a typo that
    # would rebuild this worker's streams from the other worker's cache (false hits). Without
    # a block size the rest is discovered, with the configured sockets kept: checked alike
    cfg = ReferenceConfig(page_size=PAGE, time_scale=0.0)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        wrong = WorkerConfig(
            url=w1.url,
            id="w1",
            events=w1.kv_events.endpoints[0],
            replay=w0.kv_events.replay_endpoints[0],  # w0's
            block_size=block_size,
        )
        config = msgspec.structs.replace(router_config([("w0", w0.url)]), workers=())
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            status, refused = await fleet.admin("POST", "/workers", msgspec.to_builtins(wrong))
            assert status == 400, refused
            message = refused["error"]["message"]
            assert "is not the replay socket it advertises" in message
            assert w1.kv_events.replay_endpoints[0] in message  # the right one, named
            right = msgspec.structs.replace(wrong, replay=w1.kv_events.replay_endpoints[0])
            status, added = await fleet.admin("POST", "/workers", msgspec.to_builtins(right))
            assert status == 201, added


async def test_two_workers_on_one_event_stream_are_refused() -> None:
    """A copy-pasted `events` puts a second worker on the first one's publisher: each would be
    predicted the other's pages (measured: predicted 80, cached 0)."""
    cfg = ReferenceConfig(page_size=PAGE, time_scale=0.0)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        config = router_config([("w0", w0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {"w0": w0}, session)
            await fleet.warm()
            pasted = WorkerConfig(
                url=w1.url,
                id="w1",
                events=w0.kv_events.endpoints[0],  # w0's
                replay=w0.kv_events.replay_endpoints[0],
                topic=w0.kv_events.topic,
                block_size=PAGE,
            )
            status, refused = await fleet.admin("POST", "/workers", msgspec.to_builtins(pasted))
            assert status == 400, refused
            assert "are worker w0's stream already" in refused["error"]["message"]
            own = msgspec.structs.replace(
                pasted,
                events=w1.kv_events.endpoints[0],
                replay=w1.kv_events.replay_endpoints[0],
                topic=w1.kv_events.topic,
            )
            status, added = await fleet.admin("POST", "/workers", msgspec.to_builtins(own))
            assert status == 201, added


async def test_a_topic_the_worker_does_not_publish_under_is_refused() -> None:
    """A SUB matches by prefix: a configured topic that does not start the advertised one
    receives nothing, and the stream would look healthy with no hit ever predicted."""
    cfg = ReferenceConfig(page_size=PAGE, time_scale=0.0, topic="kv@worker-0")
    async with ReferenceWorker(cfg) as w0:
        config = msgspec.structs.replace(router_config([]), workers=())
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {}, session)
            wrong = WorkerConfig(url=w0.url, id="w0", topic="kv-events")
            status, refused = await fleet.admin("POST", "/workers", msgspec.to_builtins(wrong))
            assert status == 400, refused
            assert "is not the topic it publishes under" in refused["error"]["message"]
            prefix = msgspec.structs.replace(wrong, topic="kv@")  # a prefix of it: receives it
            status, added = await fleet.admin("POST", "/workers", msgspec.to_builtins(prefix))
            assert status == 201, added


async def test_a_worker_refused_every_health_round_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ReferenceConfig(page_size=PAGE, time_scale=0.0, topic="kv@worker-0")
    async with ReferenceWorker(cfg) as w0:
        wrong = WorkerConfig(url=w0.url, id="w0", topic="kv-events")
        config = msgspec.structs.replace(router_config([]), workers=(wrong,))
        caplog.set_level(logging.DEBUG, logger="router.fleet.registration_notes")
        async with RouterService(config):
            # health rounds every 0.2 s: several retries, each refused the same way
            await asyncio.sleep(1.2)
    said = [r for r in caplog.records if "is not the topic it publishes under" in r.message]
    assert len(said) >= 4
    assert [r.levelno for r in said].count(logging.WARNING) == 1


async def test_a_replay_socket_the_worker_does_not_advertise_is_not_taken_as_proven() -> None:
    """Sockets the worker advertises are its own; others (ports mapped on the way, another
    spelling, or an engine that advertises nothing) cannot be told from another worker's."""
    cfg = ReferenceConfig(page_size=PAGE, time_scale=0.0)
    async with ReferenceWorker(cfg) as w0:
        kv = w0.kv_events
        mapped = WorkerConfig(
            url=w0.url,
            id="mapped",
            events=kv.endpoints[0].replace("127.0.0.1", "localhost"),
            replay=kv.replay_endpoints[0].replace("127.0.0.1", "localhost"),
        )
        config = msgspec.structs.replace(router_config([("own", w0.url)]), workers=())
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = Fleet(router, {}, session)
            own = WorkerConfig(url=w0.url, id="own")
            status, _ = await fleet.admin("POST", "/workers", msgspec.to_builtins(own))
            assert status == 201
            subs = router.planner.indexer._workers
            assert [s.config.replay_proven for s in subs["own"]] == [True]
            status, _ = await fleet.admin("DELETE", "/workers/own")
            assert status == 200
            status, _ = await fleet.admin("POST", "/workers", msgspec.to_builtins(mapped))
            assert status == 201
            assert [s.config.replay_proven for s in subs["mapped"]] == [False]
