"""What the dashboard page shows, as one JSON document built from the router's live objects.

`snapshot(app)` reads the worker pool and load tracker (through the planner), the indexer's
streams and namespaces, and the decision statistics, and copies what the page renders into
Structs, so the page's contract is typed and a field cannot appear by accident. Nothing here
keeps a number of its own: every figure is read from the object that already owns it, the same
objects `/metrics` and the admin API read.

Salts never reach this document: namespaces and decisions carry keyed fingerprints only, as in
`GET /admin/namespaces`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping

import msgspec
from aiohttp import web

from router.http.decisions import WINDOW_BUCKET_S, Decision
from router.http.keys import CLUSTER, CONFIG, DECISIONS, FINGERPRINT, INDEXER, PLANNER
from router.routing.load import WorkerLoad

__all__ = [
    "MAX_DECISIONS",
    "MAX_NAMESPACES",
    "DashboardState",
    "DecisionRow",
    "NamespaceRow",
    "PeriodRow",
    "Prediction",
    "RankRow",
    "StreamRow",
    "WorkerRow",
    "encode",
    "rank_rows",
    "snapshot",
]

MAX_NAMESPACES = 50  # the largest ones; the count says how many there are in all
MAX_DECISIONS = 20  # of the decision log's last 50: what fits on a screen
_MINUTE_BUCKETS = 60 // WINDOW_BUCKET_S
_json = msgspec.json.Encoder()


class WorkerRow(msgspec.Struct, kw_only=True):
    """One worker: health and load over its ranks."""

    id: str
    url: str
    status: str  # ready, unhealthy, draining, circuit open, ... (`WorkerStatus`)
    healthy: bool
    draining: bool
    breaker: str
    role: str
    model: str
    running: int
    queued_prefill_tokens: int
    # seconds its KV events stay unfollowed by the false-hit watch (routed by load, no hit
    # predicted), as `GET /admin/workers` says; 0: followed
    unfollowed_s: float


class RankRow(msgspec.Struct, kw_only=True):
    """One (worker, dp rank): its load and its stream's state."""

    worker: str
    dp_rank: int | None  # None: requests sent without a rank (the engine picked)
    running: int
    queued_prefill_tokens: int
    kv_tokens: int
    stream_state: str | None  # None: no KV-event stream for this rank


class StreamRow(msgspec.Struct, kw_only=True):
    """One KV-event stream."""

    stream: str
    worker: str
    dp_rank: int
    state: str
    lag_s: float | None  # seconds since its last event; None before the first
    last_seq: int | None
    entries: int
    block_size: int | None
    gaps: int
    replays: int
    restarts: int
    decode_errors: int


class NamespaceRow(msgspec.Struct, kw_only=True):
    """One namespace, by keyed fingerprint."""

    id: str
    model: str
    lora: str | None
    salted: bool
    blocks: int
    tokens: int
    holders: dict[str, int]  # worker -> blocks


class PeriodRow(msgspec.Struct, kw_only=True):
    """Prediction and cache reuse over one period (ratios are None without data)."""

    start: float  # unix seconds
    seconds: int
    requests: int
    usage_reports: int
    # exact predictions / answers that reported cached tokens, but those of workers whose KV
    # events were unfollowed (no hit predicted on purpose: `router.http.decisions`)
    accuracy: float | None
    hit_rate: float | None  # cached tokens the workers reported / prompt tokens
    predicted_hit_rate: float | None  # cached tokens the index predicted / prompt tokens


class DecisionRow(msgspec.Struct, kw_only=True):
    """One recent routing decision and why it went where it went."""

    at: float
    request_id: str
    endpoint: str
    model: str
    namespace: str  # a keyed fingerprint
    worker: str
    dp_rank: int | None
    attempt: int
    prompt_tokens: int
    # the prediction at admission, as x-kvroute-matched-tokens said it (it showed the raw match,
    # prefixes the forecast said would be evicted included), and that raw match beside it
    matched_tokens: int
    raw_matched_tokens: int
    cached_tokens: int | None
    status: int | None
    ttft_s: float | None
    duration_s: float | None
    reason: str  # prefix, load or none
    explanation: str


class Prediction(msgspec.Struct, kw_only=True):
    """The rolling window: the whole of it, per minute, and per bucket (for the sparkline)."""

    total: PeriodRow
    minutes: list[PeriodRow]  # oldest first
    buckets: list[PeriodRow]  # oldest first


class DashboardState(msgspec.Struct, kw_only=True):
    """`GET /dashboard/state`: everything the dashboard page renders."""

    generated_at: float
    login: bool  # whether the page is behind the admin token (else there is no session to end)
    policy: str
    cluster: dict[str, object] | None  # what /health says of the replicas, with a [cluster]
    workers: list[WorkerRow]
    ranks: list[RankRow]
    streams: list[StreamRow]
    namespaces: list[NamespaceRow]
    namespace_count: int
    prediction: Prediction
    decisions: list[DecisionRow]  # newest first


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _period(rows: list[dict[str, float]]) -> PeriodRow:
    """The buckets in `rows` as one period: the counts summed, the ratios taken of the sums."""

    def total(key: str) -> float:
        return sum(r[key] for r in rows)

    prompt = total("prompt_tokens")
    usage = total("usage_reports")
    judged = usage - total("unfollowed")
    return PeriodRow(
        start=rows[0]["start"],
        seconds=WINDOW_BUCKET_S * len(rows),
        requests=int(total("requests")),
        usage_reports=int(usage),
        accuracy=_ratio(total("exact"), judged),
        hit_rate=_ratio(total("cached_tokens"), prompt),
        predicted_hit_rate=_ratio(total("predicted_tokens"), prompt),
    )


