"""The dashboard over HTTP: its login and session cookie, the state it renders, its files."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from http.cookies import SimpleCookie
from importlib import resources
from typing import Any, Protocol

import aiohttp
import msgspec
from multidict import CIMultiDict, CIMultiDictProxy

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


class Served(Protocol):
    """A router to call: the fleet's, or a replica (`RouterService`)."""

    @property
    def url(self) -> str: ...


async def call(
    fleet: Served,
    method: str,
    path: str,
    headers: Mapping[str, str] | None = None,
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


async def get(fleet: Served, path: str, headers: Mapping[str, str] | None = None) -> Answer:
    """GET `path`."""
    return await call(fleet, "GET", path, headers)


async def login(fleet: Served, token: str) -> Answer:
    """POST the login form with `token`."""
    return await call(fleet, "POST", "/dashboard/login", form={"token": token})


async def logged_in(fleet: Served) -> dict[str, str]:
    """The Cookie header of a new session (a login with the right token)."""
    status, headers, _ = await login(fleet, TOKEN)
    assert status == 303
    return {"Cookie": f"{COOKIE}={session_cookie(headers)[0]}"}


async def logout(fleet: Served, cookie: dict[str, str] | None) -> None:
    """POST the logout form with `cookie`: the redirect to the page, the cookie dropped."""
    status, headers, _ = await call(fleet, "POST", "/dashboard/logout", cookie)
    assert status == 303 and headers["Location"] == "/dashboard"
    assert session_cookie(headers)[0] == ""


async def state_status(fleet: Served, cookie: dict[str, str]) -> int:
    """The status of `GET /dashboard/state` with `cookie` (200, or 401 with an AuthError)."""
    status, _, body = await get(fleet, "/dashboard/state", cookie)
    if status == 401:
        assert msgspec.json.decode(body)["error"]["type"] == "AuthError"
    return status


async def shows_login_form(fleet: Served, cookie: dict[str, str]) -> bool:
    """Whether `GET /dashboard` with `cookie` answers the login form (401) instead of the page."""
    status, _, body = await get(fleet, "/dashboard", cookie)
    assert (status == 401) == (b'action="/dashboard/login"' in body)
    return status == 401


def old_form(token: str, expiry: str) -> str:
    """A cookie as issued before sessions had ids: `<expiry>.<HMAC(token, expiry)>`."""
    key = f"kvroute-dashboard-session\0{token}".encode()
    return f"{expiry}.{hmac.new(key, expiry.encode(), hashlib.sha256).hexdigest()}"


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
    # the token and another: two headers bear no token (a proxy in front may read the other)
    twice = CIMultiDict([("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer x")])
    status, _, _ = await get(fleet, "/dashboard/state", twice)
    assert status == 401
    for forged in (f"{9_999_999_999}.{'0' * 64}", f"{9_999_999_999}.{'0' * 32}.{'0' * 64}"):
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
    await logout(fleet, cookie)


async def test_a_cookie_replayed_after_logout_is_refused(fleet: Fleet) -> None:
    """Before, logging out only told the browser to drop the cookie: its value, replayed (a
    copy, a shared machine's history of it), opened the page and its state until its expiry."""
    cookie = await logged_in(fleet)
    assert await state_status(fleet, cookie) == 200 and not await shows_login_form(fleet, cookie)
    await logout(fleet, cookie)
    assert await state_status(fleet, cookie) == 401
    assert await shows_login_form(fleet, cookie)
    await logout(fleet, cookie)  # again: nothing left to end, the same redirect
    assert await state_status(fleet, await logged_in(fleet)) == 200  # a new login is a new session


async def test_each_login_is_its_own_session(fleet: Fleet) -> None:
    """Before, the cookie was its expiry signed: two logins within one second got the same
    cookie, and no session could be told from another."""
    first, second = await logged_in(fleet), await logged_in(fleet)
    assert first != second
    # the bearer header starts a session of its own too
    status, headers, _ = await get(fleet, "/dashboard", AUTH)
    assert status == 200
    third = {"Cookie": f"{COOKIE}={session_cookie(headers)[0]}"}
    assert third not in (first, second)
    await logout(fleet, first)
    assert await state_status(fleet, first) == 401
    assert await state_status(fleet, second) == await state_status(fleet, third) == 200
    assert not await shows_login_form(fleet, second)


async def test_logout_without_a_session_still_redirects(fleet: Fleet) -> None:
    cookie = await logged_in(fleet)
    expiry, _, rest = cookie["Cookie"].partition("=")[2].partition(".")
    sid, _, mac = rest.partition(".")
    for sent in (
        None,
        {"Cookie": f"{COOKIE}=junk"},
        {"Cookie": f"{COOKIE}={old_form(TOKEN, expiry)}"},  # a session of no id
        {"Cookie": f"{COOKIE}={expiry}.{sid}.{'0' * 64}"},  # a forged MAC ends nothing
        {"Cookie": f"{COOKIE}={expiry}.{'0' * 32}.{mac}"},  # nor another session id
    ):
        await logout(fleet, sent)
    assert await state_status(fleet, cookie) == 200


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
    expiry, sid, mac = cookie.split(".")
    assert len(sid) == 32 and sid != session.issue().split(".")[1]  # random: one per login
    assert not session.valid(f"{int(expiry) + 1}.{sid}.{mac}")  # a longer life is a forgery
    assert not session.valid(f"{expiry}.{'0' * 32}.{mac}")  # so is another session's id
    assert not session.valid(old_form("secret", expiry))  # from before ids: log in again
    for junk in ("", ".", "..", "x.y", "x.y.z", "²³.ab.cd", cookie + "0", "\udcff.x.y"):
        assert not session.valid(junk), junk
    assert session.end(old_form("secret", expiry)) is None  # ends no session
    now[0] += SESSION_S
    assert not session.valid(cookie)
    assert session.token_matches("secret") and not session.token_matches("secret\udcff")


def test_a_session_ended_stays_ended_until_its_expiry_then_is_forgotten() -> None:
    now = [1_000_000.0]
    session = DashboardSession("secret", clock=lambda: now[0])
    first = session.issue()
    now[0] += 3600
    second = session.issue()
    ended = session.end(first)
    assert ended is not None and ended == (first.split(".")[1], int(first.split(".")[0]))
    assert not session.valid(first) and session.valid(second)
    assert session.end(first) is None  # ended already: nothing to share again
    # a logout made on another replica (its record read from NATS): the same, by id
    session.revoke(second.split(".")[1], int(second.split(".")[0]))
    assert not session.valid(second) and session.revoked_sessions == 2
    session.revoke("not-an-id", 2_000_000)  # a record no cookie can carry: not kept
    session.revoke("0" * 32, int(now[0]))  # expired already: nothing to keep
    assert session.revoked_sessions == 2
    now[0] += SESSION_S - 3600  # the first one's expiry: it is pruned at the next logout
    third = session.issue()
    session.end(third)
    assert session.revoked_sessions == 2  # the second and the third


def test_a_replica_accepts_only_its_own_sessions_until_it_has_read_the_logouts() -> None:
    """A replica that starts while NATS is away has not read the other replicas' logouts: a
    session started elsewhere may be one of them, so its cookie is refused until they are read
    (the user logs in again, here); a session started here is accepted."""
    now = [1_000_000.0]
    elsewhere = DashboardSession("secret", clock=lambda: now[0])
    session = DashboardSession("secret", clock=lambda: now[0])
    session.expect_revocations()
    other, own = elsewhere.issue(), session.issue()
    assert not session.valid(other) and session.valid(own)
    session.revocations_known()
    assert session.valid(other) and session.valid(own)


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
