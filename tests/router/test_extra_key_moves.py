"""An `extra_key` request's shadow follows the worker's server, not its id.

The pages a worker stores for an `extra_key` request reach the index as plain pages of its salt,
so the router shadows that prompt's blocks on the stream it was sent to (`indexer.shadowed`).
QA: after a reload that renamed the workers (the same servers) or swapped their ids, or an admin
delete and add of the same server under another id, the new id's stream replayed the server's
history, those pages came back as trusted plain ones, and a plain request of the prompts was
predicted them: 4 of 4 false hits (predicted 156, cached 0). A settings change under the same id
kept its shadows only because they were kept by the id. Now a leaving worker's shadows are kept
for the server's stream (its events endpoint, topic and dp rank), and whatever id is added on that
stream gets them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import indexer.service as indexer_service
from indexer.namespace import Namespace
from indexer.stats import StreamState
from router.config import load_config
from router.http.reload import ConfigSource
from router.service import RouterService
from tests.router.conftest import AUTH, TOKEN, Fleet, eventually, router_config
from tests.router.test_router_pd import PdFleet, poke, reference
from workers.cache import Namespace as CacheNamespace
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker

SALT = "tenant-a"


def _toml(workers: dict[str, str], extra: dict[str, list[str]] | None = None) -> str:
    lines = ["[listen]", 'host = "127.0.0.1"', "port = 0", "[admin]", f'token = "{TOKEN}"']
    lines += ["[health]", "interval_s = 0.2", "timeout_s = 0.5"]
    for wid, url in workers.items():
        lines += ["[[workers]]", f'id = "{wid}"', f'url = "{url}"', *(extra or {}).get(wid, [])]
    return "\n".join(lines) + "\n"


class Reloadable(Fleet):
    """Two workers behind a router read from `path` (rewrite it, then `reload`)."""

    path: Path

    async def reload(
        self, workers: dict[str, str], extra: dict[str, list[str]] | None = None
    ) -> dict[str, Any]:
        self.path.write_text(_toml(workers, extra))
        status, answer = await self.admin("POST", "/reload")
        assert status == 200, answer
        return answer  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def reloadable(tmp_path: Path) -> AsyncIterator[Reloadable]:
    cfg = ReferenceConfig(time_scale=0.0, page_size=16)
    async with ReferenceWorker(cfg) as w0, ReferenceWorker(cfg) as w1:
        path = tmp_path / "router.toml"
        path.write_text(_toml({"w0": w0.url, "w1": w1.url}))
        source = ConfigSource(str(path), lambda: load_config(path))
        async with (
            RouterService(source.load(), config_source=source) as router,
            aiohttp.ClientSession() as session,
        ):
            fleet = Reloadable(router, {"w0": w0, "w1": w1}, session)
            fleet.path = path
            await fleet.warm()
            yield fleet


def _prompt(seed: int) -> list[int]:
    return [(i * seed) % 200 + 5 for i in range(20 * 16 + 1)]


async def _stored_as_plain(fleet: Fleet | PdFleet, worker: str, prompt: list[int]) -> None:
    """Wait until the index holds `prompt`'s pages on `worker` as plain pages of the salt (its
    stream's events, or the replay of its history, came in)."""
    indexer = fleet.router.planner.indexer

    async def stored() -> bool:
        if not indexer.has_worker(worker):
            return False
        model = fleet.router.planner.pool.get(worker).cache_model
        for stream in indexer.stream_ids(worker):  # the rank it went to
            keys = indexer.block_keys(stream, Namespace(model, None, SALT), prompt)
            if keys and all(indexer.index.holds(stream, keys)):
                return True
        return False

    await eventually(stored, what=f"{worker}'s pages of the extra_key prompt in the index")


async def _sent_with_extra_key(fleet: Fleet, prompt: list[int]) -> str:
    """The server (its URL) an extra_key request of `prompt` went to, once its pages are in."""
    body = {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}
    status, headers, _ = await fleet.post("/generate", body)
    assert status == 200
    worker = headers["x-kvroute-worker"]
    await _stored_as_plain(fleet, worker, prompt)
    return str(fleet.router.planner.pool.get(worker).url)


