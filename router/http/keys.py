"""Typed application keys: the one place the app's shared objects are named."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from indexer.service import IndexerService
from router.config import LiveConfig
from router.fleet.supervisor import Supervisor
from router.http.dashboard.session import DashboardSession
from router.http.decisions import DecisionStats
from router.http.metrics import RouterMetrics
from router.http.observe import Observer
from router.http.proxy import Proxy
from router.http.reload import ConfigSource, Reloader
from router.http.start_checks import StartChecks
from router.http.tracing import Tracing
from router.prompt.tokenizer import PromptTokenizer
from router.routing.namespace import Fingerprinter
from router.routing.pd import PairPlanner
from router.routing.planner import Planner

if TYPE_CHECKING:  # nats is imported only by a router that has a [cluster]
    from router.cluster.relay_publisher import RelayPublisher
    from router.cluster.service import ClusterService

__all__ = [
    "CLUSTER",
    "CONFIG",
    "CONFIG_SOURCE",
    "DASHBOARD_SESSION",
    "DECISIONS",
    "FINGERPRINT",
    "INDEXER",
    "METRICS",
    "OBSERVER",
    "PAIRS",
    "PLANNER",
    "PROXY",
    "RELAY",
    "RELOADER",
    "SESSION",
    "START_CHECKS",
    "SUPERVISOR",
    "TOKENIZER",
    "TRACING",
]

# the running config: read `.current` once per request (a reload replaces it whole)
CONFIG = web.AppKey("config", LiveConfig)
# only when the router knows its config file (`kvroute serve`): what a reload reads again
CONFIG_SOURCE = web.AppKey("config_source", ConfigSource)
RELOADER = web.AppKey("reloader", Reloader)  # SIGHUP and POST /admin/reload
# what a start refuses of a config (`router.http.start_checks`), as this process starts: a
# reload checks its file the same way
START_CHECKS = web.AppKey("start_checks", StartChecks)
METRICS = web.AppKey("metrics", RouterMetrics)
TOKENIZER = web.AppKey("tokenizer", PromptTokenizer)
FINGERPRINT = web.AppKey("fingerprint", Fingerprinter)
INDEXER = web.AppKey("indexer", IndexerService)
SESSION = web.AppKey("session", aiohttp.ClientSession)
PLANNER = web.AppKey("planner", Planner)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
PROXY = web.AppKey("proxy", Proxy)
# only when the config has a [cluster]: this replica's link to the others
CLUSTER: web.AppKey[ClusterService] = web.AppKey("cluster")
# `kvroute relay`: the tap writing the index's streams to JetStream (router.cluster.relay_publisher)
RELAY: web.AppKey[RelayPublisher] = web.AppKey("relay")
# only behind an admin token: the dashboard's sessions, which the cluster's logouts end too
DASHBOARD_SESSION = web.AppKey("dashboard_session", DashboardSession)
PAIRS = web.AppKey("pairs", PairPlanner)  # prefill/decode pairs: their planning
# operations (`router.http.operations`): decision stats, the observer, tracing when on
DECISIONS = web.AppKey("decisions", DecisionStats)
OBSERVER = web.AppKey("observer", Observer)
TRACING = web.AppKey("tracing", Tracing)
