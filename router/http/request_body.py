"""A request body as the router reads it: decoded from its `Content-Encoding` by the router.

aiohttp's parser decodes a body as it arrives, but checks that the coded stream ended for
deflate only: a gzip body cut short (its CRC32 and length trailer missing, or cut inside its
deflate data) was taken as whole and forwarded, and one with a broken header read as empty
("request body is empty"). So the router's listener leaves bodies as sent
(`RouterRunner`: `auto_decompress=False`) and every handler reads its body here
(`read_body`), decoded whole: a gzip or deflate body whose every member does not end, or that
has bytes after its last one, gets the 400 a body aiohttp could not decode gets
(`RequestPayloadError` from a `ContentEncodingError`, answered by
`router.http.app.answer_errors`). br and zstd are held to the same: whole, nothing after the
end (aiohttp's decoders of them never asked). The decoded body is bounded as aiohttp bounded
it, by `client_max_size` (`limits.max_body_bytes`), with its 413: a gzip bomb stops at the
limit.
"""

from __future__ import annotations

import asyncio
import sys
import zlib

import brotli
from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

if sys.version_info >= (3, 14):
    from compression.zstd import ZstdDecompressor
else:
    from backports.zstd import ZstdDecompressor

__all__ = ["DECODED_CODINGS", "decode_body", "read_body"]

# the request Content-Encodings the router decodes (Brotli and, before Python 3.14,
# backports.zstd are dependencies); the listener refuses any other one with a 415
DECODED_CODINGS = ("gzip", "deflate", "br", "zstd")

# the body as `read_body` decoded it, for a handler that reads it again
_DECODED = web.RequestKey("kvroute_decoded_body", bytes)


class _TooLarge(Exception):
    """The decoded body grew over the limit."""


def _inflated(raw: bytes, wbits: int, limit: int) -> bytes:
    """`raw` inflated (one member after another, as aiohttp reads concatenated ones), at most
    `limit` bytes; ContentEncodingError unless the last member ends the body."""
    out = bytearray()
    rest = raw
    while rest:
        stream = zlib.decompressobj(wbits)
        try:
            # bounded output: a bomb is stopped one byte over the limit, not inflated whole
            out += stream.decompress(rest, limit + 1 - len(out))
            while stream.unconsumed_tail and len(out) <= limit:
                out += stream.decompress(stream.unconsumed_tail, limit + 1 - len(out))
        except zlib.error:
            raise ContentEncodingError("not a valid stream") from None
        if len(out) > limit:
            raise _TooLarge
        if not stream.eof:  # cut short: a gzip trailer, deflate data or a header missing
            raise ContentEncodingError("the stream is cut short")
        rest = stream.unused_data
    return bytes(out)


def _unbrotli(raw: bytes, limit: int) -> bytes:
    """`raw` as one whole br stream, at most `limit` bytes; ContentEncodingError unless it
    ends (aiohttp's own decoder never asks: a body cut short read as whatever it held, an
    admin `{"drain": false}` cut to nothing drained the worker)."""
    decoder = brotli.Decompressor()
    try:
        out: bytes = decoder.process(raw, limit + 1)
        while not decoder.is_finished() and len(out) <= limit:
            more: bytes = decoder.process(b"", limit + 1 - len(out))
            if not more:
                break
            out += more
    except Exception:  # brotli's error for bytes that are not br, or bytes after its end
        raise ContentEncodingError("not a valid stream") from None
    if len(out) > limit:
        raise _TooLarge
    if not decoder.is_finished():
        raise ContentEncodingError("the stream is cut short")
    return out


def _unzstd(raw: bytes, limit: int) -> bytes:
    """`raw` as whole zstd frames, one after another, at most `limit` bytes;
    ContentEncodingError unless the last one ends the body."""
    out = b""
    rest = raw
    while rest:
        decoder = ZstdDecompressor()
        try:
            out += decoder.decompress(rest, limit + 1 - len(out))
            while not decoder.eof and not decoder.needs_input and len(out) <= limit:
                out += decoder.decompress(b"", limit + 1 - len(out))
        except Exception:  # zstd's error for bytes that are not a frame
            raise ContentEncodingError("not a valid stream") from None
        if len(out) > limit:
            raise _TooLarge
        if not decoder.eof:
            raise ContentEncodingError("the stream is cut short")
        rest = decoder.unused_data
    return out


def _decoded(raw: bytes, coding: str, limit: int) -> bytes:
    if coding == "gzip":
        return _inflated(raw, 16 + zlib.MAX_WBITS, limit)
    if coding == "deflate":
        # as aiohttp: a body without the zlib header (CM, the low nibble, is not 8) is read as
        # raw deflate, which some clients send as "deflate"
        wbits = zlib.MAX_WBITS if raw[0] & 0xF == 8 else -zlib.MAX_WBITS
        return _inflated(raw, wbits, limit)
    return _unbrotli(raw, limit) if coding == "br" else _unzstd(raw, limit)


async def decode_body(request: web.BaseRequest, raw: bytes, limit: int) -> bytes:
    """`raw`, `request`'s body as sent, decoded from its `Content-Encoding`.

    Raises `web.HTTPRequestEntityTooLarge` when it decodes to more than `limit` bytes, and
    `RequestPayloadError` (from a `ContentEncodingError`) when it is not whole in its coding.
    A body a server of aiohttp's own defaults decoded already (no `RouterRunner`: a test's) is
    returned as it is."""
    codings = request.headers.getall(hdrs.CONTENT_ENCODING, ())
    if not raw or len(codings) != 1 or request.content.total_compressed_bytes is not None:
        # no body, none encoded (two codings are the listener's 415), or decoded already
        return raw
    coding = codings[0].strip().lower()
    if coding not in DECODED_CODINGS:
        return raw  # identity ("" or the word): the listener refused any other
    try:
        # off the loop: up to `limit` bytes of output (zlib, brotli, zstd release the GIL)
        return await asyncio.to_thread(_decoded, raw, coding, limit)
    except _TooLarge:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=limit + 1) from None
    except ContentEncodingError as exc:
        raise RequestPayloadError(f"cannot decode content-encoding: {coding}") from exc


async def read_body(request: web.Request) -> bytes:
    """`request`'s body, decoded (`decode_body`), bounded by `client_max_size`."""
    if hdrs.CONTENT_ENCODING not in request.headers:
        # the common case, at the cost it had: aiohttp keeps what `read` read for a second read
        return await request.read()
    decoded = request.get(_DECODED)
    if decoded is None:
        # aiohttp bounds what was sent by client_max_size, and the decode bounds what it makes
        decoded = await decode_body(request, await request.read(), request.client_max_size)
        request[_DECODED] = decoded
    return decoded
