"""Parsing a proxied request into what routing needs: namespace, tokens, streaming flag.

A chat request is also read for what the engine passes to the chat template besides the messages
(`chat_options`: tools as the engine's pydantic models dump them, tool_choice, chat_template_kwargs,
reasoning_effort, documents, and vLLM's add_generation_prompt/continue_final_message), the way the
configured `tokenizer.chat_engine` reads them.

The body is forwarded to the worker byte for byte unless a trusted salt header overrides the
salt, in which case the body's `cache_salt` is rewritten so the worker caches the request in the
namespace the router routed it in. `cache_salt` is validated the way the workers validate it (a
string, `""` meaning none, one per item in a batched `/generate`), so a malformed request is a
400 naming the field here instead of a surprise on the worker.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from indexer.protocol.tokens import ChatTemplateError
from router.config import LimitsConfig
from router.errors import RequestError
from router.prompt.nesting import nests_deeper
from router.prompt.tokenizer import PromptTokenizer

__all__ = [
    "ChatEngine",
    "ChatOptions",
    "Endpoint",
    "ParsedRequest",
    "chat_options",
    "check_salt_size",
    "detect_endpoint",
    "parse_body",
    "parse_request",
]

ChatEngine = Literal["sglang", "vllm"]


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
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if nests_deeper(raw, limits.max_json_depth):
        raise too_deep
    return body


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


def _ids(value: object, field: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise RequestError(f"{field} must be a list of integers")
    return value


def _first(value: list[Any], field: str) -> object:
    if not value:
        raise RequestError(f"{field} must not be empty")
    return value[0]


def _generate_tokens(body: Mapping[str, Any], tok: PromptTokenizer) -> tuple[list[int], bool]:
    if (input_ids := body.get("input_ids")) is not None:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            return _ids(input_ids[0], "input_ids[0]"), True
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
    if isinstance(prompt, str):
        return tok.text(prompt)
    if isinstance(prompt, list):
        first = _first(prompt, "prompt")
        if isinstance(first, str):
            return tok.text(first)
        if isinstance(first, list):
            return _ids(first, "prompt[0]")
        return _ids(prompt, "prompt")
    raise RequestError("prompt must be a string, a list of strings or a list of token ids")


# the reasoning_effort tiers both engines accept (SGLang also takes a float in [0, 0.99])
_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SGLANG_MAX_EFFORT = 0.99
# `chat_template_kwargs` keys naming what the engine's apply_chat_template call sets itself: the
# engine fails on them (a duplicate argument), or they would swap the template (never trusted)
_OWNED_KWARGS = {
    "sglang": (
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "chat_template",
    ),
    "vllm": ("messages", "conversation", "chat_template"),
}
# apply_chat_template parameters that are not template variables and change nothing when the
# prompt is rendered as text; the two that would are refused when set
_INERT_CALL_KWARGS = (
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "tokenizer_kwargs",
    "tokenize",
    "return_dict",
    "add_generation_prompt",
    "continue_final_message",
)
_REFUSED_CALL_KWARGS = ("return_assistant_tokens_mask", "sanitize_control_tokens")


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine hands `apply_chat_template` besides the messages, for one request."""

    tools: list[Any] | None = None
    documents: list[Any] | None = None
    # extra template variables: chat_template_kwargs and what the engine derives from the request
    variables: dict[str, Any] = msgspec.field(default_factory=dict)
    add_generation_prompt: bool = True
    # vLLM: transformers' continuation of the final message; SGLang: its own assistant prefix
    continue_final_message: bool = False


def chat_options(request: Mapping[str, Any], engine: ChatEngine) -> ChatOptions:
    """The template inputs `engine` derives from a chat request body (RequestError if bad)."""
    kwargs = request.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object")
    kwargs = dict(kwargs)
    for key in _OWNED_KWARGS[engine]:
        if key in kwargs:
            raise RequestError(
                f"chat_template_kwargs.{key} is not allowed: the engine sets it itself"
            )
    for key in _REFUSED_CALL_KWARGS:
        if kwargs.get(key):
            raise RequestError(f"chat_template_kwargs.{key} is not supported")
    if engine == "vllm":
        return _vllm_options(request, kwargs)
    return _sglang_options(request, kwargs)


