"""`POST /v1/kv/query`: kvroute's KV index as a service for other gateways.

An Envoy / Gateway API endpoint picker, or another router, sends a prompt (token ids, text, or
chat messages with the fields a chat renders beside them: tools, chat_template_kwargs, ...)
with the fields of its namespace (model, `lora` for its lora_path, cache_salt) and gets, per
(worker, dp rank) of that model, the leading tokens held and in which storage tier, the stream's
state, and the router's own view of load and score. The same planner as the proxy's answers
(`Planner.plan`, read-only), so the numbers are those the router would route by; nothing is
marked pending and nothing is routed. A model served by prefill/decode pairs is answered with
its prefill workers, where the pair's prompt is computed and its prefix reused.

`POST /v1/kv/routed` is the one thing a gateway tells the index: it sent a request with an
SGLang `extra_key` to a worker. Such a request's pages reach the index as plain pages of its
salt (the engine publishes no extra_key), so, as for the requests the router routes itself
(`Planner.commit`), plain requests of the same prompt stop being predicted them there (a
shadow, shared with the other replicas). A gateway's other requests need no word: their pages
show in the events.

Version 1 (the path's `v1`, the answer's `"version": 1`): fields are only ever added. The API
has its own bearer token (`[query] token` or `$KVROUTE_QUERY_TOKEN`), so a gateway can ask the
index without the admin API's power. docs/operations.md has the request and answer with examples.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from indexer.engines import PdRole
from indexer.namespace import Namespace
from router.config import LimitsConfig, RouterConfig
from router.errors import AuthError, NoWorkerError, RequestError, UnknownModelError
from router.http.bearer import bears_token, is_loopback
from router.http.intake import header_salt, parsed_off_loop
from router.http.keys import CONFIG, PLANNER, RELOADER, TOKENIZER
from router.http.listener import AUTH_GATES, AuthGate
from router.http.request_body import read_body
from router.prompt.conventions import CHAT_REQUEST_FIELDS
from router.prompt.request import (
    Endpoint,
    ParsedRequest,
    TokenId,
    chat_tokens,
    check_adapter_name,
    check_salt_size,
    parse_body,
)
from router.prompt.reuse_limit import chat_reuse_limit
from router.prompt.tokenizer import PromptTokenizer
from router.routing.policy import Candidate

__all__ = [
    "KV_QUERY_PATH",
    "KV_ROUTED_PATH",
    "VERSION",
    "KvQuery",
    "KvRouted",
    "add_kv_query_route",
]

KV_QUERY_PATH = "/v1/kv/query"
KV_ROUTED_PATH = "/v1/kv/routed"
VERSION = 1
_json = msgspec.json.Encoder()
Q = TypeVar("Q", bound="KvQuery")


class KvQuery(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The request body: exactly one of token_ids, text, messages."""

    # any name the fleet serves ("" or null: none, as a proxied request's null model reads; in
    # a one-model fleet); "base:adapter" too
    model: str | None = None
    # a request's `lora_path`, read as the proxy reads it for the model's pool: an adapter of
    # SGLang workers; nothing to vLLM workers, which ignore it and serve the base model (their
    # adapter is named by `model`). The answer's `lora` is the adapter whose pages it counted
    lora: str | None = None
    cache_salt: str | None = None  # "" or null: the unsalted namespace
    # SGLang's extra_key ("" or null: none): no KV event shows it, so nothing is predicted
    # from events (`unindexed`), only this router's pending marks of that key
    extra_key: str | None = None
    token_ids: list[TokenId] | None = None  # the prompt as the engine tokenizes it (exact)
    text: str | None = None  # a completion prompt, tokenized by the router's tokenizer
    messages: list[dict[str, Any]] | None = None  # a chat, through the router's chat template
    # With `messages` only: what a chat request adds to them and the engine renders into the
    # prompt (`router.prompt.conventions.CHAT_REQUEST_FIELDS`), read and checked as the proxy
    # reads them for `tokenizer.chat_engine` (so a bad one is the proxy's 400). Before, they
    # were unknown fields: a chat with tools was matched by a prompt without them
    tools: Any = None  # list of tool objects
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}
    chat_template_kwargs: Any = None  # object: template variables
    reasoning_effort: Any = None  # a tier (SGLang: or a number)
    reasoning: Any = None  # SGLang's object: effort, enabled
    documents: Any = None  # list of objects (vLLM)
    add_generation_prompt: Any = None  # bool (vLLM)
    continue_final_message: Any = None  # bool

    def chat_body(self) -> dict[str, Any]:
        """The chat request these `messages` and chat fields stand for, as the proxy reads it."""
        chat = {name: getattr(self, name) for name in CHAT_REQUEST_FIELDS}
        return {"messages": self.messages, **{k: v for k, v in chat.items() if v is not None}}


