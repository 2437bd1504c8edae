"""The routing benchmark runner: one fresh fleet per policy, the same open-loop workload for all.

For each policy the harness starts a fleet of reference workers (same capacity and latency
model every time), puts a router with that policy in front of it (or, for `oracle`, routes
itself: it asks every worker's `/debug/match`, adds what its own in-flight requests are about
to cache there, and sends each request straight to the worker with the longest prefix), then
replays the workload's requests at their arrival times whatever happened to earlier ones
(open loop). Before a router run starts, the harness proves every KV-event path is live.
Every request is a streaming SGLang `/generate` with `input_ids` and `cache_salt`, so TTFT is
the time to the first streamed chunk with content and the hit rate comes from the worker's own
`meta_info.cached_tokens`.

`sglang_cache_aware` is SGLang's own Rust router (`sglang-router`, `bench.sglang_router`) with
its `cache_aware` policy in front of the fleet: no KV events, only its approximate tree. It is
sent exactly what kvroute is sent, `cache_salt` included; that it drops the salt on `/generate`
(its typed request has no such field) is measured, not hidden: the cached tokens only another
salt could have produced are isolation violations (`bench.isolation`), not hits.

After the workload, every router run is probed for isolation on each endpoint
(`bench.isolation.probe_isolation`), then for affinity: whether, idle, it sends a prompt again
to the worker that holds it (`bench.affinity.probe_affinity`).

Routing overhead: for `oracle` it is the `/debug/match` fan-out of each request. For router
policies it is measured after the workload, on the idle fleet, as paired probes: the same tiny
request sent directly to a worker and through the router (to that same worker), difference of
the two latencies. That is the whole hop (proxy + decision), an upper bound on the decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import aiohttp
import msgspec

from bench.affinity import probe_affinity
from bench.isolation import probe_isolation
from bench.pd_fleet import await_pd_streams, pd_config, pd_names, sglang_pd_args
from bench.routing_results import (
    EXTERNAL_BASELINE,
    AffinityProbe,
    EndpointIsolation,
    PolicyRun,
    RequestRecord,
)
from bench.sglang_router import launch as launch_sglang_router
from bench.workloads import BenchRequest, Workload
from indexer.stats import StreamState
from router.config import AdminConfig, ListenConfig, PolicyConfig, RouterConfig
from router.config import WorkerConfig as RoutedWorker
from router.service import RouterService
from workers.config import WorkerConfig as ReferenceWorkerConfig
from workers.server import WORKER_HEADER as SERVED_BY_HEADER
from workers.worker import ReferenceWorker

__all__ = [
    "KV_DEFAULT",
    "KV_HOLD",
    "ORACLE",
    "POLICIES",
    "SGLANG_CACHE_AWARE",
    "FleetSpec",
    "HarnessError",
    "PolicyWeights",
    "Target",
    "policy_config",
    "run_policy",
    "send_generate",
    "settings_not_default",
]

ORACLE = "oracle"
POLICIES: tuple[str, ...] = ("kv", "approx_tree", "least_load", "round_robin", "random", ORACLE)
# the router's kv policy with its own default weights, beside a `kv` run with overridden ones
KV_DEFAULT = "kv_default"
# the router's kv policy holding each request until its worker has KV room (`policy.
# hold_until_room`), beside the default `kv`
KV_HOLD = "kv_hold"
# SGLang's Rust router, an external baseline: runs only when its python package is installed
SGLANG_CACHE_AWARE = EXTERNAL_BASELINE
WORKER_HEADER = "x-kvroute-worker"
MATCHED_HEADER = "x-kvroute-matched-tokens"
PENDING_HEADER = "x-kvroute-pending-tokens"
FORECAST_HEADER = "x-kvroute-forecast-lost"
_PROBES = 12


class HarnessError(RuntimeError):
    """The benchmark cannot run: a fleet or router failed to start or answer."""


class FleetSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet every policy runs on: size, KV capacity and latency model."""

    workers: int = 4
    page_size: int = 16
    capacity_tokens: int = 16384
    prefill_ms_per_token: float = 0.5
    decode_ms_per_token: float = 2.0
    max_running_requests: int = 8
    time_scale: float = 0.2
    # data-parallel ranks per worker (each its own cache of `capacity_tokens`)
    dp_size: int = 1
    # a host tier per rank (0: none) and what loading a token back from it costs
    host_capacity_tokens: int = 0
    host_load_ms_per_token: float = 0.1
    # a prefill/decode fleet instead of `workers` (both > 0, `bench.pd_fleet`), and what moving
    # a token's KV from a prefill to a decode costs there
    prefill_workers: int = 0
    decode_workers: int = 0
    transfer_ms_per_token: float = 0.002
    # its workers form their next batch before caching a running prefill's prompts, as
    # SGLang's default overlap scheduler does (`workers.config.WorkerConfig.overlap_schedule`)
    overlap_schedule: bool = False

    @property
    def decode_step_ms(self) -> float:
        """One decode step of its workers, in real time (what a router's batch window is)."""
        return self.decode_ms_per_token * self.time_scale

    @property
    def decode_step_weight(self) -> float:
        """One decode step of its workers in prefill tokens (a router's `decode_step_weight`);
        the router's default when a prefill token costs nothing."""
        if self.prefill_ms_per_token <= 0:
            return PolicyConfig().decode_step_weight
        return self.decode_ms_per_token / self.prefill_ms_per_token

    @property
    def disaggregated(self) -> bool:
        """Whether this is a prefill/decode fleet."""
        return self.prefill_workers > 0 and self.decode_workers > 0


class PolicyWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Overrides of the router's `kv` policy weights; None keeps the router's default."""

    hit_weight: float | None = None
    decode_weight: float | None = None
    eviction_weight: float | None = None
    room_weight: float | None = None


class Target(msgspec.Struct, frozen=True):
    """Where one request goes: a base URL, plus what the harness knows of the choice."""

    url: str
    worker: str = ""
    route_s: float | None = None
    ticket: int = 0  # the chooser's own handle, for release()
    # the body field that carries the request's salt
    salt_field: str = "cache_salt"
    # the DP rank to ask the worker for (the oracle picks one), None: the worker's choice
    dp_rank: int | None = None


class Chooser(Protocol):
    """Decides where each request goes; `release` is called once its response has ended."""

    async def choose(self, session: aiohttp.ClientSession, request: BenchRequest) -> Target:
        """Where `request` goes."""
        ...

    def release(self, target: Target) -> None:
        """The request sent to `target` has ended."""
        ...


class _ViaRouter:
    """Every request goes to the router, which decides."""

    def __init__(self, url: str, salt_field: str = "cache_salt") -> None:
        self._target = Target(url=url, salt_field=salt_field)

    async def choose(self, session: aiohttp.ClientSession, request: BenchRequest) -> Target:
        """The router's URL."""
        return self._target

    def release(self, target: Target) -> None:
        """Nothing to track: the router keeps its own load."""


def _body(
    request: BenchRequest, stream: bool, salt_field: str, dp_rank: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": request.input_ids,
        "sampling_params": {"max_new_tokens": request.max_new_tokens, "temperature": 0.0},
        "stream": stream,
    }
    if request.cache_salt is not None:
        body[salt_field] = request.cache_salt
    if dp_rank is not None:
        body["data_parallel_rank"] = dp_rank  # SGLang's (deprecated but honoured) spelling
    return body


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def send_generate(
    session: aiohttp.ClientSession,
    target: Target,
    request: BenchRequest,
    index: int,
    sent_s: float,
    timeout_s: float,
    started: float | None = None,
) -> RequestRecord:
    """Send one streaming /generate and measure it; failures become a failed record.

    Latencies count from `started` (a `perf_counter` reading; default: now), so a chooser's own
    time (the oracle's fan-out) is inside TTFT like the router's decision is.
    """
    start = time.perf_counter() if started is None else started
    record = RequestRecord(index=index, sent_s=sent_s, ok=False, worker=target.worker)
    record.route_s = target.route_s
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.post(
                f"{target.url}/generate",
                json=_body(request, True, target.salt_field, target.dp_rank),
            ) as resp,
        ):
            if resp.status != 200:
                text = (await resp.text())[:200]
                record.error = f"HTTP {resp.status}: {text}"
                return record
            record.worker = resp.headers.get(WORKER_HEADER, target.worker)
            record.served_by = resp.headers.get(SERVED_BY_HEADER, "")
            matched = resp.headers.get(MATCHED_HEADER)
            if matched is not None and matched.isdigit():
                record.predicted_tokens = int(matched)
            pending = resp.headers.get(PENDING_HEADER)
            if pending is not None and pending.isdigit():
                record.pending_tokens = int(pending)
            record.forecast_lost = resp.headers.get(FORECAST_HEADER, "")
            meta: dict[str, Any] = {}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if record.ttft_s is None and (chunk.get("text") or chunk.get("output_ids")):
                    record.ttft_s = time.perf_counter() - start
                if isinstance(chunk.get("meta_info"), dict):
                    meta = chunk["meta_info"]
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return record
            record.e2e_s = time.perf_counter() - start
            if record.ttft_s is None:
                record.ttft_s = record.e2e_s
            record.prompt_tokens = _int(meta.get("prompt_tokens")) or len(request.input_ids)
            record.cached_tokens = _int(meta.get("cached_tokens"))
            record.output_tokens = _int(meta.get("completion_tokens"))
            record.ok = True
    except TimeoutError:
        record.error = f"timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return record