def _sglang_options(request: Mapping[str, Any], kwargs: dict[str, Any]) -> ChatOptions:
    """SGLang's ChatCompletionRequest validators and serving_chat `_process_messages`."""
    if kwargs.get("continue_final_message"):
        # transformers refuses it next to SGLang's add_generation_prompt=True
        raise RequestError(
            "chat_template_kwargs.continue_final_message is incompatible with the generation prompt"
        )
    tools = _tools(request.get("tools"), "sglang")
    choice = _tool_choice(request.get("tool_choice"), "sglang")
    if choice is None:
        choice = "none" if tools is None else "auto"
    if choice == "required" and not tools:
        raise RequestError('tool_choice "required" needs tools')
    if isinstance(choice, dict):
        name = choice["function"].get("name")
        if not tools or not any(t["function"]["name"] == name for t in tools):
            raise RequestError(f"tool_choice names a tool not in tools: {name!r}")
    # the thinking switches a reasoning effort implies, unless the request set them
    effort, thinking = _sglang_reasoning(request)
    if thinking is not None:
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
    popped = kwargs.pop("reasoning_effort", None)
    if popped is not None:
        effort = popped
    variables = {} if effort is None else {"reasoning_effort": effort}
    variables.update(kwargs)
    documents = _documents(variables.pop("documents", None), "chat_template_kwargs.documents")
    for key in _INERT_CALL_KWARGS:
        variables.pop(key, None)
    if not tools or choice == "none":
        rendered_tools = None
    elif isinstance(choice, dict):
        rendered_tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    else:
        rendered_tools = tools
    return ChatOptions(
        tools=rendered_tools,
        documents=documents,
        variables=variables,
        continue_final_message=_flag(request, "continue_final_message", False),
    )


def _sglang_reasoning(request: Mapping[str, Any]) -> tuple[object, bool | None]:
    """(reasoning_effort, thinking) from `reasoning_effort` and the `reasoning` object."""
    effort = request.get("reasoning_effort")
    thinking: bool | None = None
    reasoning = request.get("reasoning")
    if isinstance(reasoning, dict):
        nested = reasoning.get("effort")
        if nested is None:
            nested = reasoning.get("reasoning_effort")
        if nested is not None:
            effort = nested  # the reasoning object wins over the top-level field
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in {"1", "true", "yes", "y", "on"}
        if enabled:
            thinking = True
    effort = _sglang_effort(effort)
    if effort is not None:
        thinking = effort != "none"
    return effort, thinking


def _sglang_effort(value: object) -> str | float | None:
    if value is None or (isinstance(value, str) and value in _EFFORT_TIERS):
        return value
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not 0.0 <= number <= _SGLANG_MAX_EFFORT:
        raise RequestError(
            f"reasoning_effort must be one of {', '.join(_EFFORT_TIERS)} "
            f"or a number in [0, {_SGLANG_MAX_EFFORT}]"
        )
    return number


