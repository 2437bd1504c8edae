"""Request normalization for the worker's HTTP API, as SGLang's `io_struct` does it.

Every body is checked completely before anything is queued, so a bad field is a clean 400
naming it. `cache_salt` and `extra_key` must be strings (the seed's fix: a list or a number
used to travel deep into the engine before failing); the empty string means none; a batched
`/generate` takes one value per item or one for all.

A request may name the data-parallel rank that serves it, as SGLang 0.5.23 reads it: the body's
`routed_dp_rank`, else its deprecated alias `data_parallel_rank` (`io_struct.GenerateReqInput`,
`openai/protocol.py`), on every route; on the OpenAI routes the `X-Data-Parallel-Rank` header
overrides the body (`serving_base.extract_routed_dp_rank_from_header`: `int()` of the value, a
400 when it is not an integer). The range is checked when the request is queued.

A prefill/decode request says where its KV goes or comes from in either engine's spelling
(`KvHandoff`): SGLang's `bootstrap_host`/`bootstrap_port`/`bootstrap_room` (a room per batch
item: a list, or one int that item i offsets by i, as `GenerateReqInput` normalizes it), or
vLLM's NIXL `kv_transfer_params` (`do_remote_decode` on the prefill side; `do_remote_prefill`
with `remote_host`/`remote_port`/`remote_request_id` on the decode side).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from indexer.protocol.tokens import ByteTokenizer, ChatTemplateError, render_chat
from workers.cache import Namespace
from workers.errors import RequestError

__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "DEFAULT_GENERATE_TOKENS",
    "DP_RANK_HEADER",
    "SGLANG_VERSION",
    "ApiRequest",
    "Generation",
    "KvHandoff",
    "dp_rank_from_header",
    "kv_handoffs",
    "normalize_key",
    "normalize_keys",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "parse_model_parameter",
    "splits_at_first_colon",
]

# SGLang's /generate default, and OpenAI's for completions.
DEFAULT_GENERATE_TOKENS = 128
DEFAULT_COMPLETION_TOKENS = 16
_TOKENIZER = ByteTokenizer()
# the SGLang whose rules the parsers follow unless told another (`WorkerConfig.version`)
SGLANG_VERSION = "0.5.23"
# SGLang's OpenAI routes read it case-insensitively (as every HTTP header)
DP_RANK_HEADER = "X-Data-Parallel-Rank"
# SGLang's body field and its deprecated alias, in precedence order
_DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


class KvHandoff(msgspec.Struct, frozen=True):
    """Where one request's KV is handed over: its name on the prefill's bootstrap server and,
    on the decode side, that server's address."""

    key: str  # "room-<bootstrap_room>" (SGLang) or "req-<remote_request_id>" (vLLM)
    spelling: Literal["sglang", "vllm"]
    host: str | None = None  # the prefill's bootstrap server, as the decode side is told it
    port: int | None = None
    # vLLM: the prefill side answers `kv_transfer_params` (True), the decode side reads them
    remote_decode: bool = False
    # SGLang: the room (a prefill with several DP ranks runs it on rank room % dp_size), and
    # the prefill's rank when the request says it (`disagg_prefill_dp_rank`)
    room: int | None = None
    prefill_dp_rank: int | None = None


class Generation(msgspec.Struct, frozen=True):
    """One prompt to run: its tokens, its cache namespace, how many tokens to produce."""

    input_ids: list[int]
    namespace: Namespace
    max_new_tokens: int
    dp_rank: int | None = None
    rid: str | None = None
    handoff: KvHandoff | None = None
    # set by `workers.disagg`: a prefill's pages stay locked after it (until the decode side
    # has them); a decode's prompt KV arrived by transfer (its prefill step computes nothing),
    # and the cache hit the prefill side had is what it reports
    hold_kv: bool = False
    kv_transferred: bool = False
    remote_cached_tokens: int | None = None
    # the most prompt tokens it may take from the cache when it asks for prompt logprobs
    # (SGLang's `logprob_start_len` cap); None: all but the last
    reuse_limit: int | None = None
    # the first prompt token it reports a logprob for (`/generate`'s `logprob_start_len` with
    # `return_logprob`); None: none of them (SGLang's -1, the default, scores the output only)
    logprob_start_len: int | None = None

    @property
    def reusable_tokens(self) -> int:
        """The most prompt tokens it may take from the cache: all but the last (its logits
        give the first output token), fewer when prompt logprobs are asked for
        (SGLang's `Req._compute_max_prefix_len`)."""
        reusable = len(self.input_ids) - 1
        return reusable if self.reuse_limit is None else min(reusable, self.reuse_limit)


