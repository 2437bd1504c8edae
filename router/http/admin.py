"""The admin API under /admin: workers, namespaces, streams, route dry run, index dump, reload.

A sub-application with its own bearer-token middleware. Salts never leave the router: namespaces
are shown and addressed by keyed fingerprint (`router.routing.namespace`), and an eviction by
`cache_salt` answers with fingerprints only. With a `[cluster]`, a change to the fleet (add,
remove, drain) or an eviction is made here, then written to the state the replicas share, so
every replica makes it too (`router.cluster.fleet_state`); its answer's `cluster` says whether
it was (`"shared"`) or is kept here until NATS answers (`"pending"`: the other replicas do not
make it yet, and it is lost if this replica stops first).

Each change is said in one INFO line (`admin: ...`), naming the worker by its id and a namespace
by its fingerprint (never a salt), as a reload's and another replica's changes are; an index
load's line is the indexer's own (`snapshot loaded: ...`, what it brought).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from indexer.service import Namespace
from router.config import WorkerConfig
from router.errors import AuthError, NotFoundError, PayloadTooLargeError, RequestError
from router.http.bearer import bears_token
from router.http.intake import read_request
from router.http.keys import (
    CLUSTER,
    CONFIG,
    FINGERPRINT,
    INDEXER,
    PAIRS,
    PLANNER,
    RELOADER,
    SESSION,
    SUPERVISOR,
    TOKENIZER,
)
from router.http.listener import SNAPSHOT_PATH
from router.http.memory import add_memory_routes
from router.http.no_worker import no_pair, no_worker
from router.http.request_body import decode_body, read_body
from router.prompt.request import Endpoint, check_salt_size, json_error
from router.routing.pool import WorkerEntry, WorkerSummary

__all__ = ["create_admin_app"]

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_json = msgspec.json.Encoder()
_T = TypeVar("_T")


class EvictRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /admin/namespaces/evict: exactly one of cache_salt / namespace."""

    cache_salt: str | None = None
    namespace: str | None = None  # a fingerprint from GET /admin/namespaces
    flush_workers: bool = False


class DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /admin/workers/{id}/drain (optional)."""

    drain: bool = True


def _reply(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


def _decode(raw: bytes, kind: type[_T]) -> _T:
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc)) from exc
    except msgspec.DecodeError as exc:
        # an empty admin body is `{}` above: what is left is the body's own fault
        raise RequestError(json_error(raw, exc)) from None


def _token_middleware(token: str) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if not bears_token(request.headers, token):
            raise AuthError("admin API: missing or wrong bearer token")
        return await handler(request)

    return check


def _with_sharing(payload: object, sharing: str | None) -> object:
    """`payload`, with `"cluster": sharing` where a replica shared (or kept) the change."""
    if sharing is None:
        return payload
    return {**msgspec.to_builtins(payload), "cluster": sharing}


def _told(sharing: str | None) -> str:
    """What the admin change's line says of the other replicas (nothing without a cluster)."""
    return "" if sharing is None else f" (cluster: {sharing})"


# fingerprints named in an eviction's line at most: a salt's extra_keys are a namespace each
_NAMED_NAMESPACES = 8


def _namespaces_named(fingerprints: list[str]) -> str:
    shown = ", ".join(fingerprints[:_NAMED_NAMESPACES]) or "none"
    rest = len(fingerprints) - _NAMED_NAMESPACES
    return shown if rest <= 0 else f"{shown} and {rest} more"


def _summary(request: web.Request, entry: WorkerEntry) -> WorkerSummary:
    planner = request.config_dict[PLANNER]
    now = planner.clock()
    load = planner.load.total(entry.id)  # over its dp ranks
    return WorkerSummary(
        id=entry.id,
        url=entry.url,
        status=entry.status(now),
        healthy=entry.healthy,
        draining=entry.draining,
        breaker=entry.breaker.state(now),
        consecutive_failures=entry.breaker.failures,
        model=entry.cache_model,
        models=list(entry.models or ()),
        kv_events=entry.config.kv_events,
        discovered=entry.discovered,
        streams=entry.streams,
        role=entry.role,
        queued_prefill_tokens=load.queued_prefill_tokens,
        running=load.running,
        unfollowed_s=round(entry.unfollowed_s(now), 3),
        tokenizer_mismatch=request.config_dict[SUPERVISOR].tokenizer_mismatch(entry.id),
    )