def _vllm_options(request: Mapping[str, Any], kwargs: dict[str, Any]) -> ChatOptions:
    """vLLM's `build_chat_params` + `preprocess_chat` merge and `resolve_chat_template_kwargs`."""
    effort = request.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort in _EFFORT_TIERS):
        raise RequestError(f"reasoning_effort must be one of {', '.join(_EFFORT_TIERS)}")
    add_generation_prompt = _flag(request, "add_generation_prompt", True)
    continue_final_message = _flag(request, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
    tools = _tools(request.get("tools"), "vllm")
    _tool_choice(request.get("tool_choice"), "vllm")  # validated; vLLM renders every tool
    derived: dict[str, Any] = {}
    if effort is not None:
        derived["reasoning_effort"] = effort
        if "enable_thinking" not in kwargs:
            derived["enable_thinking"] = effort != "none"
    # the request's kwargs override the server's (tools), the request's fields override both;
    # vLLM's merge treats a null or "auto" value as unset
    variables = {k: v for k, v in kwargs.items() if v is not None and v != "auto"}
    variables.update(derived)
    if "tools" in variables:
        tools = _plain_list(variables.pop("tools"), "chat_template_kwargs.tools")
    documents = _documents(request.get("documents"), "documents")
    if documents is None:
        documents = _documents(variables.get("documents"), "chat_template_kwargs.documents")
    variables.pop("documents", None)
    for key in _INERT_CALL_KWARGS:
        variables.pop(key, None)
    return ChatOptions(
        tools=tools,
        documents=documents,
        variables=variables,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )


def _flag(request: Mapping[str, Any], field: str, default: bool) -> bool:
    value = request.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{field} must be a boolean")
    return value


def _plain_list(value: object, field: str) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise RequestError(f"{field} must be a list of objects")
    return value


def _documents(value: object, field: str) -> list[Any] | None:
    return None if value is None else _plain_list(value, field)


def _tool_choice(value: object, engine: ChatEngine) -> str | dict[str, Any] | None:
    """A valid `tool_choice` (None when absent), as both engines' pydantic models accept it."""
    if value is None or (isinstance(value, str) and value in ("none", "auto", "required")):
        return value
    if isinstance(value, dict) and value.get("type", "function") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        # SGLang's ToolChoiceFuncName allows a null name, vLLM's requires a string
        if isinstance(function, dict) and (
            isinstance(name, str) or (name is None and engine == "sglang")
        ):
            return value
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def _tools(value: object, engine: ChatEngine) -> list[dict[str, Any]] | None:
    """`tools` as the engine's pydantic models dump them: what `tools | tojson` prints."""
    if value is None:
        return None
    tools = _plain_list(value, "tools")
    dump = _sglang_tool if engine == "sglang" else _vllm_tool
    return [dump(tool, i) for i, tool in enumerate(tools)]


def _function_fields(tool: Mapping[str, Any], i: int) -> tuple[dict[str, Any], str]:
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"tools[{i}].function must be an object")
    name = function.get("name")
    if not isinstance(name, str):
        raise RequestError(f"tools[{i}].function.name must be a string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"tools[{i}].function.description must be a string")
    for key in ("defer_loading",):
        if function.get(key) is not None and not isinstance(function.get(key), bool):
            raise RequestError(f"tools[{i}].function.{key} must be a boolean")
    if tool.get("defer_loading") is not None and not isinstance(tool.get("defer_loading"), bool):
        raise RequestError(f"tools[{i}].defer_loading must be a boolean")
    return function, name


def _sglang_tool(tool: Mapping[str, Any], i: int) -> dict[str, Any]:
    """SGLang's `Tool.model_dump()`: field order, defaults and nulls included."""
    function, name = _function_fields(tool, i)
    kind = tool.get("type", "function")
    if not isinstance(kind, str):
        raise RequestError(f"tools[{i}].type must be a string")
    strict = function.get("strict", False)
    if not isinstance(strict, bool):
        raise RequestError(f"tools[{i}].function.strict must be a boolean")
    defer = tool.get("defer_loading")
    function_defer = function.get("defer_loading")
    if function_defer is None:
        function_defer = defer  # the tool's flag propagates to its function
    dumped: dict[str, Any] = {
        "description": function.get("description"),
        "name": name,
        "parameters": function.get("parameters"),
        "strict": strict,
    }
    if function_defer is not None:
        dumped["defer_loading"] = function_defer
    return {"type": kind, "function": dumped, "defer_loading": defer}


def _vllm_tool(tool: Mapping[str, Any], i: int) -> dict[str, Any]:
    """vLLM's `ChatCompletionToolsParam.model_dump()`: unset optional flags are left out."""
    function, name = _function_fields(tool, i)
    if tool.get("type", "function") != "function":
        raise RequestError(f'tools[{i}].type must be "function"')
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"tools[{i}].function.parameters must be an object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"tools[{i}].function.strict must be a boolean")
    defer = tool.get("defer_loading")
    function_defer = function.get("defer_loading")
    if function_defer is None:
        function_defer = defer
    dumped: dict[str, Any] = {
        "name": name,
        "description": function.get("description"),
        "parameters": parameters,
    }
    if strict is not None:
        dumped["strict"] = strict
    if function_defer is not None:
        dumped["defer_loading"] = function_defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _chat_tokens(body: Mapping[str, Any], tok: PromptTokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list")
    options = None
    if tok.template is not None:
        options = chat_options(body, tok.template.engine)
    else:
        # kvroute's own template renders the messages alone, but the fields must be well-formed
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        if body.get("tools") is not None:
            _plain_list(body["tools"], "tools")
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
    limits: LimitsConfig = _LIMITS,
) -> ParsedRequest:
    """Validate `raw` for `endpoint`; `header_salt` (trusted header) overrides the body's salt."""
    body = parse_body(raw, limits)
    batched = False
    if endpoint is Endpoint.GENERATE:
        tokens, batched = _generate_tokens(body, tokenizer)
    elif endpoint is Endpoint.COMPLETIONS:
        tokens = _completion_tokens(body, tokenizer)
    else:
        tokens = _chat_tokens(body, tokenizer)
    salt = _salt(body.get("cache_salt"), limits, batched=batched)
    forwarded = raw
    if header_salt is not None:
        salt = header_salt or None
        if salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = salt
        forwarded = _encoder.encode(body)
    model = body.get("model")
    lora = body.get("lora_path")
    stream = body.get("stream")
    return ParsedRequest(
        endpoint=endpoint,
        body=forwarded,
        salt=salt,
        model=model if isinstance(model, str) else "",
        lora=lora if isinstance(lora, str) and lora else None,
        tokens=tokens,
        stream=stream is True,
        extra_key=_salt(body.get("extra_key"), limits, batched=batched, field="extra_key"),
    )
