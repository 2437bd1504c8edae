"""A replica applying another's rename or id swap moves its `extra_key` shadows with the servers,
and keeps the shadows another sends for a worker it is still registering.

QA (xkswap_det.py over three replicas, swapxk.py): after replica a's reload renamed the workers
or swapped their ids, the replicas that applied its record predicted plain requests the pages
the `extra_key` requests had stored (their new ids' streams replayed them as plain pages, and
the shadows stayed with the old ids' streams). Now each replica's shadows follow the servers'
streams, as the reloading replica's do (`indexer.shadowed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from indexer.namespace import Namespace
from router.cluster.server import NatsServer
from router.cluster.wire import Shadow
from router.config import RouterConfig, WorkerConfig
from router.http.reload import ConfigSource
from router.routing.pool import WorkerEntry
from router.service import RouterService
from tests.router.cluster.conftest import admin, replica_config, workers
from tests.router.conftest import eventually

SALT = "tenant-a"


def _prompt(seed: int) -> list[int]:
    return [(i * seed) % 200 + 5 for i in range(20 * 16 + 1)]


async def _stored_on(router: RouterService, url: str, prompt: list[int]) -> str:
    """The worker id `router` has on the server `url`, once its index holds `prompt`'s pages
    there as plain pages of the salt (its events, or its replay, came in)."""
    indexer = router.planner.indexer
    found: list[str] = []

    async def stored() -> bool:
        entry = next((e for e in router.planner.pool if e.url == url), None)
        if entry is None or not indexer.has_worker(entry.id):
            return False
        (stream,) = indexer.stream_ids(entry.id)
        keys = indexer.block_keys(stream, Namespace(entry.cache_model, None, SALT), prompt)
        found[:] = [entry.id]
        return bool(keys) and all(indexer.index.holds(stream, keys))

    await eventually(stored, what=f"the extra_key prompt's pages on {url} in the index")
    return found[0]


@pytest.mark.parametrize("change", ["rename", "swap"])
async def test_a_replica_applying_a_rename_keeps_the_shadows_of_each_server(
    nats_server: NatsServer, change: str
) -> None:
    async with workers(2) as (w0, w1), aiohttp.ClientSession() as session:
        before = [("w0", w0.url), ("w1", w1.url)]
        file: dict[str, RouterConfig] = {"a": replica_config(before, nats_server.url, "a")}
        source = ConfigSource("a.toml", lambda: file["a"])
        async with (
            RouterService(file["a"], config_source=source) as a,
            RouterService(replica_config(before, nats_server.url, "b")) as b,
        ):
            sent: list[tuple[list[int], str]] = []
            for i, seed in enumerate((7, 11, 13, 17)):
                prompt = _prompt(seed)
                body = {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}
                via = (a, b)[i % 2]  # b shadows a's through its decisions, and a b's
                async with session.post(via.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    worker = resp.headers["x-kvroute-worker"]
                url = dict(before)[worker]
                for router in (a, b):
                    await _stored_on(router, url, prompt)
                sent.append((prompt, url))
            after = {
                "rename": [("z0", w0.url), ("z1", w1.url)],
                "swap": [("w0", w1.url), ("w1", w0.url)],
            }[change]
            edited: Any = replica_config(after, nats_server.url, "a")
            file["a"] = msgspec.structs.replace(edited, cluster=file["a"].cluster)
            status, answer = await admin(session, a, "POST", "/reload")
            assert status == 200, answer

            async def applied() -> bool:
                # and registered: a worker whose models are not known yet takes nothing (a
                # request naming no model waits for it with a 503)
                pool = b.planner.pool
                ids = {(e.id, e.url) for e in pool}
                return ids == set(after) and all(e.models is not None for e in pool)

            await eventually(applied, what="replica b to apply a's reload")
            for prompt, url in sent:
                plain = {"input_ids": prompt, "cache_salt": SALT}
                for router in (b, a):  # b, which applied the record, first
                    worker = await _stored_on(router, url, prompt)  # replayed by its new id
                    status, plan = await admin(session, router, "POST", "/route", plain)
                    assert status == 200, plan
                    held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
                    assert held[worker] == 0, (router.url, plan["candidates"])


@pytest.mark.parametrize(
    ("new", "held"),
    [("w2", "before_the_pool"), ("w2", "registering"), ("w0", "registering")],
)
async def test_a_replica_still_registering_an_added_worker_keeps_the_others_shadows(
    nats_server: NatsServer, new: str, held: str
) -> None:
    """Replica a renames w0 (or deletes and adds it again under its id, `new`) and routes
    `extra_key` requests to it at once, while b is still registering it: its add not begun
    (`before_the_pool`), or the worker in its pool and not followed yet (`registering`). b
    keeps a's shadows for the server and applies them once it follows the worker there. Before,
    b dropped them and predicted their pages to plain requests (QA: 3 of 3, 288/0)."""
    async with workers(1) as (w0,), aiohttp.ClientSession() as session:
        before = [("w0", w0.url)]
        async with (
            RouterService(replica_config(before, nats_server.url, "a")) as a,
            RouterService(replica_config(before, nats_server.url, "b")) as b,
        ):
            reached, release = asyncio.Event(), asyncio.Event()
            if held == "before_the_pool":
                add = b.supervisor.add

                async def held_add(config: WorkerConfig, **options: Any) -> WorkerEntry:
                    reached.set()
                    await release.wait()  # a slow reading of the fleet record here
                    return await add(config, **options)

                b.supervisor.add = held_add  # type: ignore[method-assign]
            else:
                indexer = b.planner.indexer
                add_worker = indexer.add_worker

                async def held_add_worker(worker: str, *args: Any, **options: Any) -> None:
                    reached.set()
                    await release.wait()  # a slow /server_info read here
                    await add_worker(worker, *args, **options)

                indexer.add_worker = held_add_worker  # type: ignore[method-assign]
            assert b.cluster is not None
            seen: list[Shadow] = []
            remember = b.cluster.peers.shadow_seen
            assert remember is not None

            def seeing(shadow: Shadow) -> Callable[[], None] | None:
                seen.append(shadow)
                return remember(shadow)

            b.cluster.peers.shadow_seen = seeing
            status, answer = await admin(session, a, "DELETE", "/workers/w0")
            assert status == 200, answer
            status, answer = await admin(session, a, "POST", "/workers", {"id": new, "url": w0.url})
            assert status in (200, 201), answer
            await asyncio.wait_for(reached.wait(), 10.0)
            prompts = [_prompt(seed) for seed in (7, 11, 13)]
            for prompt in prompts:
                body = {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}
                async with session.post(a.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-kvroute-worker"] == new

            async def applied() -> bool:
                return len(seen) >= len(prompts)

            await eventually(applied, what="b to take in a's shadows")
            release.set()
            for prompt in prompts:
                assert await _stored_on(b, w0.url, prompt) == new  # replayed to b's new stream
                plain = {"input_ids": prompt, "cache_salt": SALT}
                for router in (b, a):
                    status, plan = await admin(session, router, "POST", "/route", plain)
                    assert status == 200, plan
                    held_tokens = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
                    assert held_tokens == {new: 0}, (router.url, plan["candidates"])