async def list_workers(request: web.Request) -> web.Response:
    """GET /admin/workers."""
    pool = request.config_dict[PLANNER].pool
    return _reply({"workers": [_summary(request, e) for e in pool]})


async def add_worker(request: web.Request) -> web.Response:
    """POST /admin/workers: {url, ...}; omitted event settings come from /server_info.

    201 once registered and health-checked; 400 when its discovery is refused (connection
    refused, settings that cannot be trusted) before the answer; 202 when it is still being
    discovered after a few health timeouts (`Supervisor.add`): in the pool, `checking`, with
    `not_registered` saying why, its discovery going on in the background."""
    config = _decode(await read_body(request), WorkerConfig)
    supervisor = request.config_dict[SUPERVISOR]
    entry = await supervisor.add(config, must_register=True)
    sharing = None
    if (cluster := request.config_dict.get(CLUSTER)) is not None:
        sharing = await cluster.worker_changed(entry.id, entry.config, draining=entry.draining)
    summary = _with_sharing(_summary(request, entry), sharing)
    if supervisor.discovering(entry.id):
        why = supervisor.not_registered(entry.id) or "its first health check is under way"
        log.info("admin: worker %s added, still being discovered%s", entry.id, _told(sharing))
        return _reply({**msgspec.to_builtins(summary), "not_registered": why}, status=202)
    log.info("admin: worker %s added%s", entry.id, _told(sharing))
    return _reply(summary, status=201)


async def delete_worker(request: web.Request) -> web.Response:
    """DELETE /admin/workers/{id}.

    With a `[cluster]`, an id whose record in the shared fleet this replica could not read
    (an older version's, of an id refused now: `WorkerConfig`) is removed from the fleet too,
    though no worker of it is here: the replicas that took it drop it."""
    worker_id = request.match_info["id"]
    cluster = request.config_dict.get(CLUSTER)
    if (
        cluster is not None
        and request.config_dict[PLANNER].pool.find(worker_id) is None
        and cluster.fleet.unread_worker(worker_id)
    ):
        removed, unread = worker_id, True
    else:
        removed, unread = (await request.config_dict[SUPERVISOR].remove(worker_id)).id, False
    sharing = None
    if cluster is not None:
        sharing = await cluster.worker_changed(removed, None, removed=True)
    if unread:
        # repr: such an id may hold a newline (`WorkerConfig` checks ids now), a forged line
        what = "removed from the shared fleet (no worker of it here)"
        log.info("admin: worker %r %s%s", removed, what, _told(sharing))
    else:
        log.info("admin: worker %s removed%s", removed, _told(sharing))
    return _reply(_with_sharing({"removed": removed}, sharing))


async def drain_worker(request: web.Request) -> web.Response:
    """POST /admin/workers/{id}/drain: no new requests; in-flight ones finish."""
    body = _decode(await read_body(request), DrainRequest)
    entry = request.config_dict[PLANNER].pool.get(request.match_info["id"])
    was, entry.draining = entry.draining, body.drain
    sharing = None
    if (cluster := request.config_dict.get(CLUSTER)) is not None:
        sharing = await cluster.worker_changed(entry.id, entry.config, draining=entry.draining)
    log.info(
        "admin: worker %s %s%s%s",
        entry.id,
        "drained: no new requests" if body.drain else "undrained: takes requests again",
        " (it was already)" if was == body.drain else "",
        _told(sharing),
    )
    return _reply(_with_sharing(_summary(request, entry), sharing))


