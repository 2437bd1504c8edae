"""The router's aiohttp application: routes, error middleware, and the resources it owns.

`create_app(config)` builds the app; its cleanup context opens the upstream client session and
the indexer, registers the configured workers, and runs the health loop, and closes all of it
in reverse order on shutdown. Every error becomes JSON `{"error": {"type", "message"}}` in one
middleware, with the status its RouterError subclass names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
import msgspec
from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from indexer.errors import IndexerError
from indexer.service import IndexerConfig, IndexerService
from router.config import LiveConfig, RouterConfig
from router.errors import (
    AmbiguousModelError,
    ModelUnavailableError,
    RouterError,
    UnknownModelError,
)
from router.fleet.supervisor import Supervisor
from router.http import operations
from router.http.admin import create_admin_app
from router.http.dashboard.routes import add_dashboard_routes
from router.http.keys import (
    CLUSTER,
    CONFIG,
    CONFIG_SOURCE,
    DASHBOARD_SESSION,
    FINGERPRINT,
    INDEXER,
    METRICS,
    PAIRS,
    PLANNER,
    PROXY,
    RELAY,
    RELOADER,
    SESSION,
    START_CHECKS,
    SUPERVISOR,
    TOKENIZER,
)
from router.http.listener import (
    ADMIN_PREFIX,
    ADMIN_TOKEN,
    DIRECT_ROUTES,
    REJECTIONS,
    STREAM_DESCRIPTORS,
)
from router.http.metrics import REQUEST_MODEL, UNKNOWN_MODEL, RouterMetrics, route_template
from router.http.observe import (
    OBSERVATION,
    REQUEST_ID_HEADER,
    Unproxied,
    answered_kind,
    client_request_id,
    well_formed_request_id,
)
from router.http.pd import PairDispatcher
from router.http.proxy import Proxy
from router.http.reload import ConfigSource, Reloader
from router.http.request_body import DECODED_CODINGS
from router.http.start_checks import StartChecks
from router.http.upstream_client import UpstreamClient
from router.prompt.request import Endpoint
from router.routing.load import LoadTracker
from router.routing.namespace import Fingerprinter
from router.routing.pd import PairPlanner
from router.routing.planner import Planner
from router.routing.policy import build_policy
from router.routing.pool import WorkerPool

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from router.routing.pool import WorkerEntry

__all__ = ["create_app", "create_metrics_app"]

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_json = msgspec.json.Encoder()


def _error(
    status: int,
    kind: str,
    message: str,
    details: dict[str, object] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = _json.encode({"error": {"type": kind, "message": message, **(details or {})}})
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


# the generation endpoints: a request to one is named by its `Observation` (`router.http.proxy`)
_PROXIED = frozenset(endpoint.value for endpoint in Endpoint)


@web.middleware
async def request_id_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Name a request the router answers itself (the admin API, the dashboard, /health): its
    log lines name it and its answer carries it back, as a proxied request's do.

    Before, only proxied requests had an id: an admin change's INFO line was logged under
    `[-]`, and its answer did not echo the client's `x-request-id` (its 401 did).
    """
    resource = request.match_info.route.resource
    if resource is not None and resource.canonical in _PROXIED:
        return await handler(request)  # its Observation names it (and echoes it)
    named = Unproxied.named(request.headers)
    # reset after: the connection's task serves its next request under a name of its own
    token = OBSERVATION.set(named)
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # a redirect (the error middleware answers the rest)
        exc.headers[REQUEST_ID_HEADER] = named.request_id
        raise
    finally:
        OBSERVATION.reset(token)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = named.request_id
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Turn every error into the JSON error shape with the right status."""

    async def route() -> str:
        return await route_template(request.app.router, request, request.match_info)

    return await answer_errors(request, handler, request.config_dict.get(METRICS), route)


async def answer_errors(
    request: web.Request,
    handler: _Handler,
    metrics: RouterMetrics | None,
    route: Callable[[], Awaitable[str]],
) -> web.StreamResponse:
    """`handler`'s answer, or the JSON error of what it raised, counted in `metrics` under
    `route()` (the route's template, never the raw path: `route_template`). A proxied
    request's trace says the status of that error as `router.http.observe.answered_status`
    finds it (change both); its kind is `answered_kind`'s, for both."""
    details: dict[str, object] | None = None
    headers: dict[str, str] | None = None
    model: str | None = None  # the label, when the error says it better than the request
    try:
        return await handler(request)
    except RouterError as exc:
        status, kind, message = exc.status, type(exc).__name__, str(exc)
        details, headers = exc.details(), exc.headers()
        if isinstance(exc, UnknownModelError | ModelUnavailableError):
            model = UNKNOWN_MODEL
        elif isinstance(exc, AmbiguousModelError):
            # refused before it resolved to a served model: the adapter's own name, which
            # workers list (the pool raises it for no other), says which one to rename
            model = exc.model
    except IndexerError as exc:
        status, kind, message = 400, type(exc).__name__, str(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = answered_kind(exc)
        status, message = exc.status, exc.text or exc.reason
        if exc.status == 413:
            # aiohttp's `request.read` past `client_max_size` (a chunked or compressed body
            # growing over it): its text names neither the setting nor what to change
            message = (
                f"the request body is over limits.max_body_bytes ({request.client_max_size} "
                "bytes, counted after Content-Encoding is decoded)"
            )
        # what the status requires beside the body (a 405's Allow, RFC 9110 15.5.6); the body
        # is the JSON error's own
        headers = {
            name: value
            for name, value in exc.headers.items()
            if name.lower() not in ("content-type", "content-length")
        } or None
    except RequestPayloadError as exc:
        # a body that could not be read (broken chunking: aiohttp's parser) or decoded (a
        # broken or cut-short Content-Encoding: `router.http.request_body`): the client's
        # fault. The parser's message may quote body bytes, so only its kind is told
        cause = exc.__cause__ or exc
        status, kind = 400, answered_kind(exc)
        message = (
            f"the request body cannot be decoded ({type(cause).__name__}): check its chunking "
            "and encoding"
        )
        coding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
        if isinstance(cause, ContentEncodingError) and coding in DECODED_CODINGS:
            # the coding is one of the router's own names (never the client's bytes)
            message = (
                f"the request body cannot be decoded (ContentEncodingError): it is not a whole, "
                f"valid {coding} stream"
            )
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception:
        # a bug: say so in the log (tracebacks carry no request bodies, so no salts), answer JSON
        log.exception("unexpected error handling %s %s", request.method, request.path)
        status, kind, message = 500, "InternalError", "internal router error (see the router log)"
    if metrics is not None:
        # never the client's model string: one value stands for every model nobody serves,
        # and an ambiguous adapter's name is one the workers list
        if model is None:
            model = request.get(REQUEST_MODEL, "")
        metrics.rejected.labels(await route(), kind, model).inc()
    given_id = client_request_id(request.headers)  # none its Connection names
    if given_id and well_formed_request_id(given_id):
        # echoed as on a proxied answer, so the client can match the refusal (a malformed
        # one is not: the router never repeats what it would not log)
        headers = {**(headers or {}), REQUEST_ID_HEADER: given_id}
    answer = _error(status, kind, message, details, headers)
    if status == 413:
        # a body refused part-read (chunked or compressed, past the limit): as a declared one
        # (`router.http.listener`), the rest is drained for the client to read the answer,
        # then the connection is closed, not kept for whoever sent that much
        answer.force_close()
    return answer


def _proxy_handler(endpoint: Endpoint) -> _Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request, endpoint)

    return handle


def _direct_routes(app: web.Application) -> dict[str, _Handler]:
    """The generation endpoints as the listener serves them without the app's router and
    middleware chain (`GuardedServer.direct`; 29 fewer Python calls per request): what the
    chain does for these routes, the error answers and their count, is done here. The proxy
    is the app's (it exists once the app's resources are open)."""
    metrics = app[METRICS]
    routes: dict[str, _Handler] = {}
    for endpoint in Endpoint:

        async def serve(request: web.Request, endpoint: Endpoint = endpoint) -> web.StreamResponse:
            return await app[PROXY].handle(request, endpoint)

        async def label(path: str = endpoint.value) -> str:
            return path  # the route's template is the path itself

        async def handle(
            request: web.Request,
            serve: _Handler = serve,
            label: Callable[[], Awaitable[str]] = label,
        ) -> web.StreamResponse:
            return await answer_errors(request, serve, metrics, label)

        routes[endpoint.value] = handle
    return routes


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the routable workers can answer a request (one serves whole
    requests, or a prefill and a decode worker of one model make a pair), else 503; with a
    [cluster], where this replica stands with the others ("ok", or "degraded": local state).
    `kvroute relay`'s says "degraded" (200) while its NATS does not answer."""
    return _health(request, _serves)


async def index_health(request: web.Request) -> web.Response:
    """GET /health of `kvroute indexer`: 200 while any worker is routable (its index answers
    for prefill and decode workers alike), else 503."""
    return _health(request, bool)


def _health(request: web.Request, serves_with: Callable[[list[WorkerEntry]], bool]) -> web.Response:
    planner = request.app[PLANNER]
    now = planner.clock()
    workers = list(planner.pool)
    routable = [w for w in workers if w.routable(now)]
    serves = serves_with(routable)
    body: dict[str, object] = {
        # no_pair: workers are routable, but not a prefill and a decode worker of one model
        "status": "ok" if serves else "no_pair" if routable else "no_worker",
        "workers": len(workers),
        "routable": len(routable),
    }
    cluster = request.app.get(CLUSTER)
    if cluster is not None:
        # degraded still serves (on this replica's own state): the status code says "routable"
        body["cluster"] = cluster.describe()
    relay = request.app.get(RELAY)
    if relay is not None:
        body["relay"] = relay.describe()
        if serves and not relay.connected:
            # a relay without NATS writes nothing: not "ok" (before, only relay.status said
            # it); still 200, as a degraded replica's, for what it does is NATS's to mend
            body["status"] = "degraded"
    return web.Response(
        body=_json.encode(body), status=200 if serves else 503, content_type="application/json"
    )


def _serves(routable: list[WorkerEntry]) -> bool:
    """Whether the routable workers can answer a request: one serves whole requests, or a
    prefill worker and a decode worker share a model (prefill/decode pairs need both: with
    every prefill worker drained, the decode workers alone answer nothing)."""
    decoding: set[str] = set()
    prefilling: set[str] = set()
    for entry in routable:
        if entry.role == "both":
            return True
        (decoding if entry.role == "decode" else prefilling).update(entry.models or ("",))
    return bool(decoding & prefilling)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: every model a routable worker serves, once each (an OpenAI list).

    Built from what the router routes by (the workers' configured or discovered names), so a
    client is never shown a model the router would refuse.
    """
    planner = request.app[PLANNER]
    now = planner.clock()
    names: dict[str, None] = {}
    for entry in planner.pool:
        if entry.routable(now):
            names.update(dict.fromkeys(entry.models or ()))
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvroute", "root": name}
        for name in names
    ]
    return web.Response(
        body=_json.encode({"object": "list", "data": data}), content_type="application/json"
    )


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text exposition."""
    body = request.app[METRICS].render()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def _resources(app: web.Application) -> AsyncIterator[None]:
    """Open the session and indexer, register workers, run health checks; close on exit."""
    live = app[CONFIG]
    config = live.current
    section = config.indexer
    indexer_config = IndexerConfig(
        pending_ttl_s=section.pending_ttl_s,
        stale_after_s=section.stale_after_s,
        replay_timeout_s=section.replay_timeout_s,
        probe_interval_s=section.probe_interval_s,
        live_check_interval_s=section.live_check_interval_s,
        rcv_hwm=section.rcv_hwm,
        log_interval_s=section.log_interval_s,
        restart_backoff_max_s=section.restart_backoff_max_s,
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with (
        # no cookie jar: the session is shared by every client, and a jar would send one
        # client's Set-Cookie from a worker on everybody's later requests to that worker
        aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        ) as session,
        UpstreamClient() as upstream,
        contextlib.AsyncExitStack() as relay_stack,
    ):
        tap = app.get(RELAY)
        if tap is not None:
            await relay_stack.enter_async_context(tap)
        # a replica following `kvroute relay` opens no socket to a worker (`indexer.fed_stream`)
        fed = tap is None and config.cluster is not None and config.cluster.events == "relay"
        indexer = await relay_stack.enter_async_context(
            IndexerService(
                indexer_config,
                tap=tap,
                fed=fed,
                # a relay heartbeats every cluster.heartbeat_interval_s: silent past the
                # timeout, what a replica holds of it is stale (not a quiet worker's 30 s)
                fed_silent_after_s=config.cluster.heartbeat_timeout_s
                if fed and config.cluster is not None
                else None,
            )
        )
        if tap is not None:
            tap.indexer = indexer
            app[METRICS].export_cluster(tap.gauges)
        policy = build_policy(config.policy)
        pool = WorkerPool(config.breaker)
        load = LoadTracker()
        planner = Planner(config.policy, policy, pool, indexer, load, app[FINGERPRINT])
        app[METRICS].export_routable(
            lambda: {entry.id: entry.routable(planner.clock()) for entry in pool}
        )
        app[METRICS].export_unfollowed(
            lambda: {entry.id: entry.unfollowed_s(planner.clock()) for entry in pool}
        )
        supervisor = Supervisor(
            pool,
            indexer,
            session,
            config.health,
            policy,
            load,
            app[METRICS],
            planner.clock,
            tokenizer=config.tokenizer,
        )
        app[SESSION] = session
        app[INDEXER] = indexer
        # their whole share, kept out of the listener's connection budget (made after this)
        app[STREAM_DESCRIPTORS] = indexer.stream_descriptors
        app[PLANNER] = planner
        app[SUPERVISOR] = supervisor
        observer = operations.start(app, indexer, load, pool)
        observer.watch = supervisor.watch  # answers that keep reusing far less: checked
        tokenizer = operations.proxy_tokenizer(app)
        app[PROXY] = proxy = Proxy(config, planner, upstream, tokenizer, app[METRICS], observer)
        app[METRICS].holding.set_function(proxy.held)
        # prefill/decode pairs: models whose workers include both roles (router.http.pd)
        app[PAIRS] = pairs = PairPlanner(planner, config.policy, config.pd)
        proxy.pairs = dispatcher = PairDispatcher(config, pairs, proxy, session, app[METRICS])
        # a worker (or a pair's prefill) refusing a rank it was told: its settings read again
        proxy.reread = supervisor.reread
        # SIGHUP and POST /admin/reload: the one path that changes these parts' settings
        app[RELOADER] = reloader = Reloader(
            live,
            app.get(CONFIG_SOURCE),
            planner,
            supervisor,
            proxy,
            pairs,
            dispatcher,
            checks=app[START_CHECKS],
        )
        proxy.fleet_change = reloader.fleet_change  # a reload's gap waited out, not refused
        for worker in config.workers:
            pool.add(worker)
        health_task: asyncio.Task[None] | None = None
        try:
            # the workers that answer are registered before the first request (so it can hit);
            # a hung one goes on being discovered in the background instead of holding the
            # listening socket (and Ctrl-C) for its discovery's whole timeout
            await supervisor.register_all(wait_s=2 * config.health.timeout_s)
            await supervisor.check_all()  # dead workers are out of rotation before the first
            health_task = asyncio.create_task(supervisor.run(), name="kvroute-health")
            async with contextlib.AsyncExitStack() as stack:
                if config.cluster is not None and tap is None:
                    # nats is imported by a replica among others only
                    from router.cluster.service import ClusterService

                    service = ClusterService(
                        config.cluster,
                        planner,
                        supervisor,
                        config.workers,
                        fleet_change=reloader.fleet_change,
                        sessions=app.get(DASHBOARD_SESSION),  # logouts end them everywhere
                    )
                    if (source := app.get(CONFIG_SOURCE)) is not None:
                        # a worker's entry edited since the cluster's record wins over it
                        service.fleet.file_path = source.path
                        service.fleet.file_at = source.modified_at
                    cluster = await stack.enter_async_context(service)
                    app[CLUSTER] = cluster
                    reloader.cluster = cluster  # reloaded workers are shared as admin's are
                    app[METRICS].export_cluster(cluster.gauges)
                yield
        finally:
            if health_task is not None:
                health_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await health_task
            await supervisor.close()


def create_app(
    config: RouterConfig,
    *,
    tracer_provider: TracerProvider | None = None,
    proxy: bool = True,
    config_source: ConfigSource | None = None,
    process: int | None = None,
    relay: bool = False,
) -> web.Application:
    """The router application for `config` (resources open when the app starts).

    `tracer_provider`: trace with this OpenTelemetry provider (tests), whatever the config says.
    `proxy=False`: the index and its APIs without the generation endpoints (`kvroute indexer`).
    `config_source`: the file `config` was read from, read again on a reload.
    `process`: which replica process of `kvroute serve --processes` this is, the `process`
    label on every series of /metrics (each process counts its own).
    `relay`: `kvroute relay` (no proxy either): the index's streams are written to the
    config's [cluster] NATS for the replicas that follow it (`router.cluster.relay_publisher`).
    """
    # what a start refuses, as a reload refuses it (`router.http.start_checks`)
    checks = StartChecks(relay=relay, replicas=process is not None)
    tokenizer = checks.tokenizer(config)
    token = config.admin_token()
    # `[observe] enabled = false` names no request (the proxied ones neither)
    named = [request_id_middleware] if config.observe.enabled else []
    app = web.Application(
        middlewares=[*named, error_middleware], client_max_size=config.limits.max_body_bytes
    )
    app[CONFIG] = LiveConfig(config)
    if relay and config.cluster is not None:  # a relay without one: refused above
        from router.cluster.relay_publisher import RelayPublisher  # nats: the relay's only

        app[RELAY] = RelayPublisher(config.cluster, name=f"kvroute-relay-{os.getpid()}")
        proxy = False
    if config_source is not None:
        app[CONFIG_SOURCE] = config_source
    app[METRICS] = counted = RouterMetrics(
        labels=None if process is None else {"process": str(process)}
    )

    def rejected(route: str, error: str) -> None:
        counted.rejected.labels(route, error, "").inc()  # no body read: no model either

    app[REJECTIONS] = rejected  # the listener's refusals, counted as the app's are
    app[TOKENIZER] = tokenizer
    app[START_CHECKS] = checks
    app[FINGERPRINT] = Fingerprinter(config.admin.fingerprint_key)
    operations.install(app, config, tracer_provider)  # decision metrics, tracing
    for endpoint in Endpoint if proxy else ():
        app.router.add_post(endpoint.value, _proxy_handler(endpoint))
    if proxy:
        app[DIRECT_ROUTES] = _direct_routes(app)
    app.router.add_get("/health", health if proxy else index_health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    if config.admin.enabled:
        if not token:
            log.warning("admin API without a token (loopback only)")
        app.add_subapp(ADMIN_PREFIX, create_admin_app(token))
        app[ADMIN_TOKEN] = token  # the listener checks it ahead of its own refusals
        add_dashboard_routes(app, token)  # behind the admin token too (router.http.dashboard)
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(_tokenizer_threads)
    return app


def create_metrics_app(router: web.Application) -> web.Application:
    """GET /metrics of `router` alone (`listen.metrics_port`): no proxy, no admin API."""
    app = web.Application()
    app[METRICS] = router[METRICS]
    app.router.add_get("/metrics", metrics)
    return app


async def _tokenizer_threads(app: web.Application) -> AsyncIterator[None]:
    """Stop the tokenizer's offload threads (`router.prompt.offload`) when the app stops."""
    yield
    app[TOKENIZER].close()
