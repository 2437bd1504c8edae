"""The dashboard in a real headless Chromium: log in, watch it render the fleet and update.

The browser does what an operator does: opens /dashboard, gets the login form, submits the
admin token, and lands on the page, whose script polls the state and renders it. The test reads
what it rendered from the DOM, sends more traffic and waits for the page to show it on its own.
Skipped only when no Chromium is installed (`.ci/run` installs Debian's `chromium`).
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.router.conftest import TOKEN, Fleet, eventually, unfollow
from tests.router.ops.browser import Browser, find_chromium
from tests.router.ops.test_dashboard import chat

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's chromium package)"
)


class Tables(HTMLParser):
    """The body rows of every table with an id, as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._in_body = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("id")
            if self._table:
                self.rows[self._table] = []
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body and self._table:
            self.rows[self._table].append([])
        elif tag == "td" and self._in_body and self._table:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table:
            self.rows[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "tbody":
            self._in_body = False
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables(dom: str) -> dict[str, list[list[str]]]:
    """`Tables` of a DOM dump."""
    parser = Tables()
    parser.feed(dom)
    return parser.rows


async def log_in(browser: Browser) -> None:
    """Type the token into the login form, submit, and wait for the page's first render."""
    # as an operator would: the token travels in the POST body only
    await browser.evaluate(
        f"document.getElementById('token').value = {json.dumps(TOKEN)};"
        "document.getElementById('login').submit(); true"
    )
    await browser.until(
        "document.body && Number(document.body.dataset.renders) >= 1", what="the first render"
    )


async def test_log_in_and_watch_the_fleet(fleet: Fleet, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    # a client's request id never reaches the page as markup (the page shows ids as text, and a
    # malformed one is replaced by the router's own before anything shows it)
    markup = '<img src="/dashboard/x" id="injected">'
    for salt, request_id in (("tenant-a", markup), ("tenant-b", "plain-1")):
        status, _, _ = await fleet.post(
            "/v1/chat/completions", chat(salt), headers={"x-request-id": request_id}
        )
        assert status == 200

    async def listed_namespaces() -> set[str]:
        _, listed = await fleet.admin("GET", "/namespaces")
        return {row["id"] for row in listed["namespaces"]}

    async def both_tenants_indexed() -> bool:
        # the namespaces come from the workers' events, which trail the answers
        return len(await listed_namespaces()) >= 3  # two tenants and the fleet's warm-up

    await eventually(both_tenants_indexed, what="both tenants' namespaces indexed")
    fingerprints = await listed_namespaces()

    async with Browser(CHROMIUM, tmp_path / "profile") as browser:
        await browser.navigate(fleet.url + "/dashboard")
        await browser.until("!!document.getElementById('login')", what="the login form")
        assert not await browser.evaluate("!!document.getElementById('workers')")
        await log_in(browser)
        assert await browser.evaluate("location.pathname") == "/dashboard"
        assert await browser.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
        (cookie,) = await browser.cookies()
        assert cookie["name"] == "kvroute_dashboard" and TOKEN not in cookie["value"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

        # new traffic: the page shows it without being reloaded
        status, headers, answer = await fleet.post(
            "/v1/chat/completions", chat("tenant-a"), headers={"x-request-id": "live-7"}
        )
        assert status == 200
        await browser.until(
            "!!document.querySelector('#decisions tr[data-key=\"live-7\"]')",
            what="the new decision on the page",
        )
        renders = int(await browser.evaluate("document.body.dataset.renders"))
        assert renders >= 2
        dom = await browser.evaluate("document.documentElement.outerHTML")
        updated = await browser.evaluate("document.getElementById('updated').textContent")
        assert updated != "never"

        assert not await browser.evaluate("!!document.getElementById('injected')")
        rows = tables(dom)
        ids = [r[1] for r in rows["decisions"]]
        assert ids[:2] == ["live-7", "plain-1"] and re.fullmatch("[0-9a-f]{32}", ids[2])
        workers = {r[0]: r for r in rows["workers"]}
        assert set(workers) == {"w0", "w1"} and all(r[1] == "ready" for r in workers.values())
        streams = {r[0]: r[1] for r in rows["streams"]}
        assert streams == {"w0#dp0": "synced", "w1#dp0": "synced"}
        assert {(r[0], r[1], r[2]) for r in rows["ranks"]} == {
            ("w0", "0", "synced"),
            ("w1", "0", "synced"),
        }
        shown = {r[0] for r in rows["namespaces"]}
        assert fingerprints <= shown
        newest = rows["decisions"][0]
        assert newest[1] == "live-7" and newest[2] == headers["x-kvroute-worker"]
        assert newest[4] in fingerprints  # a fingerprint, never the salt
        assert newest[-1].startswith("prefix: ") and "holds the longest prefix" in newest[-1]
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert newest[7] == str(cached) and cached >= 300
        assert len(rows["decisions"]) == 3
        assert rows["minutes"][0][:2] == ["last minute", "3"]
        assert "tenant-a" not in dom and "tenant-b" not in dom and TOKEN not in dom
        # nothing but the router was asked for anything: no CDN, no font, no beacon
        assert browser.requests and all(u.startswith(fleet.url) for u in browser.requests)
        assert not any(TOKEN in u for u in browser.requests)

        # the session ends under the open page: its next poll is refused and it shows the form
        await browser.command("Network.clearBrowserCookies")
        await browser.until("!!document.getElementById('login')", what="the page to go to login")
        await log_in(browser)

        # logging out ends the session: the form again, and the state is refused
        assert not await browser.evaluate("document.getElementById('logout').hidden")
        await browser.evaluate("document.getElementById('logout').submit(); true")
        await browser.until("!!document.getElementById('login')", what="the login form again")

        async def refused() -> bool:
            code = "fetch('/dashboard/state').then(r => r.status)"
            return bool(await browser.evaluate(code) == 401)

        await eventually(refused, what="the state refused after logging out")


async def test_an_unfollowed_worker_shows_as_such_with_the_seconds_left(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A worker whose KV events the false-hit watch leaves unfollowed (routed by load, no hit
    predicted) looked `ready` with a `–` stream, as one without events: the page says so now,
    on the worker and on its ranks, with the seconds left."""
    assert CHROMIUM is not None
    async with Browser(CHROMIUM, tmp_path / "profile") as browser:
        await browser.navigate(fleet.url + "/dashboard")
        await browser.until("!!document.getElementById('login')", what="the login form")
        await log_in(browser)
        await unfollow(fleet.router, "w0")
        await browser.until(
            "document.querySelector('#workers tr[data-key=\"w0\"]').textContent"
            ".includes('unfollowed')",
            what="w0 shown unfollowed",
        )
        rows = tables(await browser.evaluate("document.documentElement.outerHTML"))
    workers = {r[0]: r[1] for r in rows["workers"]}
    assert re.fullmatch(r"ready \(unfollowed, (5\d|60) s left\)", workers["w0"]), workers
    assert workers["w1"] == "ready"
    ranks = {(r[0], r[1]): r[2] for r in rows["ranks"]}
    assert re.fullmatch(r"unfollowed, (5\d|60) s left", ranks["w0", "–"]), ranks
    assert ranks["w1", "0"] == "synced"