def _namespace_row(
    request: web.Request, ns: Namespace, blocks: int, tokens: int, holders: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": request.config_dict[FINGERPRINT](ns),
        "model": ns.model,
        "lora": ns.lora,
        "salted": ns.cache_salt is not None,
        "blocks": blocks,
        "tokens": tokens,
        "holders": holders,
    }


async def list_namespaces(request: web.Request) -> web.Response:
    """GET /admin/namespaces: fingerprint, size and holders of every indexed namespace."""
    rows = [
        _namespace_row(request, s.namespace, s.blocks, s.tokens, s.holders)
        for s in request.config_dict[INDEXER].namespaces()
    ]
    rows.sort(key=lambda r: (-r["tokens"], r["id"]))
    return _reply({"namespaces": rows})


_NO_SALT_FLUSH = (
    "skipped: its /flush_cache cannot flush one salt (it would empty the whole cache); its "
    "pages of this namespace go as it evicts them"
)


async def _flush(session: aiohttp.ClientSession, url: str, salt: str) -> str:
    try:
        async with session.post(
            url + "/flush_cache", json={"cache_salt": salt}, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            await resp.read()
            return "ok" if resp.status < 300 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def evict_namespace(request: web.Request) -> web.Response:
    """POST /admin/namespaces/evict: drop a namespace from the index, optionally from workers."""
    body = _decode(await read_body(request), EvictRequest)
    if (body.cache_salt is None) == (body.namespace is None):
        raise RequestError("give exactly one of cache_salt or namespace")
    if body.cache_salt is not None:
        check_salt_size(body.cache_salt, "cache_salt", request.config_dict[CONFIG].current.limits)
    indexer = request.config_dict[INDEXER]
    fingerprint = request.config_dict[FINGERPRINT]
    # every namespace the index has an entry of, not only those with blocks that GET
    # /admin/namespaces lists: an extra_key's namespace holds pending marks alone (no event
    # shows its pages), and the marks left behind by an eviction and flush of its salt
    # predicted the pages just emptied, a false hit until they expired
    held = indexer.held_namespaces()
    if body.namespace is not None:
        targets = [ns for ns in held if fingerprint(ns) == body.namespace]
        if not targets:
            # not echoed: a salt given in the wrong field would be sent back, and logged by
            # whatever records the answer
            raise NotFoundError(
                "no namespace with that id in the index (ids are the fingerprints GET "
                "/admin/namespaces lists; to evict by salt, give cache_salt)"
            )
        salt = targets[0].cache_salt
    else:
        salt = body.cache_salt or None
        # any model, adapter or extra_key of the salt
        targets = [ns for ns in held if ns.cache_salt == salt]
    if body.flush_workers and salt is None:
        raise RequestError(
            "flush_workers needs a salted namespace (an unsalted flush would empty whole caches)"
        )
    pool = list(request.config_dict[PLANNER].pool)
    entries = [e for e in pool if e.flushes_by_salt] if body.flush_workers else []
    # A worker's flush empties the whole salt (every model, adapter and extra_key of it:
    # the reference worker's `/flush_cache {"cache_salt"}`), so the index forgets the whole
    # salt too, here and on every replica. Before, a namespace evicted with a flush dropped
    # that namespace alone, and the salt's others went on predicting pages just flushed.
    whole_salt = body.cache_salt is not None or bool(entries)
    if whole_salt and body.namespace is not None:
        targets = [ns for ns in held if ns.cache_salt == salt]
    dropped = sum(indexer.evict_namespace(ns) for ns in targets)
    sharing = None
    if (cluster := request.config_dict.get(CLUSTER)) is not None:
        if whole_salt:
            # by salt even when this index holds none of it: another replica's may
            sharing = await cluster.salt_evicted(salt or "")
        elif targets:
            sharing = await cluster.namespaces_evicted(targets)
    flushed: dict[str, str] = {}
    if body.flush_workers and salt is not None:
        # all at once: one unreachable worker must not hold the answer for 10 s per worker
        session = request.config_dict[SESSION]
        results = await asyncio.gather(*(_flush(session, e.url, salt) for e in entries))
        flushed = {e.id: result for e, result in zip(entries, results, strict=True)}
        for e in pool:
            if not e.flushes_by_salt:
                # SGLang's /flush_cache (0.5.23) takes no salt: it would empty every tenant's
                # pages there, not this one's
                flushed[e.id] = _NO_SALT_FLUSH
    names = sorted(fingerprint(ns) for ns in targets)
    answer = {"namespaces": names, "entries_dropped": dropped, "flushed": flushed}
    # each flush by its outcome's first word ("ok", "HTTP 500", "skipped", the error's type)
    outcomes = ", ".join(f"{w} {result.partition(':')[0]}" for w, result in flushed.items())
    how = ""
    if body.cache_salt is not None:
        how = " by cache_salt"
    elif whole_salt:
        how = " (every namespace of its salt: workers flush it)"
    log.info(
        "admin: namespace(s) evicted%s: %s (%d index entries dropped)%s%s",
        how,
        _namespaces_named(names),
        dropped,
        f"; workers flushed: {outcomes}" if flushed else "",
        _told(sharing),
    )
    return _reply(_with_sharing(answer, sharing))


async def list_streams(request: web.Request) -> web.Response:
    """GET /admin/streams: one row per (worker, dp rank) KV-event stream."""
    rows = []
    indexer = request.config_dict[INDEXER]
    index = indexer.index
    for stats in indexer.streams():
        row = msgspec.to_builtins(stats)
        row["lag_s"] = stats.last_event_age_s
        # how a request is keyed there, and cut: what explains a match the counters do not
        known = index.has_stream(stats.stream)
        row["bigram"] = index.bigram(stats.stream) if known else None
        row["lookahead"] = index.lookahead(stats.stream) if known else 0
        rows.append(row)
    return _reply({"streams": rows})


async def route_dry_run(request: web.Request) -> web.Response:
    """POST /admin/route: how the body would be routed now; routes nothing, changes nothing."""
    endpoint = None
    if "endpoint" in request.query:
        try:
            endpoint = Endpoint(request.query["endpoint"])
        except ValueError:
            raise RequestError(f"endpoint must be one of {[e.value for e in Endpoint]}") from None
    # the proxy's own intake: a dry run accepts exactly what the proxy accepts
    config = request.config_dict[CONFIG].current
    parsed = await read_request(request, endpoint, config, request.config_dict[TOKENIZER])
    planner = request.config_dict[PLANNER]
    choice = planner.pool.resolve(parsed.model)  # UnknownModelError as the proxy would
    ns = planner.namespace(parsed, config.limits)
    pairs = request.config_dict.get(PAIRS)
    if pairs is not None and pairs.applies(ns.model):
        # a pair: the prefill side (where the prefix is reused) leads, both are explained
        pd = pairs.plan(parsed, ns)
        side = pairs.unserved_rank(parsed, ns, pd)
        if side is not None:  # as the pair dispatcher answers it
            raise RequestError(f"no {side} worker has the dp rank {parsed.dp_rank} asked for")
        for leg in (pd.prefill, pd.decode):
            planner.explain_hidden(leg.candidates, parsed, ns)
        sides = {
            side: {"worker": p.worker, "dp_rank": p.dp_rank, "candidates": p.candidates}
            for side, p in (("prefill", pd.prefill), ("decode", pd.decode))
        }
        # a pair needs both sides: with either side out there is none, as the proxy's 503
        # says (before, the prefill side's worker was named with no decode and no reason)
        unpaired = no_pair(pd, planner.pool, planner.clock())
        return _reply(
            {
                "mode": "prefill_decode",
                "worker": None if unpaired else pd.prefill.worker,
                "decode_worker": None if unpaired else pd.decode.worker,
                "unroutable": unpaired,
                "model": choice.model,
                "lora": ns.lora,
                "dp_rank": None if unpaired else pd.prefill.dp_rank,
                "namespace": pd.prefill.namespace,
                "prompt_tokens": pd.prefill.prompt_tokens,
                "endpoint": parsed.endpoint.value,
                "unindexed": pd.prefill.unindexed,
                "candidates": pd.prefill.candidates,
                **sides,
            }
        )
    plan = planner.plan(parsed, ns)
    # a shadow's hidden entries named, so they do not read as a cold cache
    planner.explain_hidden(plan.candidates, parsed, ns)
    for candidate in plan.candidates:  # what a full batch there would make it wait
        candidate.queue = planner.policy.explain_queue(candidate)
    # as the proxy answers it (a RequestError for a dp rank no worker has): a dry run says
    # what the request would get
    unroutable = None
    if plan.worker is None:
        unroutable = no_worker(plan, parsed, ns.model, planner.pool, planner.clock())
    return _reply(
        {
            "worker": plan.worker,
            "unroutable": unroutable,
            # the served model it resolved to, and the LoRA adapter its namespace holds
            "model": choice.model,
            "lora": ns.lora,
            "dp_rank": plan.dp_rank,
            "namespace": plan.namespace,
            "prompt_tokens": plan.prompt_tokens,
            "endpoint": parsed.endpoint.value,
            "unindexed": plan.unindexed,
            # the learned hit/load balance, when `policy.balance_learning` is on
            "balance": plan.balance,
            "candidates": plan.candidates,
        }
    )


async def dump_index(request: web.Request) -> web.Response:
    """GET /admin/index/dump: the indexer's versioned msgpack snapshot."""
    data = request.config_dict[INDEXER].dump()
    return web.Response(body=data, content_type="application/x-msgpack")


async def load_index(request: web.Request) -> web.Response:
    """POST /admin/index/load: replace the index with a snapshot from /admin/index/dump.

    Its body is bounded by `limits.max_snapshot_bytes`, not by the clients' `max_body_bytes`
    (aiohttp's `client_max_size`, which `request.read` applies): a dump of a large index is
    larger than any request."""
    limit = request.config_dict[CONFIG].current.limits.max_snapshot_bytes
    too_large = PayloadTooLargeError(
        f"the snapshot is over limits.max_snapshot_bytes ({limit} bytes)"
    )
    data = bytearray()
    async for chunk in request.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise too_large
    try:
        decoded = await decode_body(request, bytes(data), limit)
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    request.config_dict[INDEXER].load(decoded)
    return _reply({"loaded": True})


async def reload_config(request: web.Request) -> web.Response:
    """POST /admin/reload: read the config file again and apply it (`router.http.reload`);
    400 naming the key of an invalid file, the running config kept."""
    reloader = request.config_dict[RELOADER]
    diff, processes = await reloader.reload_everywhere()
    source = reloader.source
    answer = {"reloaded": source.path if source else None, **msgspec.to_builtins(diff)}
    if processes is not None:  # kvroute serve --processes N: the others told too
        answer["processes"] = msgspec.to_builtins(processes)
    return _reply(answer)


def create_admin_app(token: str) -> web.Application:
    """The /admin sub-application; no token means no auth (allowed on loopback only)."""
    app = web.Application(middlewares=[_token_middleware(token)] if token else [])
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    # an id is any character (`.` leaves out a newline): a worker of an id with one, taken
    # before ids were checked, could be neither drained nor removed (the router's 404), and an
    # older replica's record of one is removed here (`delete_worker`)
    app.router.add_post(r"/workers/{id:[\s\S]+}/drain", drain_worker)
    app.router.add_delete(r"/workers/{id:[\s\S]+}", delete_worker)
    app.router.add_get("/namespaces", list_namespaces)
    app.router.add_post("/namespaces/evict", evict_namespace)
    app.router.add_get("/streams", list_streams)
    app.router.add_post("/route", route_dry_run)
    app.router.add_get("/index/dump", dump_index)
    app.router.add_post(SNAPSHOT_PATH.removeprefix("/admin"), load_index)
    app.router.add_post("/reload", reload_config)
    add_memory_routes(app)
    return app
