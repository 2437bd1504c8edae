"""What an operator gets beside the proxy, attached to the router's app in one place.

`install` (when the app is built): the decision statistics and their Prometheus families,
tracing (when on) and its shutdown as a cleanup context of its own, and the KV query API
(served when it has a token of its own or the router listens on loopback only). `start` (when
the app's resources open): the fleet families and in-flight gauges over the live indexer, load
tracker and pool (every worker of the pool listed, at 0 while idle), and the `Observer` the
proxy reports each request to.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from indexer.service import IndexerService
from router.config import RouterConfig
from router.http.bearer import is_loopback
from router.http.decisions import DecisionCollector, DecisionStats
from router.http.fleet_metrics import FleetCollector
from router.http.keys import CONFIG, DECISIONS, METRICS, OBSERVER, TOKENIZER, TRACING
from router.http.kv_query import KV_QUERY_PATH, add_kv_query_route
from router.http.observe import Observer
from router.http.tracing import TracedTokenizer, build_tracing, tracing_wanted
from router.prompt.tokenizer import PromptTokenizer
from router.routing.load import LoadTracker, Target, load_keys
from router.routing.pool import WorkerPool

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["install", "proxy_tokenizer", "start"]

log = logging.getLogger(__name__)


def install(
    app: web.Application, config: RouterConfig, tracer_provider: TracerProvider | None = None
) -> None:
    """Decision stats and tracing on `app` (before it starts); ConfigError for bad tracing."""
    stats = DecisionStats()
    app[DECISIONS] = stats
    app[METRICS].registry.register(DecisionCollector(stats))
    app[METRICS].forget_with(stats.forget)  # a removed worker's decision series go too
    if not config.observe.enabled:
        if tracer_provider is not None or tracing_wanted(config.tracing):
            log.warning("tracing is off: it is part of the [observe] layer, which is disabled")
        _install_kv_query(app, config)
        return
    tracing = build_tracing(config.tracing, tracer_provider)
    if tracing is not None:
        app[TRACING] = tracing

        async def shutdown(app: web.Application) -> AsyncIterator[None]:
            yield
            tracing.shutdown()  # flushes what the exporter still holds

        app.cleanup_ctx.append(shutdown)
    _install_kv_query(app, config)


def _install_kv_query(app: web.Application, config: RouterConfig) -> None:
    if not config.query.enabled:
        return
    if not config.query_token() and not is_loopback(config.listen.host):
        # served all the same, refusing every request until a reload sets the token
        log.warning(
            "%s refuses every request: it needs query.token (or KVROUTE_QUERY_TOKEN) on %s",
            KV_QUERY_PATH,
            config.listen.host,
        )
    add_kv_query_route(app)


def proxy_tokenizer(app: web.Application) -> PromptTokenizer:
    """The proxy's tokenizer: traced (`tokenize` spans) when tracing is on."""
    tracing = app.get(TRACING)
    tokenizer = app[TOKENIZER]
    return tokenizer if tracing is None else TracedTokenizer(tokenizer)


def start(
    app: web.Application, indexer: IndexerService, load: LoadTracker, pool: WorkerPool
) -> Observer:
    """The fleet families, the in-flight gauges and the observer, once the indexer, the load
    tracker and the pool exist."""

    def fleet() -> list[Target]:
        # every worker of the pool where its requests count: its series at 0 from the moment
        # it is added (again), not from its first request
        return [
            key
            for entry in pool
            for key in load_keys(entry.id, [s.dp_rank for s in indexer.stream_configs(entry.id)])
        ]

    metrics = app[METRICS]
    metrics.export_in_flight(lambda: load.running(fleet()))
    metrics.export_rank_in_flight(lambda: load.running_by_rank(fleet()))
    metrics.registry.register(FleetCollector(indexer, load, fleet))
    enabled = app[CONFIG].current.observe.enabled
    observer = Observer(app[DECISIONS], indexer.block_size, app.get(TRACING), enabled=enabled)
    app[OBSERVER] = observer
    return observer