async def _drive(
    session: aiohttp.ClientSession,
    workload: Workload,
    chooser: Chooser,
    timeout_s: float,
    on_done: Callable[[RequestRecord], None],
) -> list[RequestRecord]:
    """Open loop: each request leaves at its arrival time, whatever earlier ones are doing."""
    records: list[RequestRecord | None] = [None] * len(workload.requests)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int, request: BenchRequest) -> None:
        sent = loop.time() - t0
        started = time.perf_counter()
        try:
            target = await chooser.choose(session, request)
        except (aiohttp.ClientError, TimeoutError, HarnessError) as exc:
            record = RequestRecord(index=i, sent_s=sent, ok=False, error=f"choose: {exc}"[:200])
        else:
            try:
                record = await send_generate(session, target, request, i, sent, timeout_s, started)
            finally:
                chooser.release(target)
        records[i] = record
        on_done(record)

    async with asyncio.TaskGroup() as tg:
        for i, request in enumerate(workload.requests):
            delay = t0 + request.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tg.create_task(one(i, request))
    return [r for r in records if r is not None]


def _shared_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Tokens of prompt `a` that prompt `b`'s cached pages would serve (whole common pages).

    A worker matches a prompt without its last token (that one must be computed), and caches
    only whole pages, so both ends are rounded down to pages.
    """
    limit = min(len(a) - 1, len(b)) // page_size * page_size
    n = 0
    while n < limit and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n


class _Oracle:
    """Routes to the worker that truly holds, or is about to hold, the longest prefix.

    "Holds" is each worker's own answer to `/debug/match`: the `cached_tokens` the request
    would report there now (its radix cache in the request's namespace, matched against the
    prompt but its last token, whole pages), the same measure as `_shared_pages` gives the
    in-flight ones; "about to hold" is the oracle's own requests still in flight there,
    whose prompts the worker caches once prefilled. Without the second part, siblings that
    arrive while the first one prefills would scatter across the fleet. Ties go to the worker
    with the fewest in flight, then at random.
    """

    def __init__(self, urls: Sequence[str], page_size: int, seed: int) -> None:
        self._urls = list(urls)
        self._page_size = page_size
        self._inflight: dict[tuple[str, int], dict[int, BenchRequest]] = {}
        self._tickets = itertools.count(1)
        self._rng = random.Random(seed)

    async def _match(
        self, session: aiohttp.ClientSession, url: str, req: BenchRequest
    ) -> list[int]:
        body: dict[str, Any] = {"input_ids": req.input_ids}
        if req.cache_salt is not None:
            body["cache_salt"] = req.cache_salt
        async with asyncio.timeout(10.0), session.post(f"{url}/debug/match", json=body) as resp:
            if resp.status != 200:
                raise HarnessError(f"/debug/match answered HTTP {resp.status}")
            data = await resp.json()
        ranks = data.get("ranks") if isinstance(data, dict) else None
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            return [int(r) for r in ranks]  # one cache per DP rank
        raise HarnessError(f"/debug/match answer has no per-rank cached_tokens: {data!r:.200}")

    def _upcoming(self, place: tuple[str, int], req: BenchRequest) -> int:
        return max(
            (
                _shared_pages(req.input_ids, other.input_ids, self._page_size)
                for other in self._inflight.get(place, {}).values()
                if other.cache_salt == req.cache_salt
            ),
            default=0,
        )

    async def choose(self, session: aiohttp.ClientSession, request: BenchRequest) -> Target:
        """Ask every worker, add what is in flight there, pick the longest; ties to the idlest.

        A worker with several DP ranks answers per rank; the oracle picks a (worker, rank) and
        asks the worker for that rank (`data_parallel_rank`), as the router does.
        """
        start = time.perf_counter()
        cached = await asyncio.gather(*(self._match(session, u, request) for u in self._urls))
        places = [
            (u, r) for u, ranks in zip(self._urls, cached, strict=True) for r in range(len(ranks))
        ]
        held = [c for ranks in cached for c in ranks]
        matches = [max(c, self._upcoming(p, request)) for p, c in zip(places, held, strict=True)]
        best = max(matches)
        ties = [p for p, m in zip(places, matches, strict=True) if m == best]
        fewest = min(len(self._inflight.get(p, {})) for p in ties)
        url, rank = self._rng.choice([p for p in ties if len(self._inflight.get(p, {})) == fewest])
        ticket = next(self._tickets)
        self._inflight.setdefault((url, rank), {})[ticket] = request
        multi = len(cached[self._urls.index(url)]) > 1
        return Target(
            url=url,
            worker=url,
            route_s=time.perf_counter() - start,
            ticket=ticket,
            dp_rank=rank if multi else None,
        )

    def release(self, target: Target) -> None:
        """The request is over: the worker's cache now speaks for it."""
        self._inflight.get((target.url, target.dp_rank or 0), {}).pop(target.ticket, None)