async def _no_false_hit(fleet: Fleet, prompt: list[int], server: str) -> None:
    """The worker now on `server` holds `prompt`'s pages again (its new stream replayed them),
    and a plain request of it is predicted none of them: the worker reuses none."""
    worker = next(e.id for e in fleet.router.planner.pool if e.url == server)
    await _stored_as_plain(fleet, worker, prompt)
    plain = {"input_ids": prompt, "cache_salt": SALT}
    plan = await fleet.route(plain)
    held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
    assert held[worker] == 0, plan["candidates"]
    status, headers, answer = await fleet.post("/generate", plain)
    assert status == 200
    predicted = int(headers["x-kvroute-matched-tokens"])
    assert predicted <= answer["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("change", ["rename", "swap", "same"])
async def test_a_reload_that_renames_the_workers_keeps_their_shadows(
    tmp_path: Path, change: str
) -> None:
    async with reloadable(tmp_path) as fleet:
        urls = {wid: w.url for wid, w in fleet.workers.items()}
        sent = [(p, await _sent_with_extra_key(fleet, p)) for p in map(_prompt, (7, 11, 13))]
        workers = {
            "rename": {"z0": urls["w0"], "z1": urls["w1"]},
            "swap": {"w0": urls["w1"], "w1": urls["w0"]},
            "same": urls,  # the control: no change
        }[change]
        await fleet.reload(workers)
        for prompt, server in sent:
            await _no_false_hit(fleet, prompt, server)


async def test_ids_swapped_by_a_reload_hide_nothing_of_the_other_servers_plain_pages(
    tmp_path: Path,
) -> None:
    """w0's server took an extra_key request of a prompt and w1's the plain one; a reload
    swaps their URLs. w0 now follows the server holding the prompt plain, and is predicted
    its pages: the shadows of w0's recent requests stay with the server they went to (QA: an
    id registered again carried them to its new server, 8 of 16 plain candidates hidden there
    for 90 s and more)."""
    async with reloadable(tmp_path) as fleet:
        urls = {wid: w.url for wid, w in fleet.workers.items()}
        prompt = _prompt(13)
        for target, other, body in (
            ("w0", "w1", {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}),
            ("w1", "w0", {"input_ids": prompt, "cache_salt": SALT}),
        ):
            status, _ = await fleet.admin("POST", f"/workers/{other}/drain", {"drain": True})
            assert status == 200
            status, headers, _ = await fleet.post("/generate", body)
            assert status == 200 and headers["x-kvroute-worker"] == target
            await _stored_as_plain(fleet, target, prompt)
            status, _ = await fleet.admin("POST", f"/workers/{other}/drain", {"drain": False})
            assert status == 200
        await fleet.reload({"w0": urls["w1"], "w1": urls["w0"]})
        await _stored_as_plain(fleet, "w0", prompt)
        plain = {"input_ids": prompt, "cache_salt": SALT}

        async def predicted_on_w0() -> bool:
            plan = await fleet.route(plain)
            held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
            return bool(held["w0"] == 320)

        await eventually(predicted_on_w0, what="w0's new server's plain pages predicted")
        plan = await fleet.route(plain)
        held = {c["worker"]: c["matched_tokens"] for c in plan["candidates"]}
        assert held["w1"] == 0, plan["candidates"]  # the extra_key's pages, hidden still


async def test_a_rename_that_spells_the_servers_host_otherwise_keeps_their_shadows(
    tmp_path: Path,
) -> None:
    """QA (xk6.py lhost_ev, lhost): the workers renamed, their URLs and event sockets spelled
    `localhost` where they were `127.0.0.1` (or their engines advertising the URL's host):
    the shadows were kept for the endpoint as spelled, the new ids' streams took none, and a
    plain request of an extra_key prompt was predicted its pages (4 of 6 false hits)."""
    async with reloadable(tmp_path) as fleet:
        sent = [(p, await _sent_with_extra_key(fleet, p)) for p in map(_prompt, (7, 11, 13))]
        spelled = {url: url.replace("127.0.0.1", "localhost") for _, url in sent}
        renamed = {f"z{i}": w.url.replace("127.0.0.1", "localhost") for i, w in
                   enumerate(fleet.workers.values())}  # fmt: skip
        sockets = {
            f"z{i}": [
                f'events = "{w.kv_events.endpoint.replace("127.0.0.1", "localhost")}"',
                f'replay = "{w.kv_events.replay_endpoint.replace("127.0.0.1", "localhost")}"',
            ]
            for i, w in enumerate(fleet.workers.values())
        }
        await fleet.reload(renamed, sockets)
        for prompt, server in sent:
            await _no_false_hit(fleet, prompt, spelled[server])


async def test_an_admin_delete_and_add_under_another_id_keeps_the_shadows(tmp_path: Path) -> None:
    async with reloadable(tmp_path) as fleet:
        prompt = _prompt(7)
        server = await _sent_with_extra_key(fleet, prompt)
        old = next(e.id for e in fleet.router.planner.pool if e.url == server)
        status, _ = await fleet.admin("DELETE", f"/workers/{old}")
        assert status == 200
        status, answer = await fleet.admin("POST", "/workers", {"id": "ad0", "url": server})
        assert status == 201, answer
        await _no_false_hit(fleet, prompt, server)


@pytest.mark.parametrize(
    "kept",
    [
        "all_recent",
        "more_than_kept",
        "page_size_8",
        "page_size_32",
        "page_size_8_more_heads_than_kept",
        "page_size_8_more_namespaces_than_kept",
        "page_size_8_added_as_localhost",
        "two_ranks",
        "two_ranks_page_size_32",
        "renamed",
        "renamed_page_size_8",
    ],
)
async def test_a_worker_restarted_on_other_event_ports_keeps_its_recent_shadows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    """w0 restarts on its URL with other KV-event ports, and an extra_key request is sent to
    it before the router reads its settings again: the router still follows the old
    process's endpoint and shadows the prompt there, while the new process stores its pages.
    Registered again (here by an admin delete and add; the supervisor's re-read does the
    same), the new stream replays them as plain pages: the shadows made in the last
    `RESTART_DOUBT_S` go on standing on it (QA: parked for the old endpoint alone, they were
    never taken, and plain requests were predicted 288-304 tokens, 0 cached). A stream that
    shadowed more than it keeps a record of (`more_than_kept`) cannot tell its recent shadows
    from old ones: it keeps them all.

    Restarted with another page size (`page_size_N`), the worker stored the prompt in pages
    the shadows' keys never match (QA: 8-token pages after 16, a false hit until evicted): the
    prompt's head is shadowed again in the new size; a stream that kept fewer heads than it
    shadowed lately shadows their namespace from its seed, and one that kept fewer namespaces
    hides its plain pages whole. Added again under another spelling of its URL
    (`localhost`), it is the same server (QA: the heads were not carried, 288 tokens
    predicted, 0 cached).

    Restarted with two dp ranks in place of one (`two_ranks`), the worker placed the request
    on its new rank 1 (the router names no rank to a worker of one): the new rank's stream
    takes the recent shadows of the ranks the worker had (QA: 288 tokens predicted, 0 cached,
    on rank 1). Added back under another id (`renamed`), it is still the server those requests
    went to: the new id takes the recent shadows the old one left at its URL (QA: none taken,
    288 tokens predicted, 0 cached)."""
    if kept == "more_than_kept":
        monkeypatch.setattr(indexer_service, "_RECENT_MARK_KEYS", 4)
    if kept.endswith(("_more_heads_than_kept", "_more_namespaces_than_kept")):
        monkeypatch.setattr(indexer_service, "_RECENT_HEADS", 0)
    if kept.endswith("_more_namespaces_than_kept"):
        monkeypatch.setattr(indexer_service, "_RECENT_NAMESPACES", 0)
    page = int(kept.split("page_size_")[1].split("_")[0]) if "page_size_" in kept else 16
    ranks = 2 if kept.startswith("two_ranks") else 1
    async with reloadable(tmp_path) as fleet, contextlib.AsyncExitStack() as stack:
        status, _ = await fleet.admin("POST", "/workers/w1/drain", {"drain": True})
        assert status == 200
        first = fleet.workers["w0"]
        server = first.url.rstrip("/")
        await first.__aexit__(None, None, None)
        port = int(server.rsplit(":", 1)[1])
        cfg = ReferenceConfig(time_scale=0.0, page_size=page, port=port, dp_size=ranks)
        fleet.workers["w0"] = await stack.enter_async_context(ReferenceWorker(cfg))

        async def ready() -> bool:
            _, listed = await fleet.admin("GET", "/workers")
            return any(w["id"] == "w0" and w["status"] == "ready" for w in listed["workers"])

        await eventually(ready, what="w0 ready again")
        if ranks == 2:  # the worker's next request (round robin) goes to its rank 1
            other = {"input_ids": _prompt(13), "cache_salt": SALT}
            status, headers, _ = await fleet.post("/generate", other)
            assert status == 200 and headers["x-kvroute-worker"] == "w0"
        prompt = _prompt(11)
        body = {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}
        status, headers, _ = await fleet.post("/generate", body)
        assert status == 200 and headers["x-kvroute-worker"] == "w0"
        if ranks == 2:
            keyed = CacheNamespace(extra_key="K9", cache_salt=SALT)
            held = fleet.workers["w0"].match(keyed, prompt)
            assert held[1] > held[0], held  # (the worker's own cache says where it went)
        status, _ = await fleet.admin("DELETE", "/workers/w0")
        assert status == 200
        if kept.endswith("_added_as_localhost"):
            server = server.replace("127.0.0.1", "localhost")
        new_id = "w9" if kept.startswith("renamed") else "w0"
        status, answer = await fleet.admin("POST", "/workers", {"id": new_id, "url": server})
        assert status == 201, answer
        await _no_false_hit(fleet, prompt, answer["url"])


async def test_a_prefill_with_two_ranks_renamed_keeps_the_shadows_of_each_rank() -> None:
    """QA (pdxk.py): extra_key pairs, then the prefill worker (2 dp ranks) renamed: 3 of 3
    plain pairs were predicted the extra_key copies on the prefill rank."""
    async with (
        ReferenceWorker(reference("prefill", dp_size=2)) as p0,
        ReferenceWorker(reference("decode")) as d0,
    ):
        config = router_config([("p0", p0.url), ("d0", d0.url)])
        async with RouterService(config) as router, aiohttp.ClientSession() as session:
            fleet = PdFleet(router, session, {"p0": p0, "d0": d0})
            counter = iter(range(1_000_000))

            async def live() -> bool:
                await poke(session, p0, d0, next(counter))
                streams = router.planner.indexer.streams()
                return len(streams) == 3 and all(
                    s.last_seq is not None and s.state is StreamState.SYNCED for s in streams
                )

            await eventually(live, what="both prefill ranks' streams to reach the index")
            prompts = [_prompt(seed) for seed in (7, 11, 13, 17)]
            for prompt in prompts:
                body = {"input_ids": prompt, "cache_salt": SALT, "extra_key": "K9"}
                async with session.post(router.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                await _stored_as_plain(fleet, "p0", prompt)
            async with session.delete(router.url + "/admin/workers/p0", headers=AUTH) as resp:
                assert resp.status == 200
            added = {"id": "px", "url": p0.url}
            async with session.post(router.url + "/admin/workers", json=added, headers=AUTH) as r:
                assert r.status == 201, await r.text()
            for prompt in prompts:
                await _stored_as_plain(fleet, "px", prompt)  # the new streams replayed them
                body = {"input_ids": prompt, "cache_salt": SALT}
                plan = await fleet.route(body)
                assert plan["prefill"]["candidates"][0]["matched_tokens"] == 0, plan["prefill"]
                async with session.post(router.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    matched = int(resp.headers["x-kvroute-matched-tokens"])
                    answer = await resp.json()
                assert matched <= answer["meta_info"]["cached_tokens"] == 0