class ApiRequest(msgspec.Struct, frozen=True):
    """A parsed HTTP request: its items (one unless batched) and how to answer."""

    items: list[Generation]
    batch: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    return_logprob: bool = False


def normalize_key(value: object, field: str) -> str | None:
    """A scalar cache_salt/extra_key: a string, the empty string meaning none."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{field} must be a string, got {type(value).__name__}")
    return value or None


def normalize_keys(value: object, field: str, count: int) -> list[str | None]:
    """Per-item values for a batch of `count`: one string for all, or a list of one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{field} has {len(value)} values for a batch of {count}")
        return [normalize_key(v, f"{field}[{i}]") for i, v in enumerate(value)]
    one = normalize_key(value, field)
    return [one] * count


def _body(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    return body


def _bool(body: Mapping[str, Any], field: str) -> bool:
    value = body.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{field} must be a boolean")
    return value


def _count(value: object, field: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"{field} must be a non-negative integer")
    return value


def _token_ids(value: object, field: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"{field} must be a non-empty list of token ids")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
            raise RequestError(f"{field} must hold non-negative integer token ids")
    return list(value)


def _text_ids(value: object, field: str) -> list[int]:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field} must be a non-empty string")
    return _TOKENIZER.encode(value)


def _dp_rank(body: Mapping[str, Any]) -> int | None:
    """The body's rank: `routed_dp_rank`, else `data_parallel_rank` (both checked, as SGLang's
    request model types both fields)."""
    ranks = []
    for field in _DP_RANK_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{field} must be an integer")
        ranks.append(value)
    routed, alias = ranks
    return routed if routed is not None else alias


def dp_rank_from_header(value: str | None, body_rank: int | None) -> int | None:
    """The rank of an OpenAI-route request: the header's when given (it overrides the body)."""
    if value is None:
        return body_rank
    try:
        return int(value)
    except ValueError:
        raise RequestError(
            f"Invalid {DP_RANK_HEADER} header: must be an integer, got {value!r}"
        ) from None


def _per_item(value: object, field: str, count: int, kind: type) -> list[Any]:
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise RequestError(f"{field} has {len(values)} values for a batch of {count}")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            raise RequestError(f"{field} must be a {kind.__name__} (or one per batch item)")
    return values


def _sglang_handoffs(body: Mapping[str, Any], count: int) -> list[KvHandoff | None] | None:
    room = body.get("bootstrap_room")
    if room is None:
        return None
    if isinstance(room, int) and not isinstance(room, bool):
        rooms: list[Any] = [room + i for i in range(count)]  # GenerateReqInput's offsets
    else:
        rooms = _per_item(room, "bootstrap_room", count, int)
    hosts = _per_item(body.get("bootstrap_host"), "bootstrap_host", count, str)
    ports = _per_item(body.get("bootstrap_port"), "bootstrap_port", count, int)
    told = body.get("disagg_prefill_dp_rank")
    if told is not None and (isinstance(told, bool) or not isinstance(told, int) or told < 0):
        raise RequestError("disagg_prefill_dp_rank must be a non-negative integer")
    out: list[KvHandoff | None] = []
    for r, host, port in zip(rooms, hosts, ports, strict=True):
        if r is None:
            out.append(None)
            continue
        if r < 0:
            raise RequestError("bootstrap_room must be a non-negative integer")
        if port is not None and not 0 < port < 65536:
            raise RequestError("bootstrap_port must be a port number")
        out.append(
            KvHandoff(
                key=f"room-{r}",
                spelling="sglang",
                host=host,
                port=port,
                room=r,
                prefill_dp_rank=told,
            )
        )
    return out