async def _probe_overhead(
    session: aiohttp.ClientSession, router_url: str, worker_urls: dict[str, str], seed: int
) -> list[float]:
    """Paired tiny requests, direct and through the router: the router hop's added latency.

    The direct request goes to the worker the router chose when it says which (kvroute does);
    otherwise to the workers in turn, alike on an idle fleet of identical workers.
    """
    rng = random.Random(seed)
    samples: list[float] = []
    urls = list(worker_urls.values())
    for i in range(_PROBES):
        ids = [rng.randrange(3, 259) for _ in range(8)]
        probe = BenchRequest(arrival_s=0.0, input_ids=ids, max_new_tokens=1)
        via = await send_generate(session, Target(url=router_url), probe, i, 0.0, 10.0)
        url = worker_urls.get(via.worker, urls[i % len(urls)])
        if not via.ok or via.e2e_s is None:
            continue
        again = BenchRequest(arrival_s=0.0, input_ids=[*ids[::-1]], max_new_tokens=1)
        direct = await send_generate(session, Target(url=url), again, i, 0.0, 10.0)
        if direct.ok and direct.e2e_s is not None:
            samples.append(max(0.0, via.e2e_s - direct.e2e_s))
    return samples


@contextlib.asynccontextmanager
async def _fleet(spec: FleetSpec) -> AsyncIterator[dict[str, ReferenceWorker]]:
    """A fresh fleet of in-process reference workers; yields them by name."""
    config = ReferenceWorkerConfig(
        page_size=spec.page_size,
        capacity_tokens=spec.capacity_tokens,
        prefill_ms_per_token=spec.prefill_ms_per_token,
        decode_ms_per_token=spec.decode_ms_per_token,
        max_running_requests=spec.max_running_requests,
        time_scale=spec.time_scale,
        dp_size=spec.dp_size,
        host_capacity_tokens=spec.host_capacity_tokens,
        host_load_ms_per_token=spec.host_load_ms_per_token,
        transfer_ms_per_token=spec.transfer_ms_per_token,
        overlap_schedule=spec.overlap_schedule,
    )
    roles = (
        pd_names(spec.prefill_workers, spec.decode_workers)
        if spec.disaggregated
        else [(f"w{i}", "both") for i in range(spec.workers)]
    )
    async with contextlib.AsyncExitStack() as stack:
        yield {
            name: await stack.enter_async_context(ReferenceWorker(pd_config(config, role)))
            for name, role in roles
        }


async def _await_streams(
    service: RouterService, urls: dict[str, str], page_size: int, seed: int
) -> None:
    """Make each worker publish a page until the router's indexer has applied one from each.

    ZMQ subscriptions join asynchronously and a PUB drops what it sends before that, so the
    probe repeats (a fresh page each time) until every event path is proven live. The probe
    pages are unique and negligible next to any working set.
    """
    rng = random.Random(seed ^ 0x5EED)
    async with aiohttp.ClientSession() as session, asyncio.timeout(20.0):
        while True:
            live = {
                s.worker
                for s in service.indexer.streams()
                if s.state == StreamState.SYNCED and s.blocks_stored > 0
            }
            waiting = [url for name, url in urls.items() if name not in live]
            if not waiting:
                return
            for url in waiting:
                ids = [rng.randrange(3, 259) for _ in range(page_size + 1)]
                probe = BenchRequest(arrival_s=0.0, input_ids=ids, max_new_tokens=1)
                record = await send_generate(session, Target(url=url), probe, 0, 0.0, 10.0)
                if not record.ok:
                    raise HarnessError(f"worker {url} failed a warm-up request: {record.error}")
            await asyncio.sleep(0.05)


def policy_config(
    policy: str,
    spec: FleetSpec,
    seed: int,
    weights: PolicyWeights,
    *,
    hold_until_room: bool = False,
) -> PolicyConfig:
    """The `[policy]` a router run of the benchmark gets (the report lists what in it differs
    from the router's defaults: `settings_not_default`)."""
    return PolicyConfig(
        name=policy,  # type: ignore[arg-type]
        seed=seed,
        hold_until_room=hold_until_room,
        # the fleet's decode step, as an operator sets it for theirs
        admission_batch_window_ms=spec.decode_step_ms,
        decode_step_weight=spec.decode_step_weight,
        **{k: v for k, v in msgspec.structs.asdict(weights).items() if v is not None},
    )


