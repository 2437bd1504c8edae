"""Which content a chat template wants: one string per message, or OpenAI's typed parts.

Both engines decide it once per template, by different rules, and the router must decide it the
same way: a template handed the other kind prints a list's repr where the text belongs, or
finds no parts and prints no text at all, so two different prompts render alike (a false hit)
or the same prompt renders unlike the engine's (a missed one).

- SGLang 0.5.23: any mention of "image", "audio", "video" or "vision" in the source means typed
  parts; otherwise a loop over `message.content` (loop variables named message, msg or m) does.
- vLLM (0.33 `renderers/hf.py` `_detect_content_format`): the syntax tree alone. It follows
  every name bound to `messages` (`set`, slices, filters, namespace attributes), every loop
  variable over those, and calls passing such a message's content to a macro; a loop over a
  message's content, over a macro parameter receiving it, or over a variable named `content`
  outside a macro means typed parts. A loop it matches whose target is not one name (`for a, b
  in ...`) fails its walk, which then falls back to "string".

`CONTENT_FORMAT_RULES` holds each rule under its chat convention's name. The tree is parsed by
the caller (`router.prompt.chat_template`, whose environment knows the `{% generation %}` tag);
`None` is a template that does not parse, for which both engines say "string".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jinja2.nodes

from router.prompt.messages import ContentFormat

__all__ = [
    "CONTENT_FORMAT_RULES",
    "ContentFormatRule",
    "sglang_content_format",
    "vllm_content_format",
]

ContentFormatRule = Callable[[str, jinja2.nodes.Template | None], ContentFormat]

# SGLang treats a template mentioning any of these as one that wants typed content parts
_MEDIA_WORDS = ("image", "audio", "video", "vision")
# SGLang: loop variables whose `.content` being iterated marks a typed-parts template
_MESSAGE_NAMES = ("message", "msg", "m")


def _sglang_reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether `node` is `message['content']` / `msg.content`, possibly filtered or sliced."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _sglang_reads_content(node.node)
    if isinstance(node, jinja2.nodes.Getitem):
        if isinstance(node.arg, jinja2.nodes.Slice):
            return _sglang_reads_content(node.node)
        return (
            isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
            and _sglang_is_message(node.node)
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and _sglang_is_message(node.node)
    return False


def _sglang_is_message(node: jinja2.nodes.Node) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.name in _MESSAGE_NAMES


def sglang_content_format(source: str, tree: jinja2.nodes.Template | None) -> ContentFormat:
    """SGLang's rule: a media word anywhere, or a loop over `message.content`."""
    if any(word in source for word in _MEDIA_WORDS):
        return "openai"
    if tree is None:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if _sglang_reads_content(loop.iter):
            return "openai"
    return "string"


class _UnnamedLoopTarget(Exception):
    """A matched loop binds a tuple: vLLM's walk fails there (its default is "string")."""


def _names(node: jinja2.nodes.Node, name: str) -> bool:
    """Whether `node` loads the variable `name`; a dotted name is a namespace attribute."""
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _names(node.node, base)
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (or `name[key]` / `name.key`), possibly filtered, tested or
    sliced: what vLLM counts as the variable or its elements."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _names(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _names(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _names(node.node, name)
    return False


def _dotted(node: jinja2.nodes.Node) -> str | None:
    """An attribute assignment's target (`ns.rest`) as a dotted name."""
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return ".".join([node.name, *reversed(attrs)])
    return None


def _aliases(tree: jinja2.nodes.Template, root: str) -> list[str]:
    """`root` and every name a `set` binds to it or its elements, transitively."""
    found = [root]
    queue = [root]
    while queue:
        name = queue.pop(0)
        for assign in tree.find_all(jinja2.nodes.Assign):
            target, value = assign.target, assign.node
            bound: list[str] = []
            if isinstance(target, jinja2.nodes.Name):
                if _reads(value, name):
                    bound.append(target.name)
                elif (
                    isinstance(value, jinja2.nodes.Call)
                    and isinstance(value.node, jinja2.nodes.Name)
                    and value.node.name == "namespace"
                ):
                    bound += [
                        f"{target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, name)
                    ]
            elif isinstance(target, jinja2.nodes.Getattr | jinja2.nodes.NSRef) and _reads(
                value, name
            ):
                dotted = _dotted(target)
                if dotted is not None:
                    bound.append(dotted)
            for alias in bound:
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _loop_name(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise _UnnamedLoopTarget
    return loop.target.name


def _message_names(tree: jinja2.nodes.Template) -> list[str]:
    """The loop variables of every loop over the messages (or an alias of them)."""
    lists = _aliases(tree, "messages")
    return [
        _loop_name(loop)
        for loop in tree.find_all(jinja2.nodes.For)
        if any(_reads(loop.iter, name) for name in lists)
    ]


def _macro_content_params(
    tree: jinja2.nodes.Template, messages: list[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """For each loop inside a macro (by id), the macro's parameters that some call passes a
    message's content; and the ids of all loops inside macros."""

    def is_content(arg: jinja2.nodes.Node) -> bool:
        return any(_reads(arg, name, "content") for name in messages)

    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        content_params: set[str] = set()
        for call in tree.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            content_params |= {
                params[i] for i, arg in enumerate(call.args[: len(params)]) if is_content(arg)
            }
            content_params |= {
                kw.key
                for kw in call.kwargs
                if isinstance(kw, jinja2.nodes.Keyword)
                and kw.key in params
                and is_content(kw.value)
            }
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    return params_by_loop, in_macros


def _content_loops(tree: jinja2.nodes.Template) -> Iterator[str]:
    """The loop variable of each loop over a message's content parts, in template order."""
    messages = _message_names(tree)
    params_by_loop, in_macros = _macro_content_params(tree, messages)
    for loop in tree.find_all(jinja2.nodes.For):
        if _iterates_content(loop, messages, params_by_loop, in_macros):
            yield _loop_name(loop)


def _iterates_content(
    loop: jinja2.nodes.For,
    messages: list[str],
    params_by_loop: dict[int, set[str]],
    in_macros: set[int],
) -> bool:
    over = loop.iter
    if any(_reads(over, name, "content") for name in messages):
        return True
    return isinstance(over, jinja2.nodes.Name) and (
        over.name in params_by_loop.get(id(loop), ())
        or (id(loop) not in in_macros and over.name == "content")
    )


def vllm_content_format(source: str, tree: jinja2.nodes.Template | None) -> ContentFormat:
    """vLLM's rule: "openai" when its walk finds a loop over a message's content parts."""
    if tree is None:
        return "string"
    try:
        next(_content_loops(tree))
    except (StopIteration, _UnnamedLoopTarget):
        return "string"
    return "openai"


CONTENT_FORMAT_RULES: dict[str, ContentFormatRule] = {
    "sglang": sglang_content_format,
    "vllm": vllm_content_format,
}
