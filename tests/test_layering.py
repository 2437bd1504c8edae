"""The package layering of DESIGN.md section 1, enforced on every import statement."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("indexer", "workers", "router", "bench")
# router may start embedded workers only from its CLI verbs
ROUTER_MODULES_ALLOWED_WORKERS = {
    "router.commands.cli",
    "router.commands.up",
    "router.commands.serve",
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


def _violations(module: str, imported: str) -> str | None:
    top = imported.split(".")[0]
    if top not in OURS:
        return None
    package = module.split(".")[0]
    if package == "indexer" and top in ("router", "workers", "bench"):
        return "indexer imports nothing of ours outside indexer"
    if package == "workers" and top != "workers" and not imported.startswith("indexer.protocol"):
        return "workers may import only indexer.protocol"
    if package == "router" and top == "bench":
        return "router never imports bench"
    if package == "router" and top == "workers" and module not in ROUTER_MODULES_ALLOWED_WORKERS:
        return "router imports workers only from its CLI verbs"
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
    assert _violations("router.routing.policy", "workers.cache") is not None
    assert _violations("router.commands.cli", "workers.command") is None
    assert _violations("router.http.app", "indexer.index") is None