class KvRouted(KvQuery, forbid_unknown_fields=True, kw_only=True):
    """`/v1/kv/routed`: the request a gateway sent, and where (a query's fields, and these)."""

    worker: str  # the worker's id, as the query's answer names it
    dp_rank: int | None = None  # the rank it was told to use (null: the engine picks)


def _candidate_row(c: Candidate) -> dict[str, Any]:
    return {
        "worker": c.worker,
        "url": c.url,
        "dp_rank": c.dp_rank,
        "matched_tokens": c.matched_tokens,
        "matched_blocks": c.matched_blocks,
        "pending_tokens": c.pending_tokens,
        # what the proxy would tell a client sent there (x-kvroute-matched-tokens plus
        # x-kvroute-pending-tokens): the two above, less what the admission forecast expects
        # the worker to evict before it admits the request. Without it a gateway read the raw
        # match as the hit (QA: 592 tokens, the router predicting 0 and the worker reusing 0)
        "predicted_tokens": c.predicted_tokens,
        "tiers": c.by_medium,
        "stream_state": c.stream_state,
        "routable": c.healthy,
        "status": c.status,
        "queued_prefill_tokens": c.queued_prefill_tokens,
        "running": c.running,
        "score": c.score,
    }


def _tokens(query: KvQuery, tokenizer: PromptTokenizer) -> list[int]:
    """The query's prompt as token ids, one token at least (RequestError: none, or a bad one)."""
    given = [name for name in ("token_ids", "text", "messages") if getattr(query, name) is not None]
    if len(given) != 1:
        raise RequestError(
            "give exactly one of token_ids, text or messages"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if query.messages is not None:
        # the proxy's own rendering of a chat body
        tokens = chat_tokens(query.chat_body(), tokenizer)
        return _not_empty(tokens, "messages", "the chat template renders them to no tokens")
    chat = [name for name in CHAT_REQUEST_FIELDS if getattr(query, name) is not None]
    if chat:
        raise RequestError(
            f"{', '.join(chat)} go with messages only (rendered into a chat's prompt)"
        )
    if query.token_ids is not None:
        return _not_empty(query.token_ids, "token_ids", "an empty list")
    assert query.text is not None
    said = "an empty string" if not query.text else "the tokenizer gives it no tokens"
    return _not_empty(tokenizer.text(query.text), "text", said)


def _not_empty(tokens: list[int], field: str, why: str) -> list[int]:
    """`tokens`, or the 400 of a prompt of none. Before, such a query was a 200 that every
    worker matched nothing of (a `/v1/kv/routed` a 200 too), where the worker refuses the
    request it stands for (the proxy forwards an empty prompt as it is, the engine's to judge:
    the reference workers' 400 "text must be a non-empty string"): a gateway took "nothing
    cached anywhere" for an answer about a request that does not run."""
    if not tokens:
        raise RequestError(
            f"{field} gives no prompt tokens ({why}): a query needs a prompt of at least one "
            "token, as a worker does"
        )
    return tokens


def _check_token(request: web.BaseRequest, config: RouterConfig) -> None:
    token = config.query_token()
    if not token:
        # read per request, as the token is: a reload that empties the token on a listener
        # others can reach must not open the index to them
        if is_loopback(config.listen.host):
            return
        raise AuthError(
            "KV query API: refused without query.token (or KVROUTE_QUERY_TOKEN) on a "
            "listener that is not loopback"
        )
    if not bears_token(request.headers, token):
        raise AuthError("KV query API: missing or wrong bearer token (the query token)")


def _decoded(
    raw: bytes, kind: type[Q], tokenizer: PromptTokenizer, limits: LimitsConfig
) -> tuple[Q, list[int]]:
    """The body decoded and bounded as the proxy's bodies are (`parse_body`: nesting within
    limits.max_json_depth), read as `kind`, and its prompt's tokens."""
    body = parse_body(raw or b"{}", limits)
    try:
        query = msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc)) from exc
    return query, _tokens(query, tokenizer)


