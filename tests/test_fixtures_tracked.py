"""Every fixture the tests read must reach a clean clone.

A fixture caught by a `.gitignore` pattern passes every local run and fails CI, which tests a
fresh clone (this happened to `tests/fixtures/recordings/version1.kvrec`, under `*.kvrec`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def test_no_fixture_is_ignored_by_git() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = sorted(str(p.relative_to(ROOT)) for p in FIXTURES.rglob("*") if p.is_file())
    assert files, "no fixtures found"
    # check-ignore exits 1 when no path is ignored, 0 when some are (and prints them)
    done = subprocess.run(
        [git, "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(files),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    assert done.stdout.split() == [], "fixtures a clean clone would not have"
