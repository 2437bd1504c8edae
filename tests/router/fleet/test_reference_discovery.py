"""`kvroute up` finds its reference workers as the router finds SGLang 0.5.23 workers: from the
`kv_events` block of their /server_info, SGLang's own shape, per DP rank."""

from __future__ import annotations

import aiohttp

from router.commands.up import _routed
from router.fleet.discovery import needs_discovery, streams_for
from workers.config import WorkerConfig as ReferenceConfig
from workers.fleet import Fleet


async def test_up_discovers_each_rank_of_its_workers_from_sglangs_block() -> None:
    """`up` spelled every endpoint out to the router, and the workers advertised a block of
    their own: no `kvroute up` or benchmark ran the discovery of a real SGLang worker."""
    config = ReferenceConfig(dp_size=2, page_size=16, time_scale=0.0)
    async with Fleet(2, config) as fleet, aiohttp.ClientSession() as session:
        for routed, worker in zip(_routed(fleet), fleet.workers, strict=True):
            assert (routed.url, routed.id) == (worker.url, worker.id)
            assert needs_discovery(routed) and routed.role is None
            async with session.get(worker.url + "/server_info") as resp:
                info = await resp.json()
            assert set(info["kv_events"]) >= {"endpoint_host", "replay_endpoint_port_base"}
            streams = streams_for(routed, info)
            assert [(s.endpoint, s.replay_endpoint, s.dp_rank) for s in streams] == [
                (events, replay, rank)
                for rank, (events, replay) in enumerate(
                    zip(worker.events_endpoints, worker.replay_endpoints, strict=True)
                )
            ]
            assert {(s.topic, s.block_size) for s in streams} == {(worker.topic, 16)}
