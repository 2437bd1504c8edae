"""`Fleet.warm` returns once every stream is caught up (`synced`), not once it applied a batch.

A join's catch-up reads the worker's replay buffer and sets the stream's `last_seq` while the
stream is still `syncing` (until a replay asked with its SUB connected has answered), and a
`syncing` stream predicts nothing, pending marks included. Before, `warm` returned at the first
batch applied: a test that then routed a prompt to that worker found it predicted neither
matched nor pending tokens right after its 200 (CI, loaded: `assert (0 + 0) >= 256` in
`test_a_refused_requests_pending_marks_are_withdrawn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from router.config import IndexerSection
from router.service import RouterService
from tests.router.conftest import Fleet, eventually, router_config
from tests.router.test_router_false_hits import TcpForward, port_of
from tests.router.test_router_worker_restart import Front
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


async def test_warm_waits_for_the_catch_up_not_the_first_batch_applied() -> None:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with (
        ReferenceWorker(cfg) as w0,
        TcpForward(port_of(w0.kv_events.endpoints[0])) as held,
        Front(w0.url) as front,
        aiohttp.ClientSession() as session,
    ):
        # the worker advertises the held port as its event socket (its replay socket is its own)
        async with session.get(w0.url + "/server_info") as resp:
            info = await resp.json()
        held.opened.clear()  # its connections wait: the SUB's comes up late
        info["kv_events"]["endpoint_port_base"] = held.listen
        front.server_info = json.dumps(info).encode()
        # the idle probe reads the pokes' batches from the replay buffer while the SUB waits
        config = router_config([("w0", front.url)], indexer=IndexerSection(probe_interval_s=0.1))
        async with RouterService(config) as router:
            fleet = Fleet(router, {"w0": w0}, session)
            warming = asyncio.create_task(fleet.warm())
            try:

                async def applied_while_syncing() -> bool:
                    _, streams = await fleet.admin("GET", "/streams")
                    return any(
                        s["last_seq"] is not None and s["state"] == "syncing"
                        for s in streams["streams"]
                    )

                await eventually(applied_while_syncing, what="a batch applied by the catch-up")
                # before, it returned here, with the stream still predicting nothing
                done, _ = await asyncio.wait({warming}, timeout=0.5)
                assert not done, "warm returned while the stream was syncing"
                held.opened.set()  # the SUB connects, the catch-up ends
                await asyncio.wait_for(warming, timeout=10.0)
            finally:
                warming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await warming
            _, streams = await fleet.admin("GET", "/streams")
            assert [s["state"] for s in streams["streams"]] == ["synced"]