def _prediction(window: list[dict[str, float]]) -> Prediction:
    minutes = [
        _period(window[i : i + _MINUTE_BUCKETS]) for i in range(0, len(window), _MINUTE_BUCKETS)
    ]
    return Prediction(
        total=_period(window), minutes=minutes, buckets=[_period([row]) for row in window]
    )


def _decision(d: Decision) -> DecisionRow:
    chosen = d.chosen
    return DecisionRow(
        at=d.at,
        request_id=d.request_id,
        endpoint=d.endpoint,
        model=d.model,
        namespace=d.namespace,
        worker=chosen.worker,
        dp_rank=chosen.dp_rank,
        attempt=d.attempt,
        prompt_tokens=d.prompt_tokens,
        matched_tokens=chosen.predicted_split[0],
        raw_matched_tokens=chosen.matched_tokens,
        cached_tokens=d.cached_tokens,
        status=d.status,
        ttft_s=d.ttft_s,
        duration_s=d.duration_s,
        reason=d.reason(),
        explanation=d.explain(),
    )


def rank_rows(
    workers: list[str],
    streams: list[StreamRow],
    loads: Mapping[tuple[str, int | None], WorkerLoad],
) -> list[RankRow]:
    """One row per (worker, dp rank): each rank its streams name, with the load counted there.

    A request sent without a rank counts under rank None (`LoadTracker`). On a worker with one
    stream that is the one scheduler there is, so it is shown on that rank; on a worker with
    several it stays a row of its own ("the engine picked"), and a worker without streams has
    just that row.
    """
    rows = []
    for worker in workers:
        states = {s.dp_rank: s.state for s in streams if s.worker == worker}
        counted = {rank: load for (w, rank), load in loads.items() if w == worker}
        unranked = counted.pop(None, None)
        shown: list[int | None] = [*sorted(set(states) | {r for r in counted if r is not None})]
        if len(shown) != 1 and (unranked is not None or not shown):
            shown.insert(0, None)  # its own row: no single rank it stands for
        for rank in shown:
            parts = [counted.get(rank) if rank is not None else unranked]
            if len(shown) == 1 and rank is not None:
                parts.append(unranked)
            loads_here = [p for p in parts if p is not None]
            rows.append(
                RankRow(
                    worker=worker,
                    dp_rank=rank,
                    running=sum(p.running for p in loads_here),
                    queued_prefill_tokens=sum(p.queued_prefill_tokens for p in loads_here),
                    kv_tokens=sum(p.kv_tokens for p in loads_here),
                    stream_state=states.get(rank) if rank is not None else None,
                )
            )
    return rows


def snapshot(app: web.Application, *, login: bool) -> DashboardState:
    """The dashboard's document, read from `app`'s live objects (on the loop: no await)."""
    planner = app[PLANNER]
    indexer = app[INDEXER]
    fingerprint = app[FINGERPRINT]
    now = planner.clock()
    workers = []
    for entry in planner.pool:
        load = planner.load.total(entry.id)
        workers.append(
            WorkerRow(
                id=entry.id,
                url=entry.url,
                status=str(entry.status(now)),
                healthy=entry.healthy,
                draining=entry.draining,
                breaker=str(entry.breaker.state(now)),
                role=str(entry.role),
                model=entry.cache_model,
                running=load.running,
                queued_prefill_tokens=load.queued_prefill_tokens,
                unfollowed_s=round(entry.unfollowed_s(now), 1),
            )
        )
    stream_stats = indexer.streams()
    streams = [
        StreamRow(
            stream=s.stream,
            worker=s.worker,
            dp_rank=s.dp_rank,
            state=str(s.state),
            lag_s=s.last_event_age_s,
            last_seq=s.last_seq,
            entries=s.entries,
            block_size=s.block_size,
            gaps=s.gaps,
            replays=s.replays,
            restarts=s.restarts,
            decode_errors=s.decode_errors,
        )
        for s in stream_stats
    ]
    streams.sort(key=lambda s: (s.worker, s.dp_rank))
    ranks = rank_rows([e.id for e in planner.pool], streams, planner.load.by_target())
    stats = indexer.namespaces()
    largest = heapq.nlargest(MAX_NAMESPACES, stats, key=lambda s: s.tokens)
    namespaces = [
        NamespaceRow(
            id=fingerprint(s.namespace),
            model=s.namespace.model,
            lora=s.namespace.lora,
            salted=s.namespace.cache_salt is not None,
            blocks=s.blocks,
            tokens=s.tokens,
            holders=dict(sorted(s.holders.items())),
        )
        for s in largest
    ]
    decisions = app[DECISIONS]
    recent = list(decisions.recent)[-MAX_DECISIONS:]
    cluster = app.get(CLUSTER)
    return DashboardState(
        generated_at=time.time(),
        login=login,
        policy=str(app[CONFIG].current.policy.name),
        cluster=cluster.describe() if cluster is not None else None,
        workers=workers,
        ranks=ranks,
        streams=streams,
        namespaces=namespaces,
        namespace_count=len(stats),
        prediction=_prediction(decisions.window()),
        decisions=[_decision(d) for d in reversed(recent)],
    )


def encode(state: DashboardState) -> bytes:
    """The JSON body of `state`."""
    return _json.encode(state)
