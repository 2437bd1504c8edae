"""The dashboard over HTTP: its login and session cookie, the state it renders, its files."""

from __future__ import annotations

import re
from http.cookies import SimpleCookie
from importlib import resources
from typing import Any

import aiohttp
import msgspec
from multidict import CIMultiDictProxy

from router.config import AdminConfig
from router.http.app import create_app
from router.http.dashboard.session import COOKIE, SESSION_S, DashboardSession
from router.http.dashboard.state import DashboardState, StreamRow, rank_rows
from router.routing.load import LoadTracker
from tests.router.conftest import AUTH, TOKEN, Fleet, eventually, router_config, unfollow
from tests.router.ops.test_metrics_live import PROMPT

STATIC = resources.files("router.http.dashboard") / "static"


def chat(salt: str) -> dict[str, Any]:
    """A chat of ~360 tokens in tenant `salt`'s namespace."""
    return {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "cache_salt": salt,
    }


Answer = tuple[int, CIMultiDictProxy[str], bytes]


async def call(
    fleet: Fleet,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
) -> Answer:
    """Status, headers and body of one request, with no cookie jar and no redirect followed."""
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
        session.request(
            method, fleet.url + path, headers=headers, data=form, allow_redirects=False
        ) as resp,
    ):
        return resp.status, resp.headers, await resp.read()


async def get(fleet: Fleet, path: str, headers: dict[str, str] | None = None) -> Answer:
    """GET `path`."""
    return await call(fleet, "GET", path, headers)


async def login(fleet: Fleet, token: str) -> Answer:
    """POST the login form with `token`."""
    return await call(fleet, "POST", "/dashboard/login", form={"token": token})


def session_cookie(headers: CIMultiDictProxy[str]) -> tuple[str, dict[str, Any]]:
    """The dashboard cookie's value and attributes from a response's Set-Cookie."""
    jar: SimpleCookie = SimpleCookie()
    for raw in headers.getall("Set-Cookie"):
        jar.load(raw)
    morsel = jar[COOKIE]
    return morsel.value, {k: morsel[k] for k in ("httponly", "samesite", "path", "max-age")}


async def test_without_the_token_no_page_and_no_data(fleet: Fleet) -> None:
    status, headers, body = await get(fleet, "/dashboard")
    assert status == 401 and b'action="/dashboard/login"' in body
    assert b"/dashboard/state" not in body and b"dashboard.js" not in body  # a form, no page
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    status, _, body = await get(fleet, "/dashboard/state")
    assert status == 401 and msgspec.json.decode(body)["error"]["type"] == "AuthError"
    for wrong in ("Bearer nope", f"Bearer {TOKEN}x", "Basic " + TOKEN, TOKEN):
        status, _, _ = await get(fleet, "/dashboard/state", {"Authorization": wrong})
        assert status == 401, wrong
    forged = f"{9_999_999_999}.{'0' * 64}"
    status, _, _ = await get(fleet, "/dashboard/state", {"Cookie": f"{COOKIE}={forged}"})
    assert status == 401
    status, _, body = await login(fleet, "not-the-token")
    assert status == 401 and b"not the admin token" in body
    # the files are code without data: served to anyone (the login form needs its stylesheet)
    status, headers, _ = await get(fleet, "/dashboard/static/dashboard.css")
    assert status == 200 and headers["Content-Type"].startswith("text/css")
    status, _, _ = await get(fleet, "/dashboard/static/index.html")
    assert status == 404  # only the script and the stylesheet


