"""What the two legs of a vLLM prefill/decode pair get (`KV_TRANSFER_PARAMS`, its NIXL proxy
protocol), one after the other.

The request goes to the prefill first (`prefill_body`) with `max_tokens` (and
`max_completion_tokens`) 1, `stream` false, no `stream_options` and `kv_transfer_params` asking
for a remote decode; the `kv_transfer_params` of its answer go with the original request to the
decode (`decode_body`), both under one `X-Request-Id` (`pair_request_id`): vLLM pairs the legs
by it. Only the OpenAI routes are served so, not `/generate`.
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from indexer.engines import VLLM_PREFILL_KV_TRANSFER_PARAMS
from router.errors import RequestError
from router.http.observe import client_request_id, observation
from router.http.pair_failure import PrefillFailed
from router.http.pair_hooks import first_answer
from router.prompt.dp_rank import with_body_members
from router.prompt.request import Endpoint, ParsedRequest

__all__ = ["decode_body", "pair_request_id", "prefill_body"]

_json = msgspec.json.Encoder()


def prefill_body(endpoint: Endpoint, parsed: ParsedRequest) -> bytes:
    """The request as the prefill leg gets it: one token, not streamed, a remote decode asked
    for (before it is told its dp rank)."""
    if endpoint is Endpoint.GENERATE:
        raise RequestError("vLLM prefill/decode pairs serve the OpenAI routes, not /generate")
    body = msgspec.json.decode(parsed.body)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body.pop("stream_options", None)
    body.update(stream=False, max_tokens=1, kv_transfer_params=VLLM_PREFILL_KV_TRANSFER_PARAMS)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return _json.encode(body)


def pair_request_id(request: web.Request) -> str:
    """The `X-Request-Id` both legs carry, by which vLLM pairs them."""
    # the request's own (the client's well-formed one, else the router's), as the docs promise
    # for any hop; with nothing observed the client's as it is (not one its Connection names:
    # hop-by-hop), made up only when nothing names it
    obs = observation(request)
    return (
        obs.request_id
        if obs is not None
        else client_request_id(request.headers) or uuid.uuid4().hex
    )


def decode_body(parsed: ParsedRequest, payload: bytes) -> bytes:
    """The request as the decode leg gets it: the client's, with the `kv_transfer_params` of
    the prefill's answer (`payload`; none there is the prefill's failure)."""
    answer = first_answer(payload)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise PrefillFailed("its answer carries no kv_transfer_params", hard=False)
    return with_body_members(parsed.body, {"kv_transfer_params": params})