async def _read(request: web.Request, kind: type[Q]) -> tuple[Q, list[int]]:
    """The body, checked against the query token, as `kind` and its prompt's tokens.

    A long body is decoded and tokenized on the tokenizer's threads, as the proxy's are
    (`parsed_off_loop`, `tokenizer.offload_min_bytes`): the loop keeps serving other requests.
    Before, it was done here on the loop: a 1.5 MB prompt with a Hugging Face tokenizer held
    every other request for ~0.7 s.
    """
    config: RouterConfig = request.app[CONFIG].current
    _check_token(request, config)
    raw = await read_body(request)
    tokenizer = request.app[TOKENIZER]
    decode = partial(_decoded, raw, kind, tokenizer, config.limits)
    return await parsed_off_loop(tokenizer, len(raw), decode)


async def _parsed(
    request: web.Request, query: KvQuery, tokens: list[int]
) -> tuple[ParsedRequest, Namespace]:
    """The query (its prompt's `tokens`) as a request to plan, and its namespace as the proxy
    would cache it."""
    config = request.app[CONFIG].current
    limits = config.limits
    # the trusted gateway's header overrides the body's salt, as on the proxy: the namespace
    # the request it asks about is cached in (before, ignored here: a gateway that salts by
    # the header got the unsalted namespace's hits for a salted request, false hits)
    by_header = header_salt(request, config)
    salt = (query.cache_salt if by_header is None else by_header) or None
    if salt is not None and by_header is None:
        check_salt_size(salt, "cache_salt", limits)
    extra_key = query.extra_key or None
    if extra_key is not None:
        check_salt_size(extra_key, "extra_key", limits)
    if query.lora:
        check_adapter_name(query.lora, "lora", limits)
    parsed = ParsedRequest(
        # as an OpenAI request: a `base:adapter` model names the adapter, as on the proxy
        # (`/generate` takes no model, so its namespace would drop the adapter)
        endpoint=Endpoint.COMPLETIONS,
        body=b"",
        salt=salt,
        model=query.model or "",
        # read by `request_namespace` as the proxy reads `lora_path`: on a pool of vLLM workers
        # it names no adapter, since the request it stands for would run on the base model
        # (read as the adapter's, gateways copying a client's lora_path got false hits)
        lora=query.lora or None,
        tokens=tokens,
        stream=False,
        extra_key=extra_key,
        # a chat with media parts: the engine's tokens are not these past the first one, so
        # nothing is predicted, as on the proxy (the other fields that cap reuse are no query
        # fields). Before, such a chat was predicted the hits of its text alone (false hits)
        reuse_limit=(
            None if query.messages is None else chat_reuse_limit(query.chat_body(), len(tokens))
        ),
    )
    planner = request.app[PLANNER]
    try:
        ns = planner.namespace(parsed, limits)  # UnknownModelError (404) as the proxy would
    except (UnknownModelError, NoWorkerError):
        # its model served by nobody for an instant of a change (a worker renamed): answered
        # once the change ends, as the proxy waits (it was a 404 listing no model)
        reloader = request.app.get(RELOADER)
        deadline = time.monotonic() + config.timeouts.request_s
        if reloader is None or not await reloader.fleet_change.waited(deadline):
            raise
        ns = planner.namespace(parsed, limits)
    return parsed, ns


