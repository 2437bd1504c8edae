"""The package layering of DESIGN.md section 1, enforced on every import statement.

Inside `router`, the packages are layers, lowest first (`ROUTER_LAYERS`): a module imports its
own layer and the ones below it, never one above, so the prompt and routing cores know nothing
of HTTP or the command line, and a new top-level module must be given its place here. The CLI's
verb table names modules it imports by string; those are checked as imports of the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from router.commands.cli import VERBS

ROOT = Path(__file__).resolve().parent.parent
OURS = ("indexer", "workers", "router", "bench")
ROUTER_LAYERS = (
    "router.errors",
    "router.config",
    "router.config_diff",  # what a reload changes (pure)
    "router.prompt",  # request body -> tokens: parsing, tokenizer, chat templates, conventions
    "router.routing",  # the decision: planner, policies, load, pool, breakers
    "router.late_timeout",  # a timeout the router's own stall expired (asyncio's clock only)
    "router.fleet",  # membership, discovery, health
    "router.cluster",  # replicas as one router: decisions, fleet state, snapshots on NATS
    "router.http",  # the aiohttp application, proxy, admin API, metrics
    "router.service",  # a whole router as one async context
    "router.commands",  # the kvroute verbs
)
# within router.prompt, lowest first: chat_template never reaches back into request
PROMPT_ORDER = (
    "router.prompt.nesting",
    "router.prompt.messages",
    "router.prompt.conventions",
    "router.prompt.chat_template",
    "router.prompt.tokenizer",
    "router.prompt.dp_rank",
    "router.prompt.request",
)
# synchronous cores (DESIGN.md section 1): no event loop, no sockets, no HTTP
SYNC_CORES = ("router.prompt", "router.routing")
INDEXER_SYNC_CORES = (
    "indexer.engines",
    "indexer.fence",
    "indexer.health",
    "indexer.index",
    "indexer.log_throttle",
    "indexer.namespace",
    "indexer.protocol",
    "indexer.recording.format",
    "indexer.recording.replay",
    "indexer.sequence",
    "indexer.snapshot",
    "indexer.worker_matches",
)
# the pure index and the wire protocol know nothing of streams, sockets or recordings
INDEXER_FOUNDATIONS = ("indexer.index", "indexer.protocol")
INDEXER_ABOVE_FOUNDATIONS = (
    "indexer.stream",
    "indexer.subscriptions",
    "indexer.service",
    "indexer.sink",
    "indexer.replay_client",
    "indexer.recording",
    "indexer.worker_matches",
    "indexer.snapshot",
)
# what the reference workers may use of the indexer: the wire protocol and the engine specs
WORKERS_MAY_IMPORT = ("indexer.protocol", "indexer.engines")
IO_LIBRARIES = ("aiohttp", "asyncio", "zmq")
# router reaches the reference workers and the benchmarks only from the verbs that start them
ROUTER_MAY_IMPORT = {
    "workers": {"router.commands.cli", "router.commands.up"},
    "bench": {"router.commands.cli"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: relative imports hide the layering; import absolutely")
    # importlib.import_module("x.y") with a literal also counts
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return names


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _position(name: str, order: tuple[str, ...]) -> int | None:
    return next((i for i, prefix in enumerate(order) if _within(name, prefix)), None)


def _router_violation(module: str, imported: str) -> str | None:
    """The rule `module` (in router) breaks by importing `imported` (in router), if any."""
    src, dst = _position(module, ROUTER_LAYERS), _position(imported, ROUTER_LAYERS)
    if dst is None:
        return f"{imported} is in no router layer (ROUTER_LAYERS)"
    if src is None:
        return "the router package itself imports nothing"
    if dst > src:
        return f"{ROUTER_LAYERS[src]} may not import {ROUTER_LAYERS[dst]}, a layer above it"
    here, there = _position(module, PROMPT_ORDER), _position(imported, PROMPT_ORDER)
    if here is not None and there is not None and there >= here and not _within(imported, module):
        return f"{PROMPT_ORDER[here]} may import only the prompt modules before it"
    return None


def _violations(module: str, imported: str) -> str | None:
    top = imported.split(".")[0]
    package = module.split(".")[0]
    if top in IO_LIBRARIES:
        if any(_within(module, core) for core in (*SYNC_CORES, *INDEXER_SYNC_CORES)):
            return f"{module} is synchronous: no {top}"
        return None
    if top not in OURS:
        return None
    if package == "indexer" and top in ("router", "workers", "bench"):
        return "indexer imports nothing of ours outside indexer"
    if any(_within(module, low) for low in INDEXER_FOUNDATIONS) and any(
        _within(imported, high) for high in INDEXER_ABOVE_FOUNDATIONS
    ):
        return f"{module} is a foundation: it imports nothing of streams or recordings"
    if (
        package == "workers"
        and top != "workers"
        and not any(_within(imported, allowed) for allowed in WORKERS_MAY_IMPORT)
    ):
        return f"workers may import only {', '.join(WORKERS_MAY_IMPORT)}"
    if package == "router" and top in ROUTER_MAY_IMPORT:
        if module not in ROUTER_MAY_IMPORT[top]:
            return f"router imports {top} only from {sorted(ROUTER_MAY_IMPORT[top])}"
        return None
    if package == "router" and top == "router":
        return _router_violation(module, imported)
    return None


def _sources() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_layering(path: Path) -> None:
    module = _module_name(path)
    bad = [
        f"{imported}: {reason}"
        for imported in _imports(path)
        if (reason := _violations(module, imported)) is not None
    ]
    assert not bad, f"{module} breaks the layering:\n" + "\n".join(bad)


def test_the_checker_catches_violations() -> None:
    assert _violations("indexer.index", "router.http.app") is not None
    assert _violations("indexer.index", "workers.cache") is not None
    assert _violations("workers.cache", "indexer.index") is not None
    assert _violations("workers.cache", "router.config") is not None
    assert _violations("workers.cache", "indexer.protocol.events") is None
    assert _violations("workers.server", "indexer.engines.SGLANG") is None
    # the indexer's pure parts stay pure and below the stream machinery
    assert _violations("indexer.index.writer", "asyncio") is not None
    assert _violations("indexer.recording.format", "zmq") is not None
    assert _violations("indexer.index.prefix_index", "indexer.stream.subscriber") is not None
    assert _violations("indexer.protocol.decode", "indexer.recording.format") is not None
    assert _violations("indexer.stream.subscriber", "zmq.asyncio") is None
    assert _violations("indexer.stream.state", "indexer.index") is None
    assert _violations("router.routing.policy", "workers.cache") is not None
    assert _violations("router.commands.cli", "workers.command") is None
    assert _violations("router.commands.serve", "workers.fleet") is not None
    assert _violations("router.commands.cli", "bench.command") is None
    assert _violations("router.commands.up", "bench.harness") is not None
    assert _violations("router.http.app", "indexer.index") is None
    # layers: downwards only
    assert _violations("router.http.proxy", "router.routing.planner.Planner") is None
    assert _violations("router.routing.planner", "router.prompt.request") is None
    assert _violations("router.prompt.request", "router.routing.namespace") is not None
    assert _violations("router.prompt.request", "router.http.intake") is not None
    assert _violations("router.routing.planner", "router.http.metrics") is not None
    assert _violations("router.routing.pool", "router.commands.cli") is not None
    assert _violations("router.fleet.supervisor", "router.http.metrics") is not None
    assert _violations("router.cluster.service", "router.fleet.supervisor") is None
    assert _violations("router.cluster.peers", "router.http.app") is not None
    assert _violations("router.http.app", "router.cluster.service") is None
    assert _violations("router.routing.planner", "router.cluster.outbox") is not None
    assert _violations("router.config", "router.prompt.tokenizer") is not None
    assert _violations("router.service", "router.commands.serve") is not None
    assert _violations("router.commands.serve", "router.service") is None
    assert _violations("router.http.app", "router.scheduler") is not None  # in no layer
    # inside the prompt package: the request <-> tokenizer <-> chat_template circle stays broken
    assert _violations("router.prompt.request", "router.prompt.conventions.chat_options") is None
    assert _violations("router.prompt.chat_template", "router.prompt.request") is not None
    assert _violations("router.prompt.conventions", "router.prompt.chat_template") is not None
    assert _violations("router.prompt.tokenizer", "router.prompt.request") is not None
    # synchronous cores
    assert _violations("router.routing.policy", "aiohttp.web") is not None
    assert _violations("router.prompt.tokenizer", "asyncio") is not None
    assert _violations("router.http.proxy", "aiohttp.web") is None


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_the_cli_verb_table_names_modules_that_exist_and_may_be_imported(verb: str) -> None:
    module = VERBS[verb][0]
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"kvroute {verb}: no module {module}"
    reason = _violations("router.commands.cli", module)
    assert reason is None, f"kvroute {verb}: {module}: {reason}"


@pytest.mark.parametrize(
    "path",
    sorted(p for pkg in ("router", "indexer") for p in (ROOT / pkg).rglob("__init__.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_packages_say_what_lives_where(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{path}: the docstring says what lives where"
    if path.is_relative_to(ROOT / "router"):
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        assert not imports, f"{path} imports nothing, so kvroute --help stays light"