def settings_not_default(config: PolicyConfig) -> dict[str, tuple[object, object]]:
    """Each setting of `config` that differs from the router's default: (its value, the
    default's)."""
    defaults = msgspec.structs.asdict(PolicyConfig())
    return {
        name: (value, defaults[name])
        for name, value in msgspec.structs.asdict(config).items()
        if value != defaults[name]
    }


@contextlib.asynccontextmanager
async def _router(
    policy: str,
    fleet: dict[str, ReferenceWorker],
    spec: FleetSpec,
    seed: int,
    weights: PolicyWeights,
    *,
    hold_until_room: bool = False,
) -> AsyncIterator[str]:
    """A router with `policy` in front of the workers; yields its URL once its streams are live."""
    config = RouterConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        admin=AdminConfig(enabled=False),
        policy=policy_config(policy, spec, seed, weights, hold_until_room=hold_until_room),
        workers=tuple(RoutedWorker(url=w.url, id=name) for name, w in fleet.items()),
    )
    async with RouterService(config) as service:
        try:
            if spec.disaggregated:  # roles and bootstrap ports discovered from /server_info
                await await_pd_streams(service, fleet, spec.page_size, seed)
            else:
                urls = {name: w.url for name, w in fleet.items()}
                await _await_streams(service, urls, spec.page_size, seed)
        except TimeoutError as exc:
            raise HarnessError("the router's KV-event streams did not become live") from exc
        yield service.url


async def run_policy(
    policy: str,
    workload: Workload,
    spec: FleetSpec,
    seed: int,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
    timeout_s: float = 60.0,
    weights: PolicyWeights | None = None,
    sglang_router_python: str | None = None,
) -> PolicyRun:
    """Run `workload` with `policy` on a fresh fleet and collect every request's record.

    `sglang_router_python` is the interpreter that runs sglang-router, for its policy only.
    """
    started = time.perf_counter()
    weights = weights or PolicyWeights()
    overhead: list[float] = []
    isolation: list[EndpointIsolation] = []
    affinity: AffinityProbe | None = None
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024), timeout=aiohttp.ClientTimeout(total=None)
        ) as session,
        _fleet(spec) as fleet,
    ):
        names = {name: w.url for name, w in fleet.items()}
        workers = list(names.values())
        if policy == ORACLE and spec.disaggregated:
            raise HarnessError("the oracle routes to single workers: no prefill/decode oracle")
        if policy == ORACLE:
            oracle = _Oracle(list(names.values()), spec.page_size, seed)
            records = await _drive(session, workload, oracle, timeout_s, on_done)
            by_url = {url: name for name, url in names.items()}
            for r in records:
                r.worker = by_url.get(r.worker, r.worker)
        elif policy == SGLANG_CACHE_AWARE:
            if sglang_router_python is None:
                raise HarnessError(f"{policy} needs the python that has sglang-router")
            pd = sglang_pd_args(fleet) if spec.disaggregated else None
            # one cache per DP rank: its dp-aware mode routes to ranks, as kvroute does
            dp = ["--dp-aware"] if spec.dp_size > 1 else []
            async with launch_sglang_router(
                sglang_router_python, workers, extra_args=dp, pd_args=pd
            ) as router_url:
                chooser = _ViaRouter(router_url)
                records = await _drive(session, workload, chooser, timeout_s, on_done)
                overhead = await _probe_overhead(session, router_url, names, seed)
                isolation = await probe_isolation(session, router_url, seed)
                affinity = await probe_affinity(session, router_url, seed)
        else:
            if policy == KV_DEFAULT:
                policy_name, weights = "kv", PolicyWeights()
            else:
                policy_name = "kv" if policy == KV_HOLD else policy
            async with _router(
                policy_name, fleet, spec, seed, weights, hold_until_room=policy == KV_HOLD
            ) as router_url:
                chooser = _ViaRouter(router_url)
                records = await _drive(session, workload, chooser, timeout_s, on_done)
                overhead = await _probe_overhead(session, router_url, names, seed)
                isolation = await probe_isolation(session, router_url, seed)
                affinity = await probe_affinity(session, router_url, seed)
    return PolicyRun(
        policy=policy,
        records=records,
        wall_s=time.perf_counter() - started,
        route_overhead_s=overhead,
        isolation=isolation,
        affinity=affinity,
    )