async def kv_query(request: web.Request) -> web.Response:
    """POST /v1/kv/query: per (worker, dp rank), what of the prompt it holds."""
    parsed, ns = await _parsed(request, *await _read(request, KvQuery))
    planner = request.app[PLANNER]
    # a model served by prefill/decode pairs reuses a prefix on its prefill side: its prefill
    # workers are the rows, ranked as the pair's prefill side is (`/admin/route`'s `prefill`).
    # Before, every model was planned for `both` workers, which such a model has none of: an
    # empty answer whatever its prefill workers held
    role: PdRole = "prefill" if planner.pool.disaggregated(ns.model) else "both"
    plan = planner.plan(parsed, ns, role=role)
    best = plan.candidates[0] if plan.candidates and plan.candidates[0].healthy else None
    answer = {
        "version": VERSION,
        "model": ns.model,
        "lora": ns.lora,
        "namespace": plan.namespace,  # keyed fingerprint, as in the admin API
        "prompt_tokens": plan.prompt_tokens,
        "unindexed": plan.unindexed,
        "role": role,  # the role of the workers listed
        "best": None if best is None else {"worker": best.worker, "dp_rank": best.dp_rank},
        "workers": [_candidate_row(c) for c in plan.candidates],
    }
    return web.Response(body=_json.encode(answer), content_type="application/json")


async def kv_routed(request: web.Request) -> web.Response:
    """POST /v1/kv/routed: a gateway sent this request to (worker, rank) itself."""
    routed, tokens = await _read(request, KvRouted)
    parsed, ns = await _parsed(request, routed, tokens)
    planner = request.app[PLANNER]
    worker, rank = routed.worker, routed.dp_rank
    if not any(e.id == worker for e in planner.pool.serving(ns.model)):
        raise RequestError(f"no worker {worker!r} serves the model {ns.model!r}")
    streams = planner.indexer.stream_ids(worker)
    if rank is not None and streams and not planner.indexer.stream_ids(worker, rank):
        raise RequestError(f"worker {worker!r} has no dp rank {rank}")
    # the shadow the router makes for an extra_key request it routes itself (`Planner.commit`),
    # shared with the other replicas alike; nothing for a plain request
    planner.shadow(ns, parsed.tokens, worker, rank)
    answer = {
        "version": VERSION,
        "namespace": planner.fingerprint(ns),
        "worker": worker,
        "dp_rank": rank,
        # whether plain requests of this prompt are no longer predicted its pages there
        # (false: a plain request, whose pages its events show, or a worker without events)
        "shadowed": ns.extra_key is not None and bool(streams),
    }
    return web.Response(body=_json.encode(answer), content_type="application/json")


def _token_gate(app: web.Application) -> AuthGate:
    """The listener's check of the query token (`router.http.listener.AUTH_GATES`): ahead of
    its own refusals (an oversized body's 413 would name the router's limits to anyone)."""

    def gate(request: web.BaseRequest) -> AuthError | None:
        if request.path not in (KV_QUERY_PATH, KV_ROUTED_PATH):
            return None
        try:
            _check_token(request, app[CONFIG].current)
        except AuthError as exc:
            return exc
        return None

    return gate


def add_kv_query_route(app: web.Application) -> None:
    """Serve POST /v1/kv/query and /v1/kv/routed on `app` (the error middleware makes errors
    JSON); their token is checked before the listener's refusals too."""
    app.router.add_post(KV_QUERY_PATH, kv_query)
    app.router.add_post(KV_ROUTED_PATH, kv_routed)
    app[AUTH_GATES] = (*app.get(AUTH_GATES, ()), _token_gate(app))
