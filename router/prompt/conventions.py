"""Each engine's chat conventions: what its OpenAI layer makes of a chat request for the template.

SGLang and vLLM render `/v1/chat/completions` with the same `transformers` machinery, but their
OpenAI layers hand it different inputs. A `ChatConvention` holds one engine's rules, so the
request parser and the chat template ask it instead of comparing engine names:
- which `chat_template_kwargs` keys the engine sets itself (`owned_kwargs`, a 400 when sent);
- the template inputs it derives from the request (`template_inputs` -> `ChatOptions`): tools,
  tool_choice, chat_template_kwargs, reasoning_effort and the thinking switches it implies,
  documents, vLLM's add_generation_prompt/continue_final_message, SGLang's
  continue_final_message;
- how its request models dump `tools` (`dump_tool`: what `tools | tojson` prints) and which
  `tool_choice` they accept;
- how a message reaches the template (`prepare_message`, from `router.prompt.messages`):
  which fields are kept, how list content is flattened, assistant `tool_calls`; and what the
  engine does to the whole conversation for a given template (`prepare_conversation`: vLLM's
  developer-to-system conversion);
- which pre-tokenized prompt a chat request may carry instead of being rendered
  (`prompt_ids`: SGLang's `input_ids`, vLLM's `kv_transfer_params.prompt_token_ids`);
- how a final assistant message is continued (or, SGLang, turned into a user message), and
  whether a failed render is retried with bare function schemas (SGLang).

`chat_convention(engine)` finds an engine's convention through its spec
(`indexer.engines.EngineSpec.chat`). Facts from the engines' released code: SGLang's
`ChatCompletionRequest` validators and `serving_chat`, vLLM's `build_chat_params`,
`preprocess_chat`, `_reused_prompt_token_ids` and `resolve_chat_template_kwargs`. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from indexer.engines import ENGINES, EngineName, engine_spec
from router.errors import RequestError
from router.prompt.messages import (
    ContentFormat,
    sglang_message,
    vllm_conversation,
    vllm_has_media,
    vllm_message,
)

__all__ = [
    "CHAT_REQUEST_FIELDS",
    "CONVENTIONS",
    "SGLANG_CHAT",
    "VLLM_CHAT",
    "ChatConvention",
    "ChatOptions",
    "chat_convention",
    "chat_options",
    "check_chat_fields",
]

# the request fields besides `messages` that some engine's convention renders into the prompt
# (`chat_options` reads no others): the KV query API takes these too (`router.http.kv_query`),
# so a gateway's chat is matched by the prompt the proxy would route it by
CHAT_REQUEST_FIELDS = (
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "reasoning_effort",
    "reasoning",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
)
# the reasoning_effort tiers vLLM accepts
_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# SGLang 0.5.23's `ReasoningEffortTier` (protocol.py), DeepSeek's "ultra" included, top level or in
# a `reasoning` object (`normalize_reasoning_inputs`); it also takes a float in [0, 0.99]
_SGLANG_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_SGLANG_MAX_EFFORT = 0.99
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
    # SGLang, when not continuing: a final assistant message with text content is rendered as a
    # user message (serving_chat.py `_handle_last_assistant_message`)
    final_assistant_as_user: bool = False


def _sglang_options(
    convention: ChatConvention, request: Mapping[str, Any], kwargs: dict[str, Any]
) -> ChatOptions:
    """SGLang's ChatCompletionRequest validators and serving_chat `_process_messages`."""
    if kwargs.get("continue_final_message"):
        # transformers refuses it next to SGLang's add_generation_prompt=True
        raise RequestError(
            "chat_template_kwargs.continue_final_message is incompatible with the generation prompt"
        )
    tools = convention.tools(request.get("tools"))
    choice = convention.tool_choice(request.get("tool_choice"))
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
    continue_final_message = _flag(request, "continue_final_message", False)
    return ChatOptions(
        tools=rendered_tools,
        documents=documents,
        variables=variables,
        continue_final_message=continue_final_message,
        # 0.5.23 `_apply_jinja_template` hands every chat completion to
        # `_handle_last_assistant_message` (its `_format_add_generation_prompt` is unset there)
        final_assistant_as_user=not continue_final_message,
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
    """A tier passes as written (the template sees it as `reasoning_effort`), a number as float."""
    if value is None or (isinstance(value, str) and value in _SGLANG_EFFORT_TIERS):
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
            f"reasoning_effort must be one of {', '.join(_SGLANG_EFFORT_TIERS)} "
            f"or a number in [0, {_SGLANG_MAX_EFFORT}]"
        )
    return number