def _vllm_handoff(body: Mapping[str, Any]) -> KvHandoff | None:
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise RequestError("kv_transfer_params must be an object")
    if params.get("do_remote_decode") is True:
        # the prefill side names the handoff; the answer's kv_transfer_params carry the name
        return KvHandoff(key=f"req-{uuid.uuid4().hex}", spelling="vllm", remote_decode=True)
    if params.get("do_remote_prefill") is True:
        rid, host, port = (
            params.get(k) for k in ("remote_request_id", "remote_host", "remote_port")
        )
        if not isinstance(rid, str) or not rid:
            raise RequestError("kv_transfer_params.remote_request_id must be a string")
        if not isinstance(host, str) or not host:
            raise RequestError("kv_transfer_params.remote_host must be a string")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise RequestError("kv_transfer_params.remote_port must be a port number")
        return KvHandoff(key=f"req-{rid}", spelling="vllm", host=host, port=port)
    return None


def kv_handoffs(body: Mapping[str, Any], count: int) -> list[KvHandoff | None]:
    """Each item's handoff, in SGLang's spelling or vLLM's (None: not a PD request)."""
    sglang = _sglang_handoffs(body, count)
    if sglang is not None:
        return sglang
    if count == 1:
        return [_vllm_handoff(body)]
    if body.get("kv_transfer_params") is not None:
        raise RequestError("kv_transfer_params takes one prompt")
    return [None] * count


def _stream_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise RequestError("stream_options must be an object")
    return _bool(options, "include_usage")


def parse_generate(raw: object) -> ApiRequest:
    """SGLang's `POST /generate`: text or input_ids, single or batched."""
    body = _body(raw)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("exactly one of text and input_ids is required")
    prompts: list[list[int]]
    if text is not None:
        batch = isinstance(text, list)
        texts = text if isinstance(text, list) else [text]
        prompts = [_text_ids(t, "text") for t in texts]
    else:
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        nested = input_ids if batch else [input_ids]
        assert isinstance(nested, list)
        prompts = [_token_ids(ids, "input_ids") for ids in nested]
    if not prompts:
        raise RequestError("a batch needs at least one prompt")
    n = len(prompts)
    params = body.get("sampling_params")
    per_item = params if isinstance(params, list) else [params] * n
    if len(per_item) != n:
        raise RequestError(f"sampling_params has {len(per_item)} entries for a batch of {n}")
    budgets: list[int] = []
    for item in per_item:
        if item is not None and not isinstance(item, Mapping):
            raise RequestError("sampling_params must be an object")
        value = None if item is None else item.get("max_new_tokens")
        budgets.append(_count(value, "sampling_params.max_new_tokens", DEFAULT_GENERATE_TOKENS))
    if batch:
        salts = normalize_keys(body.get("cache_salt"), "cache_salt", n)
        loras = normalize_keys(body.get("lora_path"), "lora_path", n)
        extras = normalize_keys(body.get("extra_key"), "extra_key", n)
    else:  # a single prompt takes a single value: a list is a type error, as in the seed
        salts = [normalize_key(body.get("cache_salt"), "cache_salt")]
        loras = [normalize_key(body.get("lora_path"), "lora_path")]
        extras = [normalize_key(body.get("extra_key"), "extra_key")]
    stream = _bool(body, "stream")
    if stream and batch:
        raise RequestError("stream is not supported for batched requests")
    rids = _rids(body.get("rid"), n, batch=batch)
    dp_rank = _dp_rank(body)
    handoffs = kv_handoffs(body, n)
    logprobs = _bool(body, "return_logprob")
    # SGLang ignores logprob_start_len without return_logprob (`Scheduler.handle_generate_request`)
    starts = _logprob_starts(body.get("logprob_start_len"), n) if logprobs else [None] * n
    for start, prompt in zip(starts, prompts, strict=True):
        if start is not None and start > len(prompt):
            # SGLang aborts it with a 400 (0.5.23 `Scheduler.handle_generate_request`)
            raise RequestError(
                f"logprob_start_len={start} is higher than the number of input tokens "
                f"{len(prompt)}. Please use a smaller logprob_start_len."
            )
    items = [
        Generation(
            input_ids=prompts[i],
            namespace=Namespace(extra_key=extras[i], cache_salt=salts[i], lora=loras[i]),
            max_new_tokens=budgets[i],
            dp_rank=dp_rank,
            rid=rids[i],
            handoff=handoffs[i],
            reuse_limit=starts[i],
            logprob_start_len=starts[i],
        )
        for i in range(n)
    ]
    return ApiRequest(items=items, batch=batch, stream=stream, return_logprob=logprobs)


