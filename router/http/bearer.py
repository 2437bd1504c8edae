"""The bearer-token check of the admin API, the KV query API and the dashboard, and where
they may go without one (a listener only this machine reaches).

RFC 6750 over RFC 7235: the scheme is case-insensitive (`bearer t` is `Bearer t`), the token is
compared in constant time, and a header that is not UTF-8 (it reaches aiohttp as lone
surrogates) is just another wrong token. A refusal names the scheme it wants in
`WWW-Authenticate` (`AuthError.headers`). A request with two `Authorization` headers bears
no token (`bears_token`): a proxy in front that reads the other one would let through what the
router refuses, or refuse what it lets through.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import hdrs
from multidict import MultiMapping

__all__ = ["bearer_matches", "bearer_token", "bears_token", "is_loopback", "sole_bearer_token"]


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None for another scheme."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_matches(authorization: str, token: str) -> bool:
    """True when the header carries exactly `token` (compared in constant time)."""
    given = bearer_token(authorization)
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode())


def sole_bearer_token(headers: MultiMapping[str]) -> str | None:
    """The bearer token of the request's one `Authorization` header; None without one, with
    another scheme, or with two headers (they bear no token)."""
    given = headers.getall(hdrs.AUTHORIZATION, ())
    return bearer_token(given[0]) if len(given) == 1 else None


def bears_token(headers: MultiMapping[str], token: str) -> bool:
    """True when the request has one `Authorization` header and it carries exactly `token`."""
    given = headers.getall(hdrs.AUTHORIZATION, ())
    return len(given) == 1 and bearer_matches(given[0], token)
