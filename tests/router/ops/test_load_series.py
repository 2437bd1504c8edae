"""A worker's load series are at 0 from the moment it is in the fleet, not from its first request.

`kvroute_in_flight_requests` (per worker), `kvroute_load_running_requests` and
`kvroute_load_queued_prefill_tokens` (per rank it is routed by) and
`kvroute_dp_rank_in_flight_requests` (per rank of a worker with several). Before, they were
made by the first request routed there: a fresh worker, and one removed and added again under
its id (a reload), had none, so dashboards showed a gap where the load was 0.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.service import RouterService
from tests.router.conftest import AUTH, eventually, router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

LOAD = (
    "kvroute_load_running_requests",
    "kvroute_load_queued_prefill_tokens",
    "kvroute_dp_rank_in_flight_requests",
)
Series = dict[str, dict[tuple[str, ...], float]]


async def _series(session: aiohttp.ClientSession, url: str) -> Series:
    """The in-flight and load samples of /metrics, by name and (worker[, dp_rank])."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvroute_in_flight_requests":
                out.setdefault(s.name, {})[(s.labels["worker"],)] = s.value
            elif s.name in LOAD:
                out.setdefault(s.name, {})[(s.labels["worker"], s.labels["dp_rank"])] = s.value
    return out


def _zero(w0: str, w1: str | None) -> Series:
    """Idle series of w0 (one rank) and w1 (two ranks, when it is in the fleet)."""
    ranks = [] if w1 is None else [(w1, "0"), (w1, "1")]
    series: Series = {
        "kvroute_in_flight_requests": {(w,): 0.0 for w in (w0, w1) if w is not None},
        "kvroute_load_running_requests": {(w0, ""): 0.0, **dict.fromkeys(ranks, 0.0)},
        "kvroute_load_queued_prefill_tokens": {(w0, ""): 0.0, **dict.fromkeys(ranks, 0.0)},
    }
    if ranks:  # a family without samples shows no name
        series["kvroute_dp_rank_in_flight_requests"] = dict.fromkeys(ranks, 0.0)
    return series


async def test_load_series_are_zero_from_registration_and_after_a_readd() -> None:
    one = ReferenceConfig(time_scale=0.0, page_size=16)
    two = ReferenceConfig(time_scale=0.0, page_size=16, dp_size=2)
    async with ReferenceWorker(one) as w0, ReferenceWorker(two) as w1:
        config = router_config([("w0", w0.url), ("w1", w1.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            url = router.url
            both = _zero("w0", "w1")

            async def shown(want: Series) -> bool:
                return await _series(session, url) == want

            # a fresh fleet, no request sent yet: every worker's ranks at 0
            await eventually(lambda: shown(both), what="a fresh fleet's load series at 0")
            async with session.delete(url + "/admin/workers/w1", headers=AUTH) as resp:
                assert resp.status == 200, await resp.text()
            assert await _series(session, url) == _zero("w0", None)  # its series gone
            add = {"id": "w1", "url": w1.url}
            async with session.post(url + "/admin/workers", json=add, headers=AUTH) as resp:
                assert resp.status in (201, 202), await resp.text()
            # added again under its id: at 0 again, before any request is routed to it
            await eventually(lambda: shown(both), what="the re-added worker's series at 0")