def _rids(rid: object, count: int, *, batch: bool) -> list[str | None]:
    """Each item's request id: a batch's one string is `rid_i` per item, as SGLang names them
    (`GenerateReqInput._normalize_rid`; every item had the same one here), or one per item."""
    if batch and isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)]
    rids: list[object] = list(rid) if batch and isinstance(rid, list) else [rid] * count
    checked = [r for r in rids if r is None or isinstance(r, str)]
    if len(rids) != count or len(checked) != count:
        raise RequestError("rid must be a string (or one string per batch item)")
    return checked


def _logprob_starts(value: object, count: int) -> list[int | None]:
    """Per item, where its prompt logprobs start (None: -1 or unset, the output's only), as
    SGLang reads `logprob_start_len`: a scalar for every item, or one per item."""
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise RequestError(f"logprob_start_len has {len(values)} values for a batch of {count}")
    starts: list[int | None] = []
    for start in values:
        if start is None:
            starts.append(None)
        elif isinstance(start, bool) or not isinstance(start, int) or start < -1:
            raise RequestError("logprob_start_len must be an integer >= -1")
        else:
            starts.append(None if start == -1 else start)
    return starts


def _openai_budget(body: Mapping[str, Any], *fields: str) -> int:
    for field in fields:
        if body.get(field) is not None:
            return _count(body[field], field, DEFAULT_COMPLETION_TOKENS)
    return DEFAULT_COMPLETION_TOKENS


