"""A model's own chat template, rendered the way the inference engine renders it.

SGLang and vLLM turn `/v1/chat/completions` messages into a prompt with the model's Jinja chat
template (`tokenizer_config.json` `chat_template`, or a `chat_template.jinja` beside it) through
`transformers`' `apply_chat_template`, then encode the text with `add_special_tokens=False`: the
template writes BOS itself. The router must reproduce that text byte for byte, or a chat request
never matches the blocks the engine published. So this module mirrors, without importing
`transformers`:

- the Jinja environment: sandboxed and immutable, `trim_blocks`/`lstrip_blocks`, the loop-control
  extension, a `{% generation %}` tag that renders its body, the `raise_exception` and
  `strftime_now` globals, a `tojson` filter that does not HTML-escape (plain `json.dumps`), and
  the `dict`/`namespace` globals that refuse underscore names;
- the variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the request's
  `chat_template_kwargs` and the named special tokens (`bos_token`, `eos_token`, ...), whose
  config values may be strings or AddedToken dicts with a `"content"` (kwargs override tokens);
- the message normalization of `transformers` >= 5 (keys whose value is null are dropped, a
  message's reasoning is also offered as `reasoning_content` and `thinking`), after the engine's
  OpenAI layer prepared the messages (`router.prompt.messages`) for the content the template
  wants: a string or a list of typed parts ("content format", detected by each engine's own
  rule, `router.prompt.content_format`), and for vLLM its handling of the developer role;
- what each engine's OpenAI layer passes besides the messages (`ChatOptions`, derived by the
  engine's `ChatConvention` in `router.prompt.conventions`): the request's `tools` as its
  pydantic models dump them, `chat_template_kwargs`, `reasoning_effort`, `documents`, the
  generation prompt and the continuation of a final message; SGLang's retry with function-only
  tool schemas when the first render fails; and a tokenizer config's `tool_use` named template,
  chosen when tools are passed.

Not mirrored: media parts, which the engine expands into model-specific tokens.

Rendering is bounded: the sandbox forbids attribute access to Python internals and mutation of
the request data, file and network access do not exist in the environment, `range` is capped by
the sandbox, and the rendered text is capped at `MAX_RENDERED_CHARS`. The template itself is
operator configuration, like the model files: its own loops are trusted to end; what a request
controls (the messages) can only make it iterate over the messages it sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, overload

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from indexer.engines import EngineName
from indexer.protocol.tokens import ChatTemplateError, checked_messages
from router.errors import ConfigError
from router.prompt.content_format import CONTENT_FORMAT_RULES
from router.prompt.conventions import ChatOptions, chat_convention
from router.prompt.messages import ContentFormat

__all__ = [
    "MAX_RENDERED_CHARS",
    "SPECIAL_TOKEN_NAMES",
    "ModelChatTemplate",
    "RenderedChat",
    "detect_content_format",
    "special_tokens",
]

# the named special tokens transformers passes to every template (its `special_tokens_map`)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# a template is operator-supplied but messages are not: cap what one request can make it emit
MAX_RENDERED_CHARS = 64 * 1024 * 1024
# message fields holding the model's reasoning; transformers offers the first under all names
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RenderedChat(msgspec.Struct, frozen=True):
    """A rendered chat prompt: the template's text, and the text appended after it.

    The two are tokenized apart: SGLang continues a final assistant message by encoding its text
    on its own and appending the ids (serving_chat.py `_append_assistant_prefix_to_prompt_ids`),
    so BPE never merges across the boundary.
    """

    text: str
    continuation: str = ""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: training templates mark assistant text with it."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a plain set attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not store underscore attributes on a namespace: {name!r}"
        )


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: object) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`; the model was trained without that
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a `tokenizer_config.json`, as the template sees them."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        # an absent or null token is not passed at all: `{{ bos_token }}` then renders ""
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def detect_content_format(source: str, engine: EngineName = "sglang") -> ContentFormat:
    """ "openai" when `engine` would hand the template typed content parts, else "string"."""
    try:
        tree: jinja2.nodes.Template | None = _environment().parse(source)
    except jinja2.TemplateError:
        tree = None  # both engines default to "string"
    return CONTENT_FORMAT_RULES[chat_convention(engine).name](source, tree)


def _function_only(tools: list[Any]) -> list[Any]:
    """SGLang's second try: tool schemas without the OpenAI wrapper (Mistral-style templates)."""
    return [t["function"] if isinstance(t, dict) and "function" in t else t for t in tools]


