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
- the variables: `messages`, `tools` and `documents` (always none: see below),
  `add_generation_prompt`, and the named special tokens (`bos_token`, `eos_token`, ...), whose
  config values may be strings or AddedToken dicts with a `"content"`;
- the message normalization of `transformers` >= 5 (keys whose value is null are dropped, a
  message's reasoning is also offered as `reasoning_content` and `thinking`) and of the engine's
  OpenAI layer: whether the template wants `content` as a string or as a list of typed parts
  ("content format", detected from the template's syntax tree as both engines do), and how list
  content is flattened for string templates (SGLang joins text parts with a space, vLLM with a
  newline).

Not mirrored: request-level `tools` (the engine renders tool schemas into the prompt; the router
renders without them) and media parts, which the engine expands into model-specific tokens.

Rendering is bounded: the sandbox forbids attribute access to Python internals and mutation of
the request data, file and network access do not exist in the environment, `range` is capped by
the sandbox, and the rendered text is capped at `MAX_RENDERED_CHARS`. The template itself is
operator configuration, like the model files: its own loops are trusted to end; what a request
controls (the messages) can only make it iterate over the messages it sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from indexer.protocol.tokens import ChatTemplateError
from router.errors import ConfigError

__all__ = [
    "MAX_RENDERED_CHARS",
    "SPECIAL_TOKEN_NAMES",
    "ChatEngine",
    "ContentFormat",
    "ModelChatTemplate",
    "detect_content_format",
    "special_tokens",
]

ChatEngine = Literal["sglang", "vllm"]
ContentFormat = Literal["string", "openai"]

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
# what vLLM's OpenAI layer keeps of a message besides role and content
_VLLM_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning")
# SGLang treats a template mentioning any of these as one that wants typed content parts
_MEDIA_WORDS = ("image", "audio", "video", "vision")
# loop variables whose `.content` being iterated marks a typed-parts template
_MESSAGE_NAMES = ("message", "msg", "m")
_TEXT_PART_TYPES = ("text", "input_text")
_MEDIA_PART_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
}


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


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether `node` is `message['content']` / `msg.content`, possibly filtered or sliced."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads_content(node.node)
    if isinstance(node, jinja2.nodes.Getitem):
        if isinstance(node.arg, jinja2.nodes.Slice):
            return _reads_content(node.node)
        return (
            isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
            and _is_message(node.node)
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and _is_message(node.node)
    return False


def _is_message(node: jinja2.nodes.Node) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.name in _MESSAGE_NAMES


def detect_content_format(source: str) -> ContentFormat:
    """ "openai" when the template loops over a message's content parts, else "string"."""
    if any(word in source for word in _MEDIA_WORDS):
        return "openai"
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


def _text_parts(content: list[Any], index: int) -> Iterator[tuple[str, str | None]]:
    """(kind, text) of each content part; media parts yield their kind and no text."""
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{index}].content[{j}] must be an object")
        kind = part.get("type")
        if kind in _TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{index}].content[{j}].text must be a string")
            yield "text", text
        elif isinstance(kind, str) and kind in _MEDIA_PART_TYPES:
            yield _MEDIA_PART_TYPES[kind], None


class ModelChatTemplate:
    """A model's Jinja chat template with its special tokens, rendered like the engine does."""

    def __init__(
        self,
        source: str,
        *,
        special: Mapping[str, str] | None = None,
        engine: ChatEngine = "sglang",
        origin: str = "chat template",
    ) -> None:
        self.origin = origin
        self.engine = engine
        self.special = dict(special or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{origin}: invalid Jinja at line {exc.lineno}: {exc}") from exc
        self.content_format = detect_content_format(source)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        special_tokens_from: str | Path | None = None,
        engine: ChatEngine = "sglang",
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
            else:
                source, origin = _config_template(config, path), path
            return cls(source, special=special_tokens(config), engine=engine, origin=str(origin))
        special: dict[str, str] = {}
        if special_tokens_from is not None and Path(special_tokens_from).is_file():
            special = special_tokens(_read_json(Path(special_tokens_from)))
        return cls(_read_text(path), special=special, engine=engine, origin=str(path))

    def render(self, messages: Sequence[object], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (raises ChatTemplateError naming the problem)."""
        prepared = self._prepare(messages)
        variables: dict[str, Any] = {
            **self.special,
            "messages": prepared,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        chunks: list[str] = []
        size = 0
        try:
            for chunk in self._template.generate(**variables):
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

    def _prepare(self, messages: Sequence[object]) -> list[dict[str, Any]]:
        """The messages as the engine hands them to the template."""
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise ChatTemplateError("messages must be a list")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        prepared: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{i}] must be an object")
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
            if self.engine == "vllm":
                fields = {"role": role, "content": self._vllm_content(message.get("content"), i)}
                fields.update({k: message[k] for k in _VLLM_MESSAGE_FIELDS if k in message})
            else:
                fields = dict(message)
                fields["content"] = self._sglang_content(message.get("content"), i)
            prepared.append(_transformers_message(fields))
        return prepared

    def _sglang_content(self, content: object, index: int) -> object:
        if content is None:
            return ""  # SGLang renders a null content as the empty string
        if not isinstance(content, list):
            return content
        parts = list(_text_parts(content, index))
        if self.content_format == "string":
            return " ".join(text for _, text in parts if text is not None)
        return [{"type": "text", "text": t} if t is not None else {"type": k} for k, t in parts]

    def _vllm_content(self, content: object, index: int) -> object:
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ChatTemplateError(f"messages[{index}].content must be a string or a list")
        parts = list(_text_parts(content, index))
        if self.content_format == "string":
            return "\n".join(text for _, text in parts if text is not None)
        return [{"type": "text", "text": t} if t is not None else {"type": k} for k, t in parts]


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


def _config_template(config: Mapping[str, Any], path: Path) -> str:
    """The default template of a tokenizer config (a string, or a list of named templates)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ConfigError(f"{path}: no chat_template (a string or a 'default' named template)")
    return template
