"""The `/dashboard` routes: the page, its login, its state, its two static files.

`GET /dashboard` is the page for a browser holding a session cookie (or sending the admin token
as a bearer header, which also starts a session), and a login form (401) for anyone else. The
form posts the token to `POST /dashboard/login`, in the body, so it never sits in a URL, a
history entry or an access log; a right token answers with the session cookie
(`router.http.dashboard.session`) and a redirect to the page; a wrong or missing token, the
login form again (401) with the error on it; a body that is no readable form (another
Content-Type, an unknown charset, a broken multipart: `router.http.dashboard.login_form`), a
400 JSON error naming the problem. The page polls
`GET /dashboard/state` (cookie or bearer; 401 JSON without) and renders it; the static files are
code with no data in them, served to anyone, so the login form has its stylesheet.

Every page is sent with a Content-Security-Policy allowing this origin only: the page works
with no network beyond the router, and a value that slipped into the markup could not load or
run anything.

`POST /dashboard/logout` ends the session of the cookie it comes with (here, and with replicas
on every replica: `router.cluster.service`), not only the browser's copy, and answers the
redirect to the page whatever the cookie was.

With no admin token configured (a loopback-only router, as the admin API allows) there is no
login: the page and its state are open, like `/admin`.
"""

from __future__ import annotations

import html
import logging
import time
from importlib import resources

from aiohttp import web

from router.errors import AuthError
from router.http.bearer import sole_bearer_token
from router.http.dashboard.login_form import form_token
from router.http.dashboard.session import COOKIE, SESSION_S, DashboardSession
from router.http.dashboard.state import encode, snapshot
from router.http.keys import CLUSTER, DASHBOARD_SESSION

__all__ = ["PAGE_PATH", "add_dashboard_routes"]

log = logging.getLogger(__name__)

PAGE_PATH = "/dashboard"
_STATIC = resources.files("router.http.dashboard") / "static"
_ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_ERROR_MARK = "<!--error-->"
# one snapshot serves every open page polling within this long: ten viewers cost what one does
_FRESH_S = 0.5
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _read(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


class _Dashboard:
    """The handlers, over the files read once and the session of one admin token."""

    def __init__(self, token: str) -> None:
        self.session = DashboardSession(token) if token else None
        self._page = _read("index.html").encode()
        self._login = _read("login.html")
        self._assets = {name: (_read(name).encode(), kind) for name, kind in _ASSETS.items()}
        self._body = b""
        self._built_at = -_FRESH_S

    def _by_header(self, request: web.Request) -> bool:
        session = self.session
        token = sole_bearer_token(request.headers)
        return session is not None and token is not None and session.token_matches(token)

    def _authorized(self, request: web.Request) -> bool:
        session = self.session
        if session is None:
            return True
        return session.valid(request.cookies.get(COOKIE)) or self._by_header(request)

    def _start_session(self, request: web.Request, response: web.Response) -> None:
        assert self.session is not None
        response.set_cookie(
            COOKIE,
            self.session.issue(),
            max_age=SESSION_S,
            path=PAGE_PATH,
            httponly=True,
            samesite="Strict",
            secure=request.secure,  # behind TLS it never travels in clear
        )

    def _login_form(self, error: str = "") -> web.Response:
        body = self._login.replace(_ERROR_MARK, html.escape(error))
        return web.Response(
            text=body, status=401, content_type="text/html", charset="utf-8", headers=_HEADERS
        )

    async def page(self, request: web.Request) -> web.Response:
        """GET /dashboard: the page, or the login form without a session."""
        if not self._authorized(request):
            return self._login_form()
        response = web.Response(
            body=self._page, content_type="text/html", charset="utf-8", headers=_HEADERS
        )
        session = self.session
        if session is not None and not session.valid(request.cookies.get(COOKIE)):
            self._start_session(request, response)  # came with the bearer header
        return response

    async def login(self, request: web.Request) -> web.Response:
        """POST /dashboard/login (form field `token`): a session and back to the page."""
        response = web.Response(status=303, headers={"Location": PAGE_PATH, **_HEADERS})
        if self.session is None:
            return response  # nothing to log in to, whatever the body
        given = await form_token(request)  # a body that is no readable form: a 400
        if given is None:
            return self._login_form("The form had no token.")
        if not self.session.token_matches(given):
            return self._login_form("That is not the admin token.")
        self._start_session(request, response)
        return response

    async def logout(self, request: web.Request) -> web.Response:
        """POST /dashboard/logout: end the cookie's session (every replica's too) and drop it."""
        response = web.Response(status=303, headers={"Location": PAGE_PATH, **_HEADERS})
        response.del_cookie(COOKIE, path=PAGE_PATH)
        session = self.session
        ended = None if session is None else session.end(request.cookies.get(COOKIE))
        cluster = request.config_dict.get(CLUSTER)
        if ended is not None and cluster is not None:
            sid, expiry = ended
            if await cluster.session_ended(sid, expiry) == "pending":
                log.warning(
                    "dashboard: a logout ended its session on this replica only until NATS "
                    "answers; the other replicas accept its cookie until then"
                )
        return response

    async def state(self, request: web.Request) -> web.Response:
        """GET /dashboard/state: the JSON the page renders (`DashboardState`)."""
        if not self._authorized(request):
            raise AuthError("dashboard: log in at /dashboard, or send the admin bearer token")
        now = time.monotonic()
        if now - self._built_at > _FRESH_S:
            self._body, self._built_at = (
                encode(snapshot(request.app, login=self.session is not None)),
                now,
            )
        return web.Response(
            body=self._body,
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def asset(self, request: web.Request) -> web.Response:
        """GET /dashboard/static/{name}: the page's script and stylesheet."""
        found = self._assets.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        body, kind = found
        return web.Response(
            body=body,
            content_type=kind,
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
        )


def add_dashboard_routes(app: web.Application, token: str) -> None:
    """Serve the dashboard on the router's app, behind `token` (the admin token; '' = open)."""
    dashboard = _Dashboard(token)
    if dashboard.session is not None:
        app[DASHBOARD_SESSION] = dashboard.session  # the cluster's logouts end its sessions
    app.router.add_get(PAGE_PATH, dashboard.page)
    app.router.add_post(PAGE_PATH + "/login", dashboard.login)
    app.router.add_post(PAGE_PATH + "/logout", dashboard.logout)
    app.router.add_get(PAGE_PATH + "/state", dashboard.state)
    app.router.add_get(PAGE_PATH + "/static/{name}", dashboard.asset)