async def test_login_gives_a_strict_httponly_cookie_for_the_dashboard_only(fleet: Fleet) -> None:
    status, headers, _ = await login(fleet, TOKEN)
    assert status == 303 and headers["Location"] == "/dashboard"
    value, attrs = session_cookie(headers)
    assert attrs == {
        "httponly": True,
        "samesite": "Strict",
        "path": "/dashboard",
        "max-age": str(SESSION_S),
    }
    assert TOKEN not in value  # the cookie is a signature, not the token
    cookie = {"Cookie": f"{COOKIE}={value}"}
    status, _, body = await get(fleet, "/dashboard", cookie)
    assert status == 200 and b'src="/dashboard/static/dashboard.js"' in body
    status, _, body = await get(fleet, "/dashboard/state", cookie)
    assert status == 200
    msgspec.json.decode(body, type=DashboardState)
    status, _, _ = await get(fleet, "/admin/workers", cookie)
    assert status == 401  # the cookie opens the read-only dashboard, never the admin API
    # the bearer header opens the page too, and starts a session for the page's polling
    status, headers, _ = await get(fleet, "/dashboard", AUTH)
    assert status == 200 and session_cookie(headers)[1]["httponly"]
    status, headers, _ = await call(fleet, "POST", "/dashboard/logout", cookie)
    assert status == 303 and session_cookie(headers)[0] == ""


async def test_state_shows_the_fleet_after_traffic(fleet: Fleet) -> None:
    for salt in ("tenant-a", "tenant-b"):
        status, headers, _ = await fleet.post("/v1/chat/completions", chat(salt))
        assert status == 200
        holder = headers["x-kvroute-worker"]

        async def indexed(salt: str = salt, holder: str = holder) -> bool:
            return await fleet.holds(chat(salt), holder, 300)

        await eventually(indexed, what=f"{salt}'s prefix indexed")
    status, _, answer = await fleet.post("/v1/chat/completions", chat("tenant-a"))
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300

    status, _, body = await get(fleet, "/dashboard/state", AUTH)
    assert status == 200
    state = msgspec.json.decode(body, type=DashboardState)
    assert state.login and state.policy == "kv" and state.cluster is None
    assert [w.id for w in state.workers] == ["w0", "w1"]
    assert all(w.status == "ready" and w.healthy for w in state.workers)
    assert {(s.stream, s.state) for s in state.streams} == {
        ("w0#dp0", "synced"),
        ("w1#dp0", "synced"),
    }
    assert {(r.worker, r.dp_rank) for r in state.ranks} >= {("w0", 0), ("w1", 0)}
    _, listed = await fleet.admin("GET", "/namespaces")
    assert {n.id for n in state.namespaces} == {row["id"] for row in listed["namespaces"]}
    assert state.namespace_count == len(listed["namespaces"]) >= 3  # two tenants and warm-up
    # the newest decision first: the repeat of tenant-a, a prefix hit, exactly predicted
    newest = state.decisions[0]
    assert len(state.decisions) == 3 and newest.reason == "prefix"
    assert newest.cached_tokens == newest.matched_tokens >= 300
    assert "holds the longest prefix" in newest.explanation
    assert newest.namespace in {n.id for n in state.namespaces}
    total = state.prediction.total
    assert total.requests == 3 and total.usage_reports == 3 and total.accuracy == 1.0
    assert total.hit_rate is not None and 0.25 < total.hit_rate < 0.34  # one hit of three
    assert len(state.prediction.minutes) == 5 and len(state.prediction.buckets) == 30
    assert sum(m.requests for m in state.prediction.minutes) == 3
    for secret in (b"tenant-a", b"tenant-b", b"warm-up"):
        assert secret not in body  # salts never, fingerprints only


