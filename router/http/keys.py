"""Typed application keys: the one place the app's shared objects are named."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from indexer.service import IndexerService
from router.config import RouterConfig
from router.fleet.supervisor import Supervisor
from router.http.decisions import DecisionStats
from router.http.metrics import RouterMetrics
from router.http.observe import Observer
from router.http.proxy import Proxy
from router.http.tracing import Tracing
from router.prompt.tokenizer import PromptTokenizer
from router.routing.namespace import Fingerprinter
from router.routing.planner import Planner

__all__ = [
    "CONFIG",
    "DECISIONS",
    "FINGERPRINT",
    "INDEXER",
    "METRICS",
    "OBSERVER",
    "PLANNER",
    "PROXY",
    "SESSION",
    "SUPERVISOR",
    "TOKENIZER",
    "TRACING",
]

CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
TOKENIZER = web.AppKey("tokenizer", PromptTokenizer)
FINGERPRINT = web.AppKey("fingerprint", Fingerprinter)
INDEXER = web.AppKey("indexer", IndexerService)
SESSION = web.AppKey("session", aiohttp.ClientSession)
PLANNER = web.AppKey("planner", Planner)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
PROXY = web.AppKey("proxy", Proxy)
# operations (`router.http.operations`): decision stats, the observer, tracing when on
DECISIONS = web.AppKey("decisions", DecisionStats)
OBSERVER = web.AppKey("observer", Observer)
TRACING = web.AppKey("tracing", Tracing)