def _vllm_options(
    convention: ChatConvention, request: Mapping[str, Any], kwargs: dict[str, Any]
) -> ChatOptions:
    """vLLM's `build_chat_params` + `preprocess_chat` merge and `resolve_chat_template_kwargs`."""
    effort = request.get("reasoning_effort")
    if effort is not None and not (isinstance(effort, str) and effort in _EFFORT_TIERS):
        raise RequestError(f"reasoning_effort must be one of {', '.join(_EFFORT_TIERS)}")
    add_generation_prompt = _flag(request, "add_generation_prompt", True)
    continue_final_message = _flag(request, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true")
    tools = convention.tools(request.get("tools"))
    convention.tool_choice(request.get("tool_choice"))  # validated; vLLM renders every tool
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
    """SGLang's `Tool.model_dump()` (0.5.23 `srt/entrypoints/openai/protocol.py`, `Tool` and
    the `Function._serialize` wrap serializer).

    The template renders the schema as the client wrote it, so the function keeps the client's
    key order (its declared fields only; unknown keys are dropped) with the fields it left out
    after them; `strict` and `defer_loading` appear only when set, while an absent
    `description` or `parameters` is still there as null. The `Tool` wrapper has no such
    serializer: `type`, `function`, `defer_loading` in that order, null included.
    """
    function, name = _function_fields(tool, i)
    kind = tool.get("type", "function")
    if not isinstance(kind, str):
        raise RequestError(f"tools[{i}].type must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"tools[{i}].function.strict must be a boolean")
    defer = tool.get("defer_loading")
    function_defer = function.get("defer_loading")
    if function_defer is None:
        function_defer = defer  # the tool's flag propagates to its function
    declared: dict[str, Any] = {
        "description": function.get("description"),
        "name": name,
        "parameters": function.get("parameters"),
    }
    if strict is not None:
        declared["strict"] = strict
    if function_defer is not None:
        declared["defer_loading"] = function_defer
    order = [key for key in function if key in declared]
    order += [key for key in declared if key not in order]
    dumped = {key: declared[key] for key in order}
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


def _sglang_prompt_ids(request: Mapping[str, Any]) -> tuple[object, str] | None:
    """SGLang 0.5.23 `OpenAIServingChat._process_messages`: `input_ids` is the prompt."""
    ids = request.get("input_ids")
    return None if ids is None else (ids, "input_ids")


def _vllm_prompt_ids(request: Mapping[str, Any]) -> tuple[object, str] | None:
    """vLLM 0.33 `_reused_prompt_token_ids` (online_renderer.py): a disaggregated decode
    stage's `kv_transfer_params.prompt_token_ids` is the prompt, unless `echo` is set or the
    messages hold non-text content; then the messages are rendered."""
    params = request.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    ids = params.get("prompt_token_ids")
    if ids is None or request.get("echo") or vllm_has_media(request.get("messages")):
        return None
    field = "kv_transfer_params.prompt_token_ids"
    # `type(x) is int`: a bool is no token id
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise RequestError(f"{field} must be a non-empty list of non-negative integers")
    return ids, field


def _as_rendered(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    return messages


class ChatConvention(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's OpenAI-layer rules for turning a chat request into template inputs."""

    name: str
    # chat_template_kwargs keys naming what the engine's apply_chat_template call sets itself:
    # the engine fails on them (a duplicate argument), or they would swap the template (never
    # trusted)
    owned_kwargs: tuple[str, ...]
    # the template inputs from a request whose chat_template_kwargs passed the common checks
    template_inputs: Callable[[ChatConvention, Mapping[str, Any], dict[str, Any]], ChatOptions]
    # one `tools` entry as the engine's request model dumps it
    dump_tool: Callable[[Mapping[str, Any], int], dict[str, Any]]
    # whether a named tool_choice may leave the name null
    tool_choice_name_optional: bool
    # one checked message (with its role) as the template sees it, before transformers'
    # own normalization
    prepare_message: Callable[[Mapping[str, Any], str, int, ContentFormat], dict[str, Any]]
    # the prepared conversation as the engine hands it to the template whose source is given
    prepare_conversation: Callable[[list[dict[str, Any]], str], list[dict[str, Any]]]
    # the ids a chat request carries that the engine takes as its prompt instead of rendering
    # the messages, with the field's name (None: the messages are rendered)
    prompt_ids: Callable[[Mapping[str, Any]], tuple[object, str] | None]
    # continue_final_message: True renders without the final assistant message and appends its
    # text (SGLang); False is transformers' continuation of the final message (vLLM)
    continues_by_appending: bool
    # a render that fails with tools is tried again with bare function schemas
    retries_bare_function_tools: bool

    def tools(self, value: object) -> list[dict[str, Any]] | None:
        """`tools` as the engine's request models dump them: what `tools | tojson` prints."""
        if value is None:
            return None
        tools = _plain_list(value, "tools")
        return [self.dump_tool(tool, i) for i, tool in enumerate(tools)]

    def tool_choice(self, value: object) -> str | dict[str, Any] | None:
        """A valid `tool_choice` (None when absent), as the engine's request model takes it."""
        if value is None or (isinstance(value, str) and value in ("none", "auto", "required")):
            return value
        if isinstance(value, dict) and value.get("type", "function") == "function":
            function = value.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(function, dict) and (
                isinstance(name, str) or (name is None and self.tool_choice_name_optional)
            ):
                return value
        raise RequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )


SGLANG_CHAT = ChatConvention(
    name="sglang",
    owned_kwargs=(
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "chat_template",
    ),
    template_inputs=_sglang_options,
    dump_tool=_sglang_tool,
    tool_choice_name_optional=True,  # SGLang's ToolChoiceFuncName allows a null name
    prepare_message=sglang_message,
    prepare_conversation=_as_rendered,
    prompt_ids=_sglang_prompt_ids,
    continues_by_appending=True,
    retries_bare_function_tools=True,
)

VLLM_CHAT = ChatConvention(
    name="vllm",
    owned_kwargs=("messages", "conversation", "chat_template"),
    template_inputs=_vllm_options,
    dump_tool=_vllm_tool,
    tool_choice_name_optional=False,
    prepare_message=vllm_message,
    prepare_conversation=vllm_conversation,
    prompt_ids=_vllm_prompt_ids,
    continues_by_appending=False,
    retries_bare_function_tools=False,
)

CONVENTIONS: dict[str, ChatConvention] = {c.name: c for c in (SGLANG_CHAT, VLLM_CHAT)}
assert {spec.chat for spec in ENGINES.values()} <= set(CONVENTIONS), "every engine needs one"


def chat_convention(engine: EngineName) -> ChatConvention:
    """The chat convention `engine` follows (named by its spec)."""
    return CONVENTIONS[engine_spec(engine).chat]


def chat_options(request: Mapping[str, Any], convention: ChatConvention) -> ChatOptions:
    """The template inputs `convention` derives from a chat request body (RequestError if bad)."""
    kwargs = request.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object")
    kwargs = dict(kwargs)
    for key in convention.owned_kwargs:
        if key in kwargs:
            raise RequestError(
                f"chat_template_kwargs.{key} is not allowed: the engine sets it itself"
            )
    for key in _REFUSED_CALL_KWARGS:
        if kwargs.get(key):
            raise RequestError(f"chat_template_kwargs.{key} is not supported")
    return convention.template_inputs(convention, request, kwargs)


def check_chat_fields(request: Mapping[str, Any]) -> None:
    """The shape checks of `chat_template_kwargs` and `tools` alone (RequestError if bad).

    kvroute's own template renders the messages alone, but the fields must be well-formed.
    """
    kwargs = request.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object")
    if request.get("tools") is not None:
        _plain_list(request["tools"], "tools")
