"""Links between the docs resolve: every relative link in README.md and docs/*.md names a file
that exists and, with a `#fragment`, a heading of that file (GitHub's anchor of it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of `path`'s headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated one suffixed `-1`, `-2`..."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if fenced or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative links of `path`, outside fenced code."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [
        link for link in _LINK.findall(text) if not link.startswith(("http:", "https:", "mailto:"))
    ]


def test_the_anchor_rule_is_githubs() -> None:
    page = ROOT / "README.md"
    assert "running-several-replicas" in anchors(page)  # "## Running several replicas"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_its_file_and_heading(doc: Path) -> None:
    broken: list[str] = []
    for link in links(doc):
        target, _, fragment = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{link}: no such heading")
    assert not broken, broken


_CONFLICT = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_merge_conflict_is_left_in_a_doc(doc: Path) -> None:
    """A merge of two branches left both sides of a table row in docs/router.md, with git's
    markers, and the suite said nothing."""
    found = _CONFLICT.search(doc.read_text())
    assert found is None, f"{doc.name}: a merge conflict marker: {found.group(0)!r}"