class ModelChatTemplate:
    """A model's Jinja chat template with its special tokens, rendered like the engine does."""

    def __init__(
        self,
        source: str,
        *,
        special: Mapping[str, str] | None = None,
        engine: EngineName = "sglang",
        origin: str = "chat template",
        tool_source: str | None = None,
    ) -> None:
        self.origin = origin
        self.engine = engine
        self.convention = chat_convention(engine)
        self.special = dict(special or {})
        self._template = self._compile(source)
        self._source = source
        self.content_format = detect_content_format(source, engine)
        # a config's `tool_use` named template: transformers picks it when tools are passed
        self._tool_template: tuple[jinja2.Template, str, ContentFormat] | None = None
        if tool_source is not None:
            compiled = self._compile(tool_source)
            tool_format = detect_content_format(tool_source, engine)
            self._tool_template = (compiled, tool_source, tool_format)

    def _compile(self, source: str) -> jinja2.Template:
        try:
            return _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{self.origin}: invalid Jinja at line {exc.lineno}: {exc}") from exc

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        special_tokens_from: str | Path | None = None,
        engine: EngineName = "sglang",
    ) -> ModelChatTemplate:
        """A `tokenizer_config.json` (template and tokens) or a `.jinja` file (template only).

        A `.jinja` file takes its special tokens from `special_tokens_from`, a
        `tokenizer_config.json`, when that file exists.
        """
        path = Path(path)
        if path.suffix == ".json":
            config = _read_json(path)
            # transformers prefers a chat_template.jinja saved beside the config
            beside = path.with_name("chat_template.jinja")
            if beside.is_file():
                source, origin = _read_text(beside), beside
                tool_source = None
            else:
                source, origin = _config_template(config, path), path
                tool_source = _config_template(config, path, "tool_use")
            return cls(
                source,
                special=special_tokens(config),
                engine=engine,
                origin=str(origin),
                tool_source=tool_source,
            )
        special: dict[str, str] = {}
        if special_tokens_from is not None and Path(special_tokens_from).is_file():
            special = special_tokens(_read_json(Path(special_tokens_from)))
        return cls(_read_text(path), special=special, engine=engine, origin=str(path))

    def render(
        self,
        messages: Sequence[object],
        *,
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> str:
        """The prompt text of `messages` (raises ChatTemplateError naming the problem).

        `options` are what the request adds (see `chat_options`); without them the messages are
        rendered alone, as `apply_chat_template(messages, add_generation_prompt=...)` does.
        """
        prompt = self.render_prompt(
            messages, add_generation_prompt=add_generation_prompt, options=options
        )
        return prompt.text + prompt.continuation

    def render_prompt(
        self,
        messages: Sequence[object],
        *,
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> RenderedChat:
        """`render`, with the text an engine appends after the template kept apart."""
        if options is None:
            options = ChatOptions(add_generation_prompt=add_generation_prompt)
        template, source, content_format = self._template, self._source, self.content_format
        if options.tools is not None and self._tool_template is not None:
            template, source, content_format = self._tool_template
        prepared = self._prepare(messages, content_format, source)
        prefix = ""
        convention = self.convention
        last = prepared[-1]
        # SGLang 0.5.23 serving_chat.py `_handle_last_assistant_message`: only a final assistant
        # message whose content is text (typed parts are left alone) is continued or re-roled
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            if options.continue_final_message and convention.continues_by_appending:
                # the conversation is rendered without the final assistant message, whose text
                # is then appended for the model to continue
                prefix, prepared = last["content"], prepared[:-1]
                if not prepared:
                    raise ChatTemplateError("messages must hold more than the continued message")
            elif options.final_assistant_as_user:
                # so the prompt always ends with a user turn; the message's other fields
                # (tool_calls, name, reasoning) are not carried over
                prepared[-1] = {"role": "user", "content": last["content"]}
        continued = None
        if options.continue_final_message and not convention.continues_by_appending:
            continued = _mark_final_message(prepared, source)
        try:
            text = self._generate(template, prepared, options, options.tools)
        except ChatTemplateError:
            if not convention.retries_bare_function_tools or not options.tools:
                raise
            # the second try, for templates that want bare function schemas
            text = self._generate(template, prepared, options, _function_only(options.tools))
        if continued is not None:
            text = _cut_at_final_message(text, continued)
        return RenderedChat(text=text, continuation=prefix)

    def _generate(
        self,
        template: jinja2.Template,
        messages: list[dict[str, Any]],
        options: ChatOptions,
        tools: list[Any] | None,
    ) -> str:
        """One bounded render; every failure is a ChatTemplateError."""
        variables: dict[str, Any] = {
            **self.special,
            **options.variables,  # transformers lets template kwargs override special tokens
            "messages": messages,
            "tools": tools,
            "documents": options.documents,
            "add_generation_prompt": options.add_generation_prompt,
        }
        chunks: list[str] = []
        size = 0
        try:
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(
                        f"chat template output exceeds {MAX_RENDERED_CHARS} characters"
                    )
                chunks.append(chunk)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"chat template blocked an unsafe operation: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except RecursionError as exc:
            raise ChatTemplateError("chat template recursion too deep") from exc
        except Exception as exc:
            # templates do arithmetic and string concatenation on request data: a list where
            # the template expects a string is the client's error, not the router's
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc
        return "".join(chunks)

    def _prepare(
        self, messages: Sequence[object], content_format: ContentFormat, source: str
    ) -> list[dict[str, Any]]:
        """The messages as the engine hands them to the template (`source`)."""
        convention = self.convention
        prepared = [
            convention.prepare_message(message, role, i, content_format)
            for i, (message, role) in enumerate(checked_messages(messages))
        ]
        prepared = convention.prepare_conversation(prepared, source)
        return [_transformers_message(fields) for fields in prepared]


# transformers' marker for continue_final_message: appended to the final message, cut after render
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final_message(messages: list[dict[str, Any]], source: str) -> str:
    """Tag the final message's text as transformers does; the untagged text is returned."""
    final = messages[-1].get("content")
    if final is None:
        raise ChatTemplateError("continue_final_message: the final message has no content")
    if "content" not in source:
        raise ChatTemplateError("continue_final_message: the template does not read content")
    if isinstance(final, list):
        for j in range(len(final) - 1, -1, -1):
            if isinstance(final[j], dict) and "text" in final[j]:
                text = str(final[j]["text"])
                parts = list(final)
                parts[j] = {**final[j], "text": text + _CONTINUE_TAG}
                messages[-1] = {**messages[-1], "content": parts}
                return text
        raise ChatTemplateError("continue_final_message: no text to continue in the final message")
    if not isinstance(final, str):
        raise ChatTemplateError("continue_final_message: the final content must be text")
    messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
    return final


def _cut_at_final_message(rendered: str, final: str) -> str:
    """The rendered text up to where the final message's text ends."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the template dropped part of the final message"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def _transformers_message(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' normalization: null keys dropped, reasoning offered under every name."""
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[k] for k in _REASONING_FIELDS if kept.get(k) is not None), None)
    if reasoning is not None:
        kept = {"thinking": reasoning, **kept, "reasoning_content": reasoning}
    return kept


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tokenizer.chat_template {str(path)!r}: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


@overload
def _config_template(config: Mapping[str, Any], path: Path) -> str: ...
@overload
def _config_template(config: Mapping[str, Any], path: Path, name: str) -> str | None: ...


def _config_template(config: Mapping[str, Any], path: Path, name: str = "default") -> str | None:
    """A named template of a tokenizer config (a string, or a list of named templates).

    The default one must exist; another name is None when the config does not have it.
    """
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get(name)
    elif name != "default":
        return None
    if name != "default" and not isinstance(template, str):
        return None
    if not isinstance(template, str):
        raise ConfigError(f"{path}: no chat_template (a string or a 'default' named template)")
    return template
