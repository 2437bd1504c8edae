"""The login form's body, read: its `token` field, or a RequestError naming what is wrong.

`POST /dashboard/login` is the one route that takes a body from anyone, before any token is
known, and aiohttp's form reader raises whatever its decoders raise on a malformed one: a
charset Python does not know (LookupError), bytes that are not text in the charset given
(UnicodeDecodeError), a multipart body without its boundary, cut short, with a part without a
name, in an unknown transfer encoding or with a bad header line (ValueError, RuntimeError,
binascii.Error, aiohttp's InvalidHeader). Each became a 500 and an ERROR traceback per request,
for anyone to fill the log with. Here each is a 400 naming the problem (the error middleware
answers it in JSON and logs nothing), as a body the router cannot read is everywhere else; the
messages name the kind of fault, never the body's bytes (the token is among them).

Too many fields is aiohttp's 413, which the middleware would word as a body over
`limits.max_body_bytes`; here it is a 400 saying so. aiohttp answers the same 413 for a
urlencoded body whose %-escapes are no text in its charset (the codec's UnicodeError is a
ValueError to its parser): that is told apart, and said as what it is (before, `charset=idna`
with `token=%ff` was "over 1000 fields"). A body truly over the limit stays the middleware's
413.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from router.errors import RequestError, UnsupportedEncodingError

__all__ = ["FORM_TYPES", "form_token"]

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
_SHOWN = 64  # a header value echoed in a message is clipped to this


def _clipped(value: str) -> str:
    return repr(value[:_SHOWN])


async def _too_many_fields(request: web.Request) -> bool:
    """Whether a urlencoded body aiohttp refused has more fields than it takes: its rule
    (yarl's `query_to_pairs`: as many `&` as the limit), on the body it read already."""
    try:
        text = (await request.read()).rstrip().decode(request.charset or "utf-8")
    except (LookupError, ValueError):
        return False
    return text.count("&") >= request.client_max_fields


async def form_token(request: web.Request) -> str | None:
    """The form's `token` field as text; None when it has none (or it is a file, or a part
    of a non-text type). Raises RequestError when the body is not a form that can be read."""
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    # (an empty body's reader has no such count: aiohttp made no decoder for it either)
    decoded = getattr(request.content, "total_compressed_bytes", None) is not None
    if coding not in ("", "identity") and not decoded:
        # aiohttp's form reader reads the body as sent, and the router's listener leaves it
        # encoded (`router.http.request_body`); no browser encodes a form
        raise UnsupportedEncodingError("the login form is sent without a Content-Encoding")
    kind = request.content_type
    if kind not in FORM_TYPES:
        raise RequestError(
            f"the login form is sent as {FORM_TYPES[0]} or {FORM_TYPES[1]} with a token "
            f"field; this body's Content-Type is {_clipped(kind)}"
        )
    try:
        form = await request.post()
    except LookupError:
        named = (
            "a part's charset"
            if kind == FORM_TYPES[1]
            else f"charset {_clipped(request.charset or '')}"
        )
        raise RequestError(
            f"the login form's {named} is not a text encoding Python knows"
        ) from None
    except UnicodeError as exc:
        # a UnicodeDecodeError names its codec; a codec's bare UnicodeError (punycode, idna)
        # does not: the form's charset, clipped (it is the client's)
        encoding = getattr(exc, "encoding", None)
        if not isinstance(encoding, str):
            encoding = _clipped(request.charset or "") if kind == FORM_TYPES[0] else "its part's"
        raise RequestError(f"the login form is not valid {encoding} text") from None
    except web.HTTPRequestEntityTooLarge:
        if request.content.total_bytes > request.client_max_size:
            raise  # over limits.max_body_bytes: the middleware's 413 says so
        if kind == FORM_TYPES[0] and not await _too_many_fields(request):
            # aiohttp words every ValueError of the urlencoded parser so, the codec's too: a
            # %-escape that is no text in the charset (`charset=idna`, `token=%ff`)
            raise RequestError(
                "the login form's %-escaped bytes are not valid "
                f"{_clipped(request.charset or 'utf-8')} text"
            ) from None
        raise RequestError(
            f"the login form has over {request.client_max_fields} fields; it takes one, token"
        ) from None
    except (ValueError, RuntimeError, HttpProcessingError) as exc:
        # aiohttp's multipart reader: no boundary, cut short, a part without a name, a nested
        # multipart, an unknown transfer encoding, bad base64 (binascii.Error is a ValueError),
        # a malformed part header. Its message may quote the body, so only the kind is told
        hint = ": check its boundary, its parts' headers and that it is whole"
        raise RequestError(
            f"the login form cannot be read as {kind} ({type(exc).__name__})"
            + (hint if kind == FORM_TYPES[1] else "")
        ) from None
    for value in form.values():
        if isinstance(value, web.FileField):
            value.file.close()  # a part sent as a file: spooled by aiohttp, never a token
    given = form.get("token")
    return given if isinstance(given, str) else None