async def test_state_shows_an_unfollowed_worker_and_keeps_its_answers_out_of_accuracy(
    fleet: Fleet,
) -> None:
    """The false-hit watch's quarantine showed only in `GET /admin/workers`; and the hits of
    the unfollowed worker's own cache, predicted nothing on purpose, were counted inexact:
    the page's accuracy fell for a reason that is no index lag."""
    await unfollow(fleet.router, "w0")
    status, _ = await fleet.admin("POST", "/workers/w1/drain")
    assert status == 200
    for _ in range(2):  # a miss, then a hit on w0's own cache that nothing predicted
        status, headers, _ = await fleet.post("/v1/chat/completions", chat("tenant-u"))
        assert status == 200 and headers["x-kvroute-worker"] == "w0"
    status, _, body = await get(fleet, "/dashboard/state", AUTH)
    assert status == 200
    state = msgspec.json.decode(body, type=DashboardState)
    left = {w.id: w.unfollowed_s for w in state.workers}
    assert 50 < left["w0"] <= 60 and left["w1"] == 0
    total = state.prediction.total
    assert total.usage_reports == 2 and total.accuracy is None  # none to judge the index by
    assert (
        total.hit_rate is not None and total.hit_rate > 0.4
    )  # the hit is the fleet's all the same
    assert "w0's KV events were unfollowed" in state.decisions[0].explanation


def test_the_page_needs_nothing_from_the_network() -> None:
    for name in ("index.html", "login.html", "dashboard.js", "dashboard.css"):
        text = (STATIC / name).read_text(encoding="utf-8")
        assert "http:" not in text and "https:" not in text and "url(" not in text, name
        # every reference in the markup is to the router's own /dashboard paths
        refs = re.findall(r'(?:src|href|action)="([^"]*)"', text)
        assert all(r.startswith("/dashboard") for r in refs), (name, refs)


def test_session_cookies_expire_and_are_tied_to_the_token() -> None:
    now = [1_000_000.0]
    session = DashboardSession("secret", clock=lambda: now[0])
    cookie = session.issue()
    assert session.valid(cookie)
    assert not DashboardSession("other", clock=lambda: now[0]).valid(cookie)
    expiry, _, mac = cookie.partition(".")
    assert not session.valid(f"{int(expiry) + 1}.{mac}")  # a longer life is a forgery
    for junk in ("", ".", "x.y", "²³.ab", cookie + "0", "\udcff.x"):
        assert not session.valid(junk), junk
    now[0] += SESSION_S
    assert not session.valid(cookie)
    assert session.token_matches("secret") and not session.token_matches("secret\udcff")


def _stream(worker: str, rank: int, state: str = "synced") -> StreamRow:
    return StreamRow(
        stream=f"{worker}#dp{rank}",
        worker=worker,
        dp_rank=rank,
        state=state,
        lag_s=0.1,
        last_seq=1,
        entries=1,
        block_size=16,
        gaps=0,
        replays=0,
        restarts=0,
        decode_errors=0,
    )


def test_ranks_fold_unranked_load_only_where_one_rank_is_all_there_is() -> None:
    load = LoadTracker()
    load.begin("one", 100)  # one rank: the router sends no rank, the engine has only rank 0
    load.begin("two", 50, dp_rank=1)
    load.begin("two", 7)  # ranks of its own not known yet: the engine picked
    load.begin("plain", 9)  # no KV events, no streams
    streams = [_stream("one", 0), _stream("two", 0), _stream("two", 1, "degraded")]
    rows = rank_rows(["one", "two", "plain", "idle"], streams, load.by_target())
    got = [(r.worker, r.dp_rank, r.running, r.queued_prefill_tokens, r.stream_state) for r in rows]
    assert got == [
        ("one", 0, 1, 100, "synced"),
        ("two", None, 1, 7, None),
        ("two", 0, 0, 0, "synced"),
        ("two", 1, 1, 50, "degraded"),
        ("plain", None, 1, 9, None),
        ("idle", None, 0, 0, None),
    ]


def test_no_dashboard_without_the_admin_api() -> None:
    def paths(**admin: Any) -> set[str]:
        app = create_app(router_config([], admin=AdminConfig(token=TOKEN, **admin)))
        return {r.canonical for r in app.router.resources()}

    assert {"/dashboard", "/dashboard/state", "/dashboard/login"} <= paths()
    assert not any(p.startswith("/dashboard") for p in paths(enabled=False))
