"""A proxied request off the wire: its body, the trusted salt header, parsed within the limits.

The proxy and the `/admin/route` dry run both read requests here, so a dry run never says yes
to a request the proxy would refuse. The salt header is a gateway's statement of the tenant: it
must come once (two values would leave the namespace to whichever one a hop reads first), be
UTF-8 and fit `limits.max_salt_bytes`; its value is a secret, so errors name the header only.
The request as parsed is kept on it (`PARSED`) for the steps after routing that answer what the
client asked: whether its answer is a stream, whether it is a batch (`router.http.answer_relay`).
A long body is parsed and tokenized on the tokenizer's threads (`parsed_off_loop`), here and for
the KV query API (`router.http.kv_query`) alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from aiohttp import web

from router.config import RouterConfig
from router.errors import RequestError
from router.http.request_body import read_body
from router.prompt.dp_rank import DP_RANK_HEADER
from router.prompt.request import (
    Endpoint,
    ParsedRequest,
    check_salt_size,
    detect_endpoint,
    parse_body,
    parse_request,
)
from router.prompt.tokenizer import PromptTokenizer

__all__ = ["PARSED", "header_salt", "parsed_off_loop", "read_request"]

_T = TypeVar("_T")

# the request as `read_request` parsed it
PARSED = web.RequestKey("kvroute_parsed", ParsedRequest)


def header_salt(request: web.Request, config: RouterConfig) -> str | None:
    """The configured salt header's value, None without one; RequestError names the header."""
    name = config.salt_header
    if not name:
        return None
    values = request.headers.getall(name, [])
    if not values:
        return None
    if len(values) > 1:
        raise RequestError(f"the {name} header is given {len(values)} times; give it once")
    value = values[0]
    try:
        # aiohttp keeps bytes that are not UTF-8 as lone surrogates, which cannot be encoded
        value.encode()
    except UnicodeEncodeError:
        raise RequestError(f"the {name} header is not valid UTF-8") from None
    check_salt_size(value, f"the {name} header", config.limits)
    return value


async def read_request(
    request: web.Request,
    endpoint: Endpoint | None,
    config: RouterConfig,
    tokenizer: PromptTokenizer,
) -> ParsedRequest:
    """Read and validate one request for `endpoint` (None: inferred from the body)."""
    salt = header_salt(request, config)
    raw = await read_body(request)
    if endpoint is None:
        endpoint = detect_endpoint(parse_body(raw, config.limits))
    parse = partial(
        parse_request,
        endpoint,
        raw,
        tokenizer,
        header_salt=salt,
        header_dp_rank=request.headers.get(DP_RANK_HEADER),
        limits=config.limits,
    )
    parsed = await parsed_off_loop(tokenizer, len(raw), parse)
    request[PARSED] = parsed
    return parsed


async def parsed_off_loop(
    tokenizer: PromptTokenizer, body_bytes: int, parse: Callable[[], _T]
) -> _T:
    """`parse()` (a body's decode and tokenizing) on the tokenizer's offload threads when a
    body of `body_bytes` is long enough for them (`router.prompt.offload`), else right here."""
    offload = tokenizer.offload
    if offload is not None and offload.wants(body_bytes):
        # a long prompt: its encode (GIL released) leaves the loop free for other requests
        return await asyncio.wrap_future(offload.submit(parse))
    return parse()
