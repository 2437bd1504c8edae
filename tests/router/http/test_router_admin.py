"""The admin API: bearer-token auth, worker membership (with discovery), index dump/load."""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from multidict import CIMultiDict

from indexer.index import PrefixIndex
from indexer.namespace import Namespace
from indexer.protocol.events import Event, EventBatch, Stored
from indexer.snapshot import dump_index
from router.config import AdminConfig, LimitsConfig, ListenConfig, RouterConfig
from router.errors import ConfigError
from router.http.app import create_app
from router.service import RouterService
from tests.router.conftest import AUTH, Fleet, HungDiscovery, eventually, router_config
from tests.router.ops.test_metrics_live import scrape, total
from workers.config import DEFAULT_MODEL

_QUICK = aiohttp.ClientTimeout(total=5)  # a request sent to the hung worker would hang

ADMIN_CALLS = [
    ("GET", "/admin/workers"),
    ("POST", "/admin/workers"),
    ("DELETE", "/admin/workers/w0"),
    ("POST", "/admin/workers/w0/drain"),
    ("GET", "/admin/namespaces"),
    ("POST", "/admin/namespaces/evict"),
    ("GET", "/admin/streams"),
    ("POST", "/admin/route"),
    ("GET", "/admin/index/dump"),
    ("POST", "/admin/index/load"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_CALLS)
async def test_admin_refuses_without_the_token(fleet: Fleet, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-admin-token"}):
        async with fleet.session.request(method, fleet.url + path, headers=headers) as resp:
            assert resp.status == 401
            # RFC 7235: a 401 names the scheme it wants
            assert resp.headers["WWW-Authenticate"] == 'Bearer realm="kvroute"'
            assert (await resp.json())["error"]["type"] == "AuthError"
    # nothing changed: both workers still there
    status, workers = await fleet.admin("GET", "/workers")
    assert status == 200 and [w["id"] for w in workers["workers"]] == ["w0", "w1"]


async def test_the_bearer_scheme_is_case_insensitive(fleet: Fleet) -> None:
    token = AUTH["Authorization"].split()[1]
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"Authorization": f"{scheme} {token}"}
        async with fleet.session.get(fleet.url + "/admin/workers", headers=headers) as resp:
            assert resp.status == 200, scheme
    for wrong in (f"Basic {token}", f"Bearer {token}x", f"Bearer{token}"):
        headers = {"Authorization": wrong}
        async with fleet.session.get(fleet.url + "/admin/workers", headers=headers) as resp:
            assert resp.status == 401, wrong


async def test_two_authorization_headers_bear_no_token(fleet: Fleet) -> None:
    """The token and a wrong one, in either order (or twice): a proxy in front that reads the
    other header would disagree with the router on who may pass (QA: the token first, a wrong
    one second, and a `DELETE /admin/workers/w1` removed the worker)."""
    right, wrong = AUTH["Authorization"], "Bearer wrong"
    for pair in ((right, wrong), (wrong, right), (right, right)):
        headers = CIMultiDict([("Authorization", pair[0]), ("Authorization", pair[1])])
        for method, path in (("GET", "/admin/workers"), ("DELETE", "/admin/workers/w1")):
            async with fleet.session.request(method, fleet.url + path, headers=headers) as resp:
                assert resp.status == 401, (pair, method)
                assert (await resp.json())["error"]["type"] == "AuthError"
    status, workers = await fleet.admin("GET", "/workers")
    assert status == 200 and [w["id"] for w in workers["workers"]] == ["w0", "w1"]


def test_admin_without_a_token_only_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVROUTE_ADMIN_TOKEN", raising=False)
    public = RouterConfig(listen=ListenConfig(host="0.0.0.0", port=0))
    with pytest.raises(ConfigError, match="without a token"):
        create_app(public)
    create_app(msgspec.structs.replace(public, admin=AdminConfig(enabled=False)))
    create_app(msgspec.structs.replace(public, admin=AdminConfig(token="t")))
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", "from-env")
    create_app(public)


async def test_loopback_admin_without_a_token_is_open() -> None:
    config = router_config([], admin=AdminConfig(token=""))
    async with (
        RouterService(config) as router,
        aiohttp.ClientSession() as session,
        session.get(router.url + "/admin/workers") as resp,
    ):
        assert resp.status == 200


async def test_workers_are_added_by_discovery_drained_and_removed(fleet: Fleet) -> None:
    w1_url = fleet.workers["w1"].url
    status, removed = await fleet.admin("DELETE", "/workers/w1")
    assert status == 200 and removed == {"removed": "w1"}
    assert "w1" not in fleet.router.indexer.workers()
    status, _ = await fleet.admin("DELETE", "/workers/w1")
    assert status == 404

    # only the url: streams, page size and dp size come from the worker's /server_info
    status, added = await fleet.admin("POST", "/workers", {"url": w1_url, "id": "again"})
    assert status == 201, added
    assert added["discovered"] and added["status"] == "ready" and len(added["streams"]) == 1
    assert "again" in fleet.router.indexer.workers()
    status, dup = await fleet.admin("POST", "/workers", {"url": w1_url, "id": "again"})
    assert status == 409 and dup["error"]["type"] == "ConflictError"
    status, bad = await fleet.admin("POST", "/workers", {"url": w1_url, "evnets": "x"})
    assert status == 400 and "evnets" in bad["error"]["message"]
    status, bad = await fleet.admin("POST", "/workers", {"url": w1_url, "events": "garbage"})
    assert status == 400 and "workers.events 'garbage'" in bad["error"]["message"]
    status, twice = await fleet.admin("POST", "/workers", {"url": w1_url + "/", "id": "alias"})
    assert status == 409 and "is worker 'again' already" in twice["error"]["message"], twice
    status, unreachable = await fleet.admin("POST", "/workers", {"url": "http://127.0.0.1:9"})
    assert status == 400 and "server_info" in unreachable["error"]["message"]
    explicit = {"url": "http://[::1", "events": "tcp://127.0.0.1:9", "block_size": 16}
    status, bad_url = await fleet.admin("POST", "/workers", explicit)
    assert status == 400 and "workers.url" in bad_url["error"]["message"]
    _, listed = await fleet.admin("GET", "/workers")
    assert [w["id"] for w in listed["workers"]] == ["w0", "again"]  # refused adds leave no trace

    # drained: no new traffic, even for a prompt it would otherwise attract
    status, drained = await fleet.admin("POST", "/workers/w0/drain")
    assert status == 200 and drained["status"] == "draining"
    for i in range(3):
        status, headers, _ = await fleet.post(
            "/v1/completions", {"prompt": f"p{i}", "max_tokens": 1}
        )
        assert status == 200 and headers["x-kvroute-worker"] == "again"
    plan = await fleet.route({"prompt": "p0"})
    assert plan["worker"] == "again"
    assert {c["worker"]: c["healthy"] for c in plan["candidates"]} == {"w0": False, "again": True}


async def test_events_after_discovery_reach_the_index(fleet: Fleet) -> None:
    body = {"prompt": "d" * 100, "max_tokens": 1, "cache_salt": "disc"}
    await fleet.admin("DELETE", "/workers/w0")
    _status, headers, _ = await fleet.post("/v1/completions", body)
    assert headers["x-kvroute-worker"] == "w1"
    await eventually(lambda: fleet.holds(body, "w1", 96), what="indexed on w1")


async def test_index_dump_loads_back_and_garbage_is_refused(fleet: Fleet) -> None:
    body = {"prompt": "q" * 80, "max_tokens": 1}
    _, headers, _ = await fleet.post("/v1/completions", body)
    holder = headers["x-kvroute-worker"]
    # the last prompt token is never a hit (engines compute its logits): 80 tokens -> 64
    await eventually(lambda: fleet.holds(body, holder, 64), what="indexed")
    async with fleet.session.get(fleet.url + "/admin/index/dump", headers=AUTH) as resp:
        assert resp.status == 200 and resp.content_type == "application/x-msgpack"
        snapshot = await resp.read()
    async with fleet.session.post(
        fleet.url + "/admin/index/load", data=snapshot, headers=AUTH
    ) as resp:
        assert resp.status == 200
    # loaded entries count once the workers' replay proves them current (indexer.fence)
    await eventually(lambda: fleet.holds(body, holder, 64), what="proven after the load")
    async with fleet.session.post(
        fleet.url + "/admin/index/load", data=b"\x93garbage", headers=AUTH
    ) as resp:
        assert resp.status == 400
    assert await fleet.holds(body, holder, 64)  # a refused snapshot leaves the index intact


async def test_each_admin_change_is_one_info_line_naming_no_salt(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a removal, an add, a drain or undrain and an eviction left no line at all (a
    reload and a snapshot load did): an operator could not tell from the log who took a
    worker out, or when a tenant's pages went."""
    salt = "tenant-secret-7f3a"
    body = {"prompt": "s" * 80, "max_tokens": 1, "cache_salt": salt}
    _, headers, _ = await fleet.post("/v1/completions", body)
    await eventually(lambda: fleet.holds(body, headers["x-kvroute-worker"], 64), what="indexed")
    caplog.set_level(logging.INFO)
    logged: list[str] = []  # every line, held against the salt at the end

    def said() -> list[str]:
        """The admin lines since the last call, each checked to be one INFO line."""
        logged.extend(r.getMessage() for r in caplog.records)
        lines = [r for r in caplog.records if r.getMessage().startswith("admin: ")]
        caplog.clear()
        assert all(r.levelno == logging.INFO and r.name == "router.http.admin" for r in lines)
        assert all("\n" not in r.getMessage() for r in lines)
        return [r.getMessage() for r in lines]

    assert (await fleet.admin("POST", "/workers/w0/drain"))[0] == 200
    assert said() == ["admin: worker w0 drained: no new requests"]
    assert (await fleet.admin("POST", "/workers/w0/drain"))[0] == 200
    assert said() == ["admin: worker w0 drained: no new requests (it was already)"]
    assert (await fleet.admin("POST", "/workers/w0/drain", {"drain": False}))[0] == 200
    assert said() == ["admin: worker w0 undrained: takes requests again"]
    assert (await fleet.admin("DELETE", "/workers/w1"))[0] == 200
    assert said() == ["admin: worker w1 removed"]
    url = fleet.workers["w1"].url
    assert (await fleet.admin("POST", "/workers", {"url": url, "id": "back"}))[0] == 201
    assert said() == ["admin: worker back added"]
    # refused: nothing changed, nothing said (the answer says why)
    assert (await fleet.admin("DELETE", "/workers/w1"))[0] == 404
    assert (await fleet.admin("POST", "/namespaces/evict", {}))[0] == 400
    assert said() == []

    status, listed = await fleet.admin("GET", "/namespaces")
    fingerprint = next(n["id"] for n in listed["namespaces"] if n["salted"])
    status, evicted = await fleet.admin("POST", "/namespaces/evict", {"namespace": fingerprint})
    assert status == 200 and evicted["namespaces"] == [fingerprint]
    dropped = evicted["entries_dropped"]
    assert dropped > 0
    assert said() == [
        f"admin: namespace(s) evicted: {fingerprint} ({dropped} index entries dropped)"
    ]
    evict = {"cache_salt": salt, "flush_workers": True}
    status, evicted = await fleet.admin("POST", "/namespaces/evict", evict)
    assert status == 200 and set(evicted["flushed"]) == {"w0", "back"}, evicted
    assert said() == [
        "admin: namespace(s) evicted by cache_salt: none (0 index entries dropped); "
        "workers flushed: w0 ok, back ok"
    ]

    # a snapshot load's line is the indexer's, saying what the snapshot brought
    async with fleet.session.get(fleet.url + "/admin/index/dump", headers=AUTH) as resp:
        snapshot = await resp.read()
    async with fleet.session.post(
        fleet.url + "/admin/index/load", data=snapshot, headers=AUTH
    ) as resp:
        assert resp.status == 200
    loaded = [r for r in caplog.records if r.getMessage().startswith("snapshot loaded: ")]
    assert len(loaded) == 1 and loaded[0].levelno == logging.INFO
    assert said() == []
    assert logged and not [line for line in logged if salt in line]


async def test_streams_report_state_and_counters(fleet: Fleet) -> None:
    status, streams = await fleet.admin("GET", "/streams")
    assert status == 200
    rows = {s["worker"]: s for s in streams["streams"]}
    assert set(rows) == {"w0", "w1"}
    for row in rows.values():
        assert row["state"] in ("synced", "syncing", "degraded")
        assert {"last_seq", "gaps", "replays", "restarts", "decode_errors", "lag_s"} <= set(row)
        # how a request is keyed and cut there: int pages (once one came), no lookahead
        assert row["bigram"] in (False, None) and row["lookahead"] == 0
        assert row["token_kind_mismatches"] == row["rank_mismatches"] == 0


async def test_an_add_abandoned_during_discovery_leaves_no_worker_behind(fleet: Fleet) -> None:
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()  # a worker that accepts and never answers /server_info
        await reader.read()  # until the router hangs up
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        add = asyncio.create_task(
            fleet.admin("POST", "/workers", {"url": f"http://127.0.0.1:{port}", "id": "mute"})
        )
        await asyncio.wait_for(accepted.wait(), 5)
        add.cancel()  # the admin client gives up: aiohttp cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await add

        async def gone() -> bool:
            _, listed = await fleet.admin("GET", "/workers")
            return [w["id"] for w in listed["workers"]] == ["w0", "w1"]

        await eventually(gone, what="the abandoned worker to be rolled back")


async def test_a_worker_being_added_takes_no_request_until_it_is_checked(fleet: Fleet) -> None:
    """Before, it was in the pool, `ready`, from the start of its discovery: a worker that
    answers its health check but never its /server_info was sent requests (which hung until
    their timeout) for the whole discovery, then refused by the same admin call. Now the add
    answers 202 once it has waited a few health timeouts, and the worker stays `checking`
    while its discovery goes on.

    Its models are not known meanwhile: the fleet's one model is served by its known workers,
    a request naming no model too (any model does for it: an add must not turn those away),
    and a name no known worker serves (which h may serve) is a 503 to retry. Before, the fleet
    was one pool meanwhile, h its candidate too, and any name was answered by the known
    model."""
    async with HungDiscovery() as hung:
        status, added = await fleet.admin("POST", "/workers", {"url": hung.url, "id": "h"})
        assert status == 202 and added["status"] == "checking", added

        async def probed() -> bool:
            # being discovered, and a health round has answered 200 for it meanwhile
            return hung.info_asked >= 1 and hung.health_asked >= 1

        await eventually(probed, what="the added worker discovered and health-probed")
        _, listed = await fleet.admin("GET", "/workers")
        row = next(w for w in listed["workers"] if w["id"] == "h")
        assert (row["status"], row["healthy"]) == ("checking", False), row
        plan = await fleet.route({"model": DEFAULT_MODEL, "prompt": "p", "max_tokens": 1})
        assert sorted(c["worker"] for c in plan["candidates"]) == ["w0", "w1"], plan
        for i in range(6):
            body = {"model": DEFAULT_MODEL, "prompt": f"fresh {i}", "max_tokens": 1}
            status, headers, _ = await fleet.post("/v1/completions", body, timeout=_QUICK)
            assert status == 200 and headers["x-kvroute-worker"] in ("w0", "w1")
        unnamed = {"prompt": "fresh", "max_tokens": 1}
        status, headers, _ = await fleet.post("/v1/completions", unnamed, timeout=_QUICK)
        assert status == 200 and headers["x-kvroute-worker"] in ("w0", "w1")
        other = {**unnamed, "model": "another-model"}
        status, headers, answer = await fleet.post("/v1/completions", other, timeout=_QUICK)
        assert status == 503 and answer["error"]["type"] == "ModelUnavailableError", answer
        assert headers["Retry-After"] == "1"
        async with fleet.session.get(fleet.url + "/metrics") as resp:
            assert 'kvroute_worker_routable{worker="h"} 0.0' in await resp.text()


def _snapshot(entries: int) -> bytes:
    """A snapshot of an index with `entries` one-block entries on one stream."""
    index = PrefixIndex()
    index.add_stream("w0#dp0", block_size=4)
    stored: list[Event] = [
        Stored(block_hashes=[i + 1], parent=None, token_ids=[i, i, i, i], block_size=4)
        for i in range(entries)
    ]
    index.apply("w0#dp0", EventBatch(0.0, stored), 0)
    return dump_index(index)


GZIPPED = {**AUTH, "Content-Encoding": "gzip"}


async def test_a_snapshot_is_bounded_by_its_own_limit_not_the_request_body_limit() -> None:
    """A dump of a large index is larger than any request: max_body_bytes refused a router's
    own dump of a million entries (19 MB against 16 MiB)."""
    snapshot = _snapshot(2000)
    small = LimitsConfig(max_body_bytes=1024)
    assert len(snapshot) > 10 * small.max_body_bytes
    async with (
        RouterService(router_config([], limits=small)) as router,
        aiohttp.ClientSession() as session,
    ):
        url = router.url + "/admin/index/load"
        async with session.post(url, data=snapshot, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        assert len(router.planner.indexer.index) == 2000

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: read up to the limit
            for at in range(0, len(snapshot), 4096):
                yield snapshot[at : at + 4096]

        async with session.post(url, data=chunked(), headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        # a gzip'd one is decoded by the router (its listener leaves bodies as sent)
        async with session.post(url, data=gzip.compress(snapshot), headers=GZIPPED) as resp:
            assert resp.status == 200, await resp.text()
    tight = LimitsConfig(max_body_bytes=1024, max_snapshot_bytes=4096)
    async with (
        RouterService(router_config([], limits=tight)) as router,
        aiohttp.ClientSession() as session,
    ):
        url = router.url + "/admin/index/load"
        for data, headers in (
            (snapshot, AUTH),
            (chunked(), AUTH),
            (gzip.compress(bytes(8192)), GZIPPED),  # 40 bytes sent, over the limit decoded
        ):
            async with session.post(url, data=data, headers=headers) as resp:
                assert resp.status == 413
                assert "limits.max_snapshot_bytes" in (await resp.json())["error"]["message"]
        assert len(router.planner.indexer.index) == 0
        # any other route keeps the clients' limit
        async with session.post(router.url + "/v1/completions", data=snapshot) as resp:
            assert resp.status == 413


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/namespaces/evict", b'{"cache_salt": "a\\ud800"}'),
        ("/workers", b'{"url": "http://127.0.0.1:1/\\udbff"}'),
    ],
)
async def test_an_admin_body_with_a_lone_surrogate_is_refused_as_such(
    fleet: Fleet, path: str, body: bytes
) -> None:
    """msgspec calls a whole body with a lone surrogate escape "truncated": the proxy's routes
    said what it is, the admin API repeated msgspec's word."""
    async with fleet.session.post(
        fleet.url + "/admin" + path, data=body, headers={**AUTH, "Content-Type": "application/json"}
    ) as resp:
        answer = await resp.json()
    assert resp.status == 400
    assert "lone UTF-16 surrogate" in answer["error"]["message"]
    assert "a\\ud800" not in answer["error"]["message"]  # nothing of the body repeated


async def test_a_dry_run_names_an_extra_key_shadow_rather_than_nothing_matched(
    fleet: Fleet,
) -> None:
    """A plain prompt whose pages an extra_key request stored is predicted nothing on that
    worker (fail closed): the dry run said only "nothing matched", as of a cold cache, so an
    operator could not tell the shadow from a miss. It now names the shadow, never the key."""
    prompt = [(i * 13) % 200 + 5 for i in range(20 * 16 + 1)]
    keyed = {"input_ids": prompt, "cache_salt": "tenant-a", "extra_key": "secret-view"}
    status, headers, _ = await fleet.post("/generate", keyed)
    assert status == 200
    holder = headers["x-kvroute-worker"]
    plain = {"input_ids": prompt, "cache_salt": "tenant-a"}

    async def hidden() -> bool:
        plan = await fleet.route(plain)
        return any(c["hidden"] for c in plan["candidates"])

    await eventually(hidden, what="the extra_key pages indexed as plain ones, and hidden")
    async with fleet.session.post(fleet.url + "/admin/route", json=plain, headers=AUTH) as resp:
        text = await resp.text()
    assert "secret-view" not in text
    by_worker = {c["worker"]: c for c in msgspec.json.decode(text)["candidates"]}
    shadowed, other = by_worker.pop(holder), next(iter(by_worker.values()))
    assert shadowed["matched_tokens"] == 0 and shadowed["hidden"] == "extra_key shadow"
    assert "hidden by an extra_key shadow" in shadowed["admission"]["why"]
    assert other["hidden"] is None and other["admission"]["why"] == "nothing matched"
    # the indexer's word on it, which the planner asks: the stream the query hides
    indexer = fleet.router.planner.indexer
    plain_ns = Namespace(fleet.router.planner.pool.get(holder).cache_model, None, "tenant-a")
    assert set(indexer.shadow_hidden(plain_ns, prompt)) == set(indexer.stream_ids(holder))
    assert indexer.query(plain_ns, prompt)[holder].matched_tokens == 0


async def test_an_admin_request_keeps_its_id_on_its_answer_and_its_log_line(
    fleet: Fleet, log_request_ids: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Only proxied requests had an id: an admin change's INFO line was logged under `[-]`
    (the docs say every line written while handling a request names it), and its 200 did
    not echo the client's `x-request-id` (its 401 did). Each request the router answers
    itself is named now, by the client's well-formed id or one of the router's."""
    caplog.set_level(logging.INFO, logger="router.http.admin")
    url = fleet.url + "/admin/workers/w0/drain"
    sent: list[tuple[str | None, str]] = []  # (the client's id, the answer's)
    for given in ("admin-rid-1", None, "not [well] formed"):
        headers = {**AUTH, **({} if given is None else {"x-request-id": given})}
        async with fleet.session.post(url, json={"drain": False}, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            sent.append((given, resp.headers["x-request-id"]))
    assert sent[0] == ("admin-rid-1", "admin-rid-1")
    for given, answered in sent[1:]:
        assert re.fullmatch(r"[0-9a-f]{32}", answered), (given, answered)  # the router's
    lines = [r for r in caplog.records if r.getMessage().startswith("admin: worker w0")]
    assert [getattr(r, "request_id", None) for r in lines] == [a for _, a in sent]
    # a refusal and any other request the router answers itself are named alike
    async with fleet.session.get(
        fleet.url + "/admin/workers", headers={"x-request-id": "r-2"}
    ) as resp:
        assert resp.status == 401 and resp.headers["x-request-id"] == "r-2"
    async with fleet.session.get(fleet.url + "/health", headers={"x-request-id": "r-3"}) as resp:
        assert resp.headers["x-request-id"] == "r-3"


async def test_a_405_on_a_route_is_counted_under_that_route(fleet: Fleet) -> None:
    """aiohttp's 405 keeps no route: it was counted under `endpoint="-"`, which the docs
    keep for paths that are no route."""
    for method, path in (("GET", "/dashboard/login"), ("GET", "/admin/namespaces/evict")):
        async with fleet.session.request(method, fleet.url + path, headers=AUTH) as resp:
            assert resp.status == 405, (method, path)
    async with fleet.session.get(fleet.url + "/no/such/route") as resp:
        assert resp.status == 404
    samples = await scrape(fleet)
    name = "kvroute_rejected_requests_total"
    assert total(samples, name, endpoint="/dashboard/login", error="HTTPMethodNotAllowed") == 1
    route = "/admin/namespaces/evict"
    assert total(samples, name, endpoint=route, error="HTTPMethodNotAllowed") == 1
    assert total(samples, name, endpoint="-", error="HTTPMethodNotAllowed") == 0
    assert total(samples, name, endpoint="-", error="HTTPNotFound") == 1