def splits_at_first_colon(version: str) -> bool:
    """Whether SGLang of `version` reads a `model` by its first ":" whatever it serves: 0.5.17
    to 0.5.22 (their `_parse_model_parameter`); 0.5.23 matches its served name first."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return found is not None and (0, 5, 17) <= tuple(map(int, found.groups())) <= (0, 5, 22)


def parse_model_parameter(model: str, served: str, version: str) -> tuple[str, str | None]:
    """(base model, LoRA adapter or None) of an OpenAI request's `model`, as the SGLang
    `version` this worker plays reads it (`OpenAIServingBase._parse_model_parameter`): 0.5.23
    keeps its served name whole even with colons in it (an object-storage URI) and splits
    after it; before, the first ":" split, so a served `org/m:v1` was adapter `v1` of `org/m`.
    """
    if ":" not in model:
        return model, None
    if not splits_at_first_colon(version):
        if model == served:
            return model, None
        if model.startswith(served + ":"):
            return served.strip(), model[len(served) + 1 :].strip() or None
    base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def _openai_common(
    body: Mapping[str, Any],
    prompts: list[list[int]],
    budget: int,
    dp_rank_header: str | None,
    reuse_limit: int | None = None,
    *,
    served: str,
    version: str,
    batch: bool = False,
) -> ApiRequest:
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError("n must be 1")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string")
    # SGLang's OpenAI routes: the model's `base:adapter` wins over `lora_path`
    # (`_resolve_lora_path`)
    adapter = None if model is None else parse_model_parameter(model, served, version)[1]
    count = len(prompts)
    if batch:  # one value for all, or a list of one per item, as a batched /generate
        extras = normalize_keys(body.get("extra_key"), "extra_key", count)
        salts = normalize_keys(body.get("cache_salt"), "cache_salt", count)
        loras = normalize_keys(body.get("lora_path"), "lora_path", count)
    else:
        extras = [normalize_key(body.get("extra_key"), "extra_key")]
        salts = [normalize_key(body.get("cache_salt"), "cache_salt")]
        loras = [normalize_key(body.get("lora_path"), "lora_path")]
    rids = _rids(body.get("rid"), count, batch=batch)
    dp_rank = dp_rank_from_header(dp_rank_header, _dp_rank(body))
    handoffs = kv_handoffs(body, count)
    items = [
        Generation(
            input_ids=prompts[i],
            namespace=Namespace(extra_key=extras[i], cache_salt=salts[i], lora=adapter or loras[i]),
            max_new_tokens=budget,
            dp_rank=dp_rank,
            rid=rids[i],
            handoff=handoffs[i],
            reuse_limit=reuse_limit,
        )
        for i in range(count)
    ]
    return ApiRequest(
        items=items,
        batch=batch,
        stream=_bool(body, "stream"),
        include_usage=_stream_usage(body),
        model=model,
    )


def parse_completion(
    raw: object,
    *,
    dp_rank_header: str | None = None,
    served: str = "",
    version: str = SGLANG_VERSION,
) -> ApiRequest:
    """OpenAI `POST /v1/completions`: one prompt, as text or token ids, or a batch of them (a
    list of strings, or of token id lists: one choice each, `index` its place, as SGLang runs
    them) (and the value of the request's `X-Data-Parallel-Rank` header, if any); `served`: the
    model the worker serves, `version`: the SGLang it plays (how `model` names an adapter:
    `parse_model_parameter`)."""
    body = _body(raw)
    prompt = body.get("prompt")
    # a list of one string or one id list is a batch of one, as SGLang 0.5.23 runs it
    # (`GenerateReqInput._determine_batch_size`): its `cache_salt` may be a list of one. Before,
    # it was read as the one prompt, and a list of one salt was refused (QA: a request the
    # router routed, and SGLang takes)
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    prompts: list[list[int]]
    if isinstance(prompt, str):
        prompts = [_text_ids(prompt, "prompt")]
    elif batch:
        assert isinstance(prompt, list)
        prompts = [_batch_prompt(p, i, type(prompt[0])) for i, p in enumerate(prompt)]
    elif isinstance(prompt, list):
        prompts = [_token_ids(prompt, "prompt")]
    else:
        raise RequestError("prompt must be a string or a list of token ids")
    # SGLang scores the whole prompt of an echo with logprobs: nothing of it is reused. Read
    # strictly, as this worker's /generate reads its flags: SGLang's OpenAI routes take lax
    # values ("no", "0") as pydantic does, which Python's truthiness reads otherwise, so a
    # value that is not a JSON boolean / integer is refused rather than guessed
    echo = _bool(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise RequestError("logprobs must be an integer")
    reuse_limit = 0 if echo and logprobs else None
    budget = _openai_budget(body, "max_tokens")
    return _openai_common(
        body,
        prompts,
        budget,
        dp_rank_header,
        reuse_limit,
        served=served,
        version=version,
        batch=batch,
    )


def _batch_prompt(prompt: object, index: int, kind: type) -> list[int]:
    """Item `index` of a batched completions prompt: all strings, or all token id lists (as
    SGLang reads the batch by its first item's kind)."""
    field = f"prompt[{index}]"
    if not isinstance(prompt, kind):
        raise RequestError(f"{field}: a batch of prompts is all strings or all token id lists")
    if isinstance(prompt, str):
        return _text_ids(prompt, field)
    return _token_ids(prompt, field)


def parse_chat(
    raw: object,
    *,
    dp_rank_header: str | None = None,
    served: str = "",
    version: str = SGLANG_VERSION,
) -> ApiRequest:
    """OpenAI `POST /v1/chat/completions`: messages through the shared chat template (and the
    request's `X-Data-Parallel-Rank` header, if any); `served` and `version` as for
    `parse_completion`."""
    body = _body(raw)
    try:
        text = render_chat(body.get("messages"))  # type: ignore[arg-type]
    except ChatTemplateError as exc:
        raise RequestError(str(exc)) from exc
    if body.get("input_ids") is not None:
        # as SGLang: pre-rendered ids are the prompt, the template is skipped
        ids = _token_ids(body["input_ids"], "input_ids")
    else:
        ids = _TOKENIZER.encode(text, add_bos=True)
    budget = _openai_budget(body, "max_completion_tokens", "max_tokens")
    return _openai_common(body, [ids], budget, dp_rank_header, served=served, version=version)
