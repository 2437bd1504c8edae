"""The dashboard's browser session: a signed, expiring cookie in place of the admin token.

A browser cannot put an `Authorization` header on a navigation, so the page is reached by
handing the admin token over once (the login form's POST body, or a bearer header) and carrying
a cookie after that. The cookie is not the token: it is `<expiry>.<session id>.<MAC>`, the MAC
an HMAC-SHA256 under the token of the expiry and the id (16 random bytes, one per login), so a
leaked cookie stops working at its expiry and never reveals the token, changing the token ends
every session, and replicas sharing one token accept each other's cookies.

Logging out ends the session, not just the browser's copy of the cookie: its id is kept as
revoked until its expiry (then forgotten), and a cookie of a revoked id is refused. With
replicas the logout is a record every replica applies (`router.cluster.service`, the
`<prefix>_sessions` bucket: `revoke`), read back by one that starts later. Without a cluster the
revocations live in this process: a restart forgets them. Before, the cookie was the expiry
signed and nothing else: logout dropped the browser's copy only, and the value, replayed, opened
the dashboard on every replica until its expiry; two logins in one second got the same cookie.

It is `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page can send it,
which is what keeps a cross-site form from acting with it) and scoped to `/dashboard`, whose
routes only read: the cookie opens the page and its state, never the admin API.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable

__all__ = ["COOKIE", "SESSION_S", "DashboardSession"]

COOKIE = "kvroute_dashboard"
SESSION_S = 12 * 3600  # a working day; then the token is asked for again
_SID = re.compile(r"[0-9a-f]{32}")  # 16 random bytes, hex
_EXPIRY = re.compile(r"[0-9]{1,12}")


class DashboardSession:
    """Issues and checks session cookies under one admin token, and ends sessions."""

    def __init__(self, token: str, clock: Callable[[], float] = time.time) -> None:
        self._key = f"kvroute-dashboard-session\0{token}".encode()
        self._token = token.encode()
        self._clock = clock
        self._revoked: dict[str, int] = {}  # session id -> its expiry
        # while the other replicas' logouts are unread (`expect_revocations`): the sessions
        # started here meanwhile, the only ones accepted until then
        self._unread: set[str] | None = None

    def _mac(self, expiry: str, sid: str) -> str:
        return hmac.new(self._key, f"{expiry}.{sid}".encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        """A cookie value of a new session, valid for `SESSION_S` from now."""
        expiry = str(int(self._clock()) + SESSION_S)
        sid = secrets.token_hex(16)
        if self._unread is not None:
            self._unread.add(sid)
        return f"{expiry}.{sid}.{self._mac(expiry, sid)}"

    def _signed(self, cookie: str | None) -> tuple[str, int] | None:
        """(session id, expiry) of a cookie issued under this token and not expired."""
        parts = (cookie or "").split(".")
        if len(parts) != 3:
            return None  # the old two-part form among them: its user logs in again
        expiry, sid, mac = parts
        if _EXPIRY.fullmatch(expiry) is None or _SID.fullmatch(sid) is None:
            return None
        # the expiry is checked after the MAC, so a forged one learns nothing from timing
        good = hmac.compare_digest(
            mac.encode("utf-8", "surrogatepass"), self._mac(expiry, sid).encode()
        )
        if not good or int(expiry) <= self._clock():
            return None
        return sid, int(expiry)

    def valid(self, cookie: str | None) -> bool:
        """Whether `cookie` was issued under this token, has not expired and was not ended."""
        signed = self._signed(cookie)
        if signed is None:
            return False
        sid = signed[0]
        if self._unread is not None and sid not in self._unread:
            return False  # started elsewhere: its logout may be among those unread
        return sid not in self._revoked

    def end(self, cookie: str | None) -> tuple[str, int] | None:
        """Log the session of `cookie` out here; (its id, its expiry) for the other replicas,
        or None when there was no open session to end (no cookie, a forged or expired one,
        one ended already)."""
        signed = self._signed(cookie)
        if signed is None or signed[0] in self._revoked:
            return None
        self.revoke(*signed)
        return signed

    def revoke(self, sid: str, expiry: int) -> None:
        """Refuse the session `sid` until `expiry` (a logout here or on another replica);
        the ones expired since are forgotten meanwhile, so the set holds open sessions only."""
        now = self._clock()
        if _SID.fullmatch(sid) is None or expiry <= now:
            return  # no cookie carries it, or none would be accepted anyway
        self._revoked = {s: e for s, e in self._revoked.items() if e > now}
        self._revoked[sid] = expiry

    def ended(self) -> dict[str, int]:
        """The sessions ended and not expired: id -> expiry (a copy)."""
        now = self._clock()
        return {s: e for s, e in self._revoked.items() if e > now}

    @property
    def revoked_sessions(self) -> int:
        """How many ended sessions are held (each until its expiry)."""
        return len(self._revoked)

    def expect_revocations(self) -> None:
        """The logouts of other replicas are to be read (`revoke`) before the first
        `revocations_known`: until then only the sessions started here are accepted, since
        any other may be one of them (its user logs in again, here)."""
        self._unread = set()

    def revocations_known(self) -> None:
        """The other replicas' logouts are read: every session is accepted again."""
        self._unread = None

    def token_matches(self, given: str) -> bool:
        """Whether `given` is the admin token (constant time, any text)."""
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self._token)
