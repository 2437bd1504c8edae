"""Parsing a proxied request into what routing needs: namespace, tokens, streaming flag.

A chat request is also read for what the engine passes to the chat template besides the messages
(tools, tool_choice, chat_template_kwargs, reasoning_effort, documents, ...), the way the
configured `tokenizer.chat_engine` reads them: its convention in `router.prompt.conventions`,
which also says which pre-tokenized prompt the engine takes instead of the messages (SGLang's
`input_ids`, vLLM's `kv_transfer_params.prompt_token_ids`). Completions carry no such field for
either engine (vLLM 0.33 reuses forwarded ids on chat requests only).

The body is forwarded to the worker byte for byte unless a trusted salt header overrides the
salt, in which case the body's `cache_salt` is rewritten so the worker caches the request in the
namespace the router routed it in. `cache_salt` is validated the way SGLang validates it (a
string, `""` meaning none, one per item of a batch, `/generate`'s or a completion's), so a
malformed request is a 400 naming the field here instead of a surprise on the worker. vLLM
refuses `""` (and salts SGLang takes: long ones, `/`, `@`): its own 400 names the field, and
is passed back. A data-parallel rank the client names (`router.prompt.dp_rank`) is read here
too: the router then routes to that rank.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from indexer.namespace import names_no_adapter
from indexer.protocol.tokens import ChatTemplateError
from router.config import LimitsConfig
from router.errors import RequestError
from router.prompt.conventions import SGLANG_CHAT, chat_options, check_chat_fields
from router.prompt.dp_rank import requested_rank
from router.prompt.nesting import nests_deeper
from router.prompt.output_limit import (
    chat_output_limit,
    completion_output_limit,
    generate_output_limit,
)
from router.prompt.reuse_limit import (
    chat_reuse_limit,
    completion_reuse_limit,
    generate_reuse_limit,
)
from router.prompt.tokenizer import PromptTokenizer

__all__ = [
    "Endpoint",
    "KeyedItem",
    "ParsedRequest",
    "TokenId",
    "chat_tokens",
    "check_adapter_name",
    "check_salt_size",
    "detect_endpoint",
    "parse_body",
    "parse_request",
]


# a token id as a body may give one: no engine's vocabulary has a negative id or one past 32 bits
# (the query API's `token_ids` are held to the same, `router.http.kv_query`)
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class Endpoint(enum.StrEnum):
    """The proxied generation endpoints (value = path on router and worker)."""

    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class ParsedRequest(msgspec.Struct, frozen=True):
    """One request, ready to route: never log `salt` (a tenant secret)."""

    endpoint: Endpoint
    body: bytes  # what is forwarded
    salt: str | None
    model: str
    lora: str | None
    tokens: list[int]
    stream: bool
    # the caller's SGLang extra_key (never logged either): part of the worker's cache key that
    # no KV event shows, so such a request gets no event-based hit (`indexer.namespace`)
    extra_key: str | None = None
    # the data-parallel rank the client named (body field or header), honoured by routing
    dp_rank: int | None = None
    # the output tokens it may generate, as the engine budgets them (None: not known), for
    # the pages its run takes beside the cached prefixes (`router.prompt.output_limit`)
    output_tokens: int | None = None
    # the most prompt tokens the engine may reuse when prompt logprobs cap it (None: no cap
    # but the last token's; `router.prompt.reuse_limit`)
    reuse_limit: int | None = None
    # the batch's other items that carry an extra_key: what each stores is shown by events as
    # plain pages of its salt, so each shadows its own prompt (`indexer.shadowed`)
    keyed: tuple[KeyedItem, ...] = ()
    # a list of more than one prompt (a batched `/generate`, OpenAI's `prompt` list; routed by
    # its first): its answer's usage is every item's, no one prediction's
    # (`router.http.answer_relay` reads none of it); a one-item list's is its item's
    many_prompts: bool = False

    @property
    def stores_its_tokens(self) -> bool:
        """Whether the engine's pages of this request may be marked pending under its tokens:
        not when it can reuse nothing the router predicts (media, a cut prompt, embeddings,
        a session's history, another special-tokens setting: the worker's pages are not these
        tokens'; vLLM's `truncate_prompt_tokens` keeps the prompt's end)."""
        return self.reuse_limit != 0


class KeyedItem(msgspec.Struct, frozen=True):
    """One item of a batch (not the first) sent with an extra_key: never log its salt."""

    tokens: list[int]
    salt: str | None
    lora: str | None  # its own `lora_path` (None: "", null, or none given: the base model)
    extra_key: str


_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_LIMITS = LimitsConfig()


def parse_body(raw: bytes, limits: LimitsConfig = _LIMITS) -> dict[str, Any]:
    """The JSON object of a request body, or a RequestError saying what is wrong.

    Nesting is bounded by `limits.max_json_depth` (see `router.prompt.nesting` for why).
    """
    too_deep = RequestError(
        f"request body nests JSON deeper than limits.max_json_depth ({limits.max_json_depth})"
    )
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(json_error(raw, exc)) from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if nests_deeper(raw, limits.max_json_depth):
        raise too_deep
    return body


def json_error(raw: bytes, exc: msgspec.DecodeError) -> str:
    """What is wrong with a body msgspec could not decode as JSON, said so a client finds it
    (msgspec calls an empty body, and a whole one with a lone surrogate, "truncated")."""
    if not raw.strip():
        return "request body is empty: send a JSON object"
    if _lone_surrogate(raw, exc):
        return (
            "request body is not valid JSON: a \\u escape is a lone UTF-16 surrogate "
            "(\\ud800-\\udfff without its pair), which is no character"
        )
    return f"request body is not valid JSON: {exc}"


def _lone_surrogate(raw: bytes, exc: msgspec.DecodeError) -> bool:
    """Whether msgspec's "truncated" is a whole body with a lone high surrogate escape
    ("\\ud800" before a quote: msgspec reads on for its pair and calls the body cut short).
    Python's json takes lone surrogates: a body it reads whole was not truncated. Only on
    this error's path, never for a good body."""
    if "truncated" not in str(exc) or b"\\u" not in raw:
        return False
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def detect_endpoint(body: Mapping[str, Any]) -> Endpoint:
    """The endpoint a dry-run body was written for: messages, prompt, or text/input_ids."""
    if "messages" in body:
        return Endpoint.CHAT
    if "prompt" in body:
        return Endpoint.COMPLETIONS
    if "text" in body or "input_ids" in body:
        return Endpoint.GENERATE
    raise RequestError("cannot tell the endpoint: expected messages, prompt, text or input_ids")


def check_salt_size(salt: str, what: str, limits: LimitsConfig) -> None:
    """RequestError when `salt` is over `limits.max_salt_bytes`; names `what`, never the salt.

    Salts are short tenant ids in practice; bounding them bounds what every request can make
    the router hold (pending marks, namespace keys) no matter how many tenants are invented.
    """
    if len(salt.encode()) > limits.max_salt_bytes:
        raise RequestError(
            f"{what} is longer than limits.max_salt_bytes ({limits.max_salt_bytes} bytes)"
        )


def _salt(
    value: object, limits: LimitsConfig, *, batched: bool, field: str = "cache_salt"
) -> str | None:
    """A cache-key string as the workers normalize it (`cache_salt`, `extra_key`), bounded."""
    if value is None:
        return None
    if isinstance(value, str):
        check_salt_size(value, field, limits)
        return value or None
    if batched and isinstance(value, list):
        # one per item; the batch is routed as a whole by its first item
        for i, item in enumerate(value):
            if item is not None and not isinstance(item, str):
                raise RequestError(f"{field}[{i}] must be a string")
            if item is not None:
                check_salt_size(item, f"{field}[{i}]", limits)
        first = value[0] if value else None
        return first or None
    raise RequestError(f"{field} must be a string")


def check_adapter_name(name: str, field: str, limits: LimitsConfig) -> None:
    """RequestError naming `field` (never the name) when `name` is no adapter an engine loads.

    A NUL: the router's own name for pages an event names by adapter id alone
    (`indexer.namespace.anonymous_lora`) would match that adapter's pages (a false hit, and a
    probe of its cache). Longer than `limits.max_adapter_name_bytes`: a name is at most a path
    (SGLang's `--lora-paths PATH` names the adapter by its path, vLLM's filesystem resolver by
    its directory), and Linux opens none past PATH_MAX (4096 bytes), the default. Unbounded, a
    client's 2 MB name became a namespace (a reference worker caches any name), held by the
    index and listed by `/admin/namespaces` and the dashboard.
    """
    if names_no_adapter(name):
        raise RequestError(f"{field} holds a NUL character: no LoRA adapter is named so")
    if len(name.encode()) > limits.max_adapter_name_bytes:
        raise RequestError(
            f"{field} names a LoRA adapter longer than limits.max_adapter_name_bytes "
            f"({limits.max_adapter_name_bytes} bytes)"
        )


def _lora(value: object, limits: LimitsConfig) -> str | None:
    """The LoRA adapter `lora_path` names, as SGLang reads it: a string, or one per item of a
    batch (the batch is routed by its first item); "" and null mean the base model."""
    if value is None or isinstance(value, str):
        if value:
            check_adapter_name(value, "lora_path", limits)
        return value or None
    if isinstance(value, list):
        for i, item in enumerate(value):
            if item is not None and not isinstance(item, str):
                raise RequestError(f"lora_path[{i}] must be a string")
            if item:
                check_adapter_name(item, f"lora_path[{i}]", limits)
        return (value[0] or None) if value else None
    raise RequestError("lora_path must be a string or a list of strings")


def _ids(value: object, field: str) -> list[int]:
    """Token ids as a list of ints (bools and floats are not) from 0 to 2**32 - 1, checked in
    one C-level pass: a Python loop over an 8k-token prompt cost more than routing it. Before,
    any int went (a negative id to the worker; the query API refused them)."""
    if not isinstance(value, list):
        raise RequestError(f"{field} must be a list of integers")
    try:
        return msgspec.convert(value, list[TokenId])
    except msgspec.ValidationError as exc:  # names the item: "got `bool` - at `$[3]`"
        raise RequestError(f"{field} must be a list of integers ({exc})") from None


def _first(value: list[Any], field: str) -> object:
    if not value:
        raise RequestError(f"{field} must not be empty")
    return value[0]


def _generate_tokens(body: Mapping[str, Any], tok: PromptTokenizer) -> tuple[list[int], bool]:
    if (input_ids := body.get("input_ids")) is not None:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            first_ids = _ids(input_ids[0], "input_ids[0]")
            _check_later_items(input_ids, "input_ids", tok)  # a bad first is said first
            return first_ids, True
        return _ids(input_ids, "input_ids"), False
    text = body.get("text")
    if isinstance(text, str):
        return tok.text(text), False
    if isinstance(text, list):
        first = _first(text, "text")
        if not isinstance(first, str):
            raise RequestError("text[0] must be a string")
        return tok.text(first), True
    raise RequestError("text (a string) or input_ids (a list of integers) is required")


def _completion_tokens(body: Mapping[str, Any], tok: PromptTokenizer) -> list[int]:
    prompt = body.get("prompt")
    if (prompt is None or prompt == "") and body.get("prompt_embeds"):
        # vLLM's prompt embeddings (`--enable-prompt-embeds`, 0.33 `CompletionRequest`) stand in
        # for the prompt: no token ids to key, so nothing is predicted (`completion_reuse_limit`)
        return []
    if isinstance(prompt, str):
        return tok.text(prompt)
    if isinstance(prompt, list):
        first = _first(prompt, "prompt")
        if isinstance(first, str):
            _check_later_items(prompt, "prompt", tok)
            return tok.text(first)
        if isinstance(first, list):
            first_ids = _ids(first, "prompt[0]")
            _check_later_items(prompt, "prompt", tok)  # a bad first is said first
            return first_ids
        return _ids(prompt, "prompt")
    raise RequestError("prompt must be a string, a list of strings or a list of token ids")


def chat_tokens(body: Mapping[str, Any], tok: PromptTokenizer) -> list[int]:
    """The prompt ids of a chat request body: its messages and the fields the engine renders
    with them (`router.prompt.conventions`), or the ids it carries instead; RequestError when
    they are bad. The proxy's, and the KV query API's for its `messages`."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list")
    options = None
    if tok.template is not None:
        options = chat_options(body, tok.template.convention)
    else:
        # kvroute's own template renders the messages alone: only the fields' shape is checked
        check_chat_fields(body)
    # the engine may take ids the request carries as the prompt and skip the template (SGLang's
    # `input_ids`; vLLM's decode-side `kv_transfer_params.prompt_token_ids`); the fields are
    # checked above all the same, as the engine checks them. kvroute's own template, like the
    # reference workers, takes `input_ids`.
    convention = SGLANG_CHAT if tok.template is None else tok.template.convention
    carried = convention.prompt_ids(body)
    if carried is not None:
        return _ids(*carried)
    try:
        return tok.chat(messages, options)
    except ChatTemplateError as exc:
        raise RequestError(str(exc)) from exc


def parse_request(
    endpoint: Endpoint,
    raw: bytes,
    tokenizer: PromptTokenizer,
    *,
    header_salt: str | None = None,
    header_dp_rank: str | None = None,
    limits: LimitsConfig = _LIMITS,
) -> ParsedRequest:
    """Validate `raw` for `endpoint`; `header_salt` (trusted header) overrides the body's salt,
    `header_dp_rank` (the `X-Data-Parallel-Rank` header) the body's rank on the OpenAI routes."""
    body = parse_body(raw, limits)
    model = _model(body.get("model"))
    batched = False
    reusable = None
    if endpoint is Endpoint.GENERATE:
        tokens, batched = _generate_tokens(body, tokenizer)
        output_tokens = generate_output_limit(body)
        reusable = generate_reuse_limit(body)
    elif endpoint is Endpoint.COMPLETIONS:
        tokens = _completion_tokens(body, tokenizer)
        # a list of prompts (strings or token-id lists) is a batch: SGLang takes its salts
        # and extra_keys one per prompt too (`CompletionRequest`, 0.5.23)
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and isinstance(prompt[0], str | list)
        output_tokens = completion_output_limit(body)
        reusable = completion_reuse_limit(body, len(tokens))
    else:
        tokens = chat_tokens(body, tokenizer)
        output_tokens = chat_output_limit(body)
        reusable = chat_reuse_limit(body, len(tokens))
    if batched:
        _check_batch_lists(body, endpoint, header_salt)
    forwarded = raw
    if header_salt is None:
        salt = _salt(body.get("cache_salt"), limits, batched=batched)
    else:  # the body's own, whatever it is, is replaced: not the client's to get right
        salt = header_salt or None
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
        forwarded = _encoder.encode(body)
    stream = body.get("stream")
    keyed: tuple[KeyedItem, ...] = ()
    many = False
    if batched:
        keyed = _keyed_items(body, endpoint, tokenizer, limits, header_salt)
        many = _batch_size(body, endpoint) > 1
    return ParsedRequest(
        endpoint=endpoint,
        body=forwarded,
        salt=salt,
        model=model,
        lora=_lora(body.get("lora_path"), limits),
        tokens=tokens,
        stream=stream is True,
        extra_key=_salt(body.get("extra_key"), limits, batched=batched, field="extra_key"),
        # SGLang's /generate reads no rank header
        dp_rank=requested_rank(body, None if endpoint is Endpoint.GENERATE else header_dp_rank),
        output_tokens=output_tokens,
        reuse_limit=reusable,
        keyed=keyed,
        many_prompts=many,
    )


def _batch_size(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """The prompts of a batched request (`batched`: its list is checked already)."""
    if endpoint is not Endpoint.GENERATE:
        return len(body["prompt"])
    input_ids = body.get("input_ids")
    return len(input_ids if isinstance(input_ids, list) else body["text"])


def _model(value: object) -> str:
    """The model a request names ("": none, null included, as vLLM reads it). Another type is
    a 400: the engines refuse it (SGLang's and vLLM's `model: str`), and a pool's workers
    cannot be told from it. Before, it read as no model: a 404 "the request names no model"
    in a fleet of several, forwarded to the engine to refuse in a fleet of one."""
    if value is None or isinstance(value, str):
        return value or ""
    raise RequestError(f"model must be a string, not {_json_kind(value)}")


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, as a client wrote it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _check_batch_lists(
    body: Mapping[str, Any], endpoint: Endpoint, header_salt: str | None
) -> None:
    """A batch (`/generate`'s, or `/v1/completions`' list of prompts) gives `cache_salt` and
    `extra_key` once, or one per prompt: SGLang (0.5.23, `GenerateReqInput._normalize_cache_salt`,
    which a completion's lists reach as they are) refuses a list of another length, which the
    router would route by its first item all the same. Before, a completion's was not checked:
    routed, with a prediction, for the worker to refuse."""
    if endpoint is Endpoint.COMPLETIONS:
        prompts = body.get("prompt")
    else:
        prompts = body.get("input_ids")
        if prompts is None:
            prompts = body.get("text")
    if not isinstance(prompts, list):
        return
    for field in ("extra_key",) if header_salt is not None else ("cache_salt", "extra_key"):
        value = body.get(field)
        if isinstance(value, list) and len(value) != len(prompts):
            raise RequestError(
                f"{field} has {len(value)} items for a batch of {len(prompts)} prompts: give "
                "one per prompt, or one string for all"
            )


def _item(value: object, i: int) -> object:
    """Item `i`'s value of a field given once for the batch or once per item."""
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value


def _batch_item(prompts: list[Any], field: str, i: int, tokenizer: PromptTokenizer) -> list[int]:
    """The tokens of item `i` of the batch `field` holds, read as the engine reads its list: a
    `text` item is a string, an `input_ids` one token ids, a `prompt` one either. Before, an
    item that was no string was read as ids, and a bad one said "[1] must be a list of
    integers": no field named, and wrong for text."""
    prompt = prompts[i]
    if isinstance(prompt, str) and field != "input_ids":
        return tokenizer.text(prompt)
    if field == "text":
        raise RequestError(f"text[{i}] must be a string")
    if field == "prompt" and not isinstance(prompt, list):
        raise RequestError(f"prompt[{i}] must be a string or a list of token ids")
    return _ids(prompt, f"{field}[{i}]")


def _check_later_items(prompts: list[Any], field: str, tokenizer: PromptTokenizer) -> None:
    """Hold a batch's items after the first to what the first is held to (token ids in range,
    `_batch_item`), without tokenizing a text item: before, only the first was read (and those
    with an extra_key), and a later item's id past 32 bits reached the worker (the reference
    worker answered it 200)."""
    for i in range(1, len(prompts)):
        if not isinstance(prompts[i], str) or field == "input_ids":
            _batch_item(prompts, field, i, tokenizer)


def _keyed_items(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    tokenizer: PromptTokenizer,
    limits: LimitsConfig,
    header_salt: str | None,
) -> tuple[KeyedItem, ...]:
    """The items after the first of a batch that carry an extra_key, with their tokens (made
    only for those: a batch without extra_keys costs nothing more)."""
    extra = body.get("extra_key")
    if extra is None:
        return ()
    field = "prompt"
    if endpoint is Endpoint.GENERATE:
        field = "input_ids" if body.get("input_ids") is not None else "text"
    prompts = body.get(field)
    if not isinstance(prompts, list):
        return ()
    out: list[KeyedItem] = []
    for i in range(1, len(prompts)):
        key = _item(extra, i)
        if not isinstance(key, str) or not key:
            continue
        check_salt_size(key, f"extra_key[{i}]", limits)
        tokens = _batch_item(prompts, field, i, tokenizer)
        salt = _item(body.get("cache_salt"), i) if header_salt is None else header_salt
        lora = _item(body.get("lora_path"), i)
        out.append(
            KeyedItem(
                tokens,
                salt if isinstance(salt, str) and salt else None,
                lora if isinstance(lora, str) and lora else None,
                key,
            )
        )
    return tuple(out)
