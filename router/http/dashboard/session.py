"""The dashboard's browser session: a signed, expiring cookie in place of the admin token.

A browser cannot put an `Authorization` header on a navigation, so the page is reached by
handing the admin token over once (the login form's POST body, or a bearer header) and carrying
a cookie after that. The cookie is not the token: it is `<expiry>.<HMAC-SHA256(token, expiry)>`,
so a leaked cookie stops working at its expiry and never reveals the token; changing the token
ends every session; and replicas sharing one token accept each other's cookies with no state.

It is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page can send it,
which is what keeps a cross-site form from acting with it) and scoped to `/dashboard`, whose
routes only read: the cookie opens the page and its state, never the admin API.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

__all__ = ["COOKIE", "SESSION_S", "DashboardSession"]

COOKIE = "kvroute_dashboard"
SESSION_S = 12 * 3600  # a working day; then the token is asked for again


class DashboardSession:
    """Issues and checks session cookies under one admin token."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self._key = f"kvroute-dashboard-session\0{token}".encode()
        self._token = token.encode()
        self._clock = clock

    def _mac(self, expiry: str) -> str:
        return hmac.new(self._key, expiry.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        """A cookie value valid for `SESSION_S` from now."""
        expiry = str(int(self._clock()) + SESSION_S)
        return f"{expiry}.{self._mac(expiry)}"

    def valid(self, cookie: str | None) -> bool:
        """Whether `cookie` was issued under this token and has not expired."""
        if not cookie:
            return False
        expiry, _, mac = cookie.partition(".")
        if not (expiry.isascii() and expiry.isdigit()) or len(expiry) > 12:
            return False
        # the expiry is checked after the MAC, so a forged one learns nothing from timing
        good = hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), self._mac(expiry).encode())
        return good and int(expiry) > self._clock()

    def token_matches(self, given: str) -> bool:
        """Whether `given` is the admin token (constant time, any text)."""
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self._token)
