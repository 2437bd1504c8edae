"""The sglang-router external baseline: skipped with a note without it, runs for real with it.

The live tests need a python that can import `sglang_router` (SGLang's Rust router from PyPI):
the one `KVROUTE_SGLANG_ROUTER_PYTHON` names, else the benchmarks' own venv. `.ci/run` makes that
venv before the tests (`bench.sglang_router.provision`); where it cannot (offline, no wheel),
they are skipped with the reason.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from bench import sglang_router
from bench.harness import POLICIES, SGLANG_CACHE_AWARE, FleetSpec, run_policy
from bench.isolation import workload_violations
from bench.routing_bench import _command, _notes, add_arguments, settings_from_args
from bench.workloads import BenchRequest, Workload

_PYTHON = sglang_router.installed() or ""
_HAVE = bool(_PYTHON)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_provision_reuses_the_bench_venv_and_says_why_it_cannot_make_one(tmp_path: Path) -> None:
    missing = "/nonexistent/bin/python"
    # a venv whose python imports a stand-in sglang_router: found, no pip run
    (tmp_path / "lib" / "sglang_router").mkdir(parents=True)
    (tmp_path / "lib" / "sglang_router" / "__init__.py").write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "lib"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    found, where = sglang_router.provision(missing, venv=venv)
    assert found == str(python) and "venv" in where and missing in where
    # a venv that cannot be made (its parent is a file): None and the reason, nothing raised
    (tmp_path / "file").write_text("")
    found, why = sglang_router.provision(missing, venv=tmp_path / "file" / "venv")
    assert found is None and "failed" in why and "--sglang-router-python" in why


def test_a_python_without_sglang_router_skips_the_baseline_with_a_note() -> None:
    missing = "/nonexistent/bin/python"
    assert not sglang_router.importable(missing)
    settings = settings_from_args(_args("--sglang-router-python", missing))
    assert settings.policies == POLICIES and settings.sglang_router_python is None
    named = settings_from_args(
        _args("--sglang-router-python", missing, "--policies", f"kv,{SGLANG_CACHE_AWARE}")
    )
    assert named.policies == ("kv",)
    (note,) = [n for n in _notes(settings) if SGLANG_CACHE_AWARE in n and "skipped" in n]
    assert missing in note and "read against `approx_tree`" in note
    unchosen = settings_from_args(
        _args("--sglang-router-python", missing, "--policies", "kv,oracle")
    )
    assert not [n for n in _notes(unchosen) if SGLANG_CACHE_AWARE in n and "skipped" in n]
    assert "--sglang-router-python" not in _command(unchosen, Path("out"))


@pytest.mark.skipif(
    not _HAVE,
    reason="no python at hand imports sglang_router (KVROUTE_SGLANG_ROUTER_PYTHON, the bench venv)",
)
def test_the_baseline_joins_beside_approx_tree_and_is_echoed_in_the_command() -> None:
    settings = settings_from_args(_args("--quick", "--sglang-router-python", _PYTHON))
    order = list(settings.policies)
    assert order.index(SGLANG_CACHE_AWARE) == order.index("approx_tree") + 1
    assert set(order) == {*POLICIES, SGLANG_CACHE_AWARE}
    assert f"--sglang-router-python {_PYTHON}" in _command(settings, Path("out"))
    assert any("cache_salt" in n and "isolation violations" in n for n in _notes(settings))


@pytest.mark.skipif(
    not _HAVE,
    reason="no python at hand imports sglang_router (KVROUTE_SGLANG_ROUTER_PYTHON, the bench venv)",
)
async def test_sglang_cache_aware_drops_the_salt_and_is_counted_as_violating(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shared = list(range(3, 3 + 64))  # 4 pages, the same text for both tenants
    requests = [
        BenchRequest(arrival_s=0.0, input_ids=[*shared, 200], max_new_tokens=2, cache_salt="a"),
        BenchRequest(arrival_s=0.3, input_ids=[*shared, 201], max_new_tokens=2, cache_salt="a"),
        BenchRequest(arrival_s=0.6, input_ids=[*shared, 202], max_new_tokens=2, cache_salt="b"),
    ]
    workload = Workload(
        name="tiny", description="two tenants, one prompt", seed=0, params={}, requests=requests
    )
    spec = FleetSpec(workers=2, capacity_tokens=4096, time_scale=0.0)
    run = await run_policy(SGLANG_CACHE_AWARE, workload, spec, seed=1, sglang_router_python=_PYTHON)
    assert [r.ok for r in run.records] == [True, True, True], [r.error for r in run.records]
    cached = [r.cached_tokens for r in run.records]
    # the router is salt-blind and sends all three to one worker (same text, the tree matches),
    # and drops the salt on /generate: tenant b gets tenant a's pages
    assert cached == [0, 64, 64]
    workload_violations(workload.requests, run.records, spec.page_size)
    assert [r.violation_tokens for r in run.records] == [0, 0, 64]
    assert run.route_overhead_s
    # it keeps the salt on /v1/completions only
    probes = {p.endpoint: p for p in run.isolation}
    assert probes["/v1/completions"].violating == 0 and probes["/v1/completions"].requests
    assert not any(p.errors for p in run.isolation), [p.error for p in run.isolation]
    assert probes["/generate"].violating > 0 and probes["/v1/chat/completions"].violating > 0
    # its HTTP/2 probe of each worker at registration is expected, not a bad request to report;
    # and nothing it sent afterwards was refused by a worker
    refused = [r.getMessage() for r in caplog.records if r.name == "workers.listener"]
    assert not refused, refused


def test_dp_aware_listings_count_as_their_worker() -> None:
    # --dp-aware lists one entry per rank, `URL@rank`
    listed = {"workers": [{"url": "http://h:1@0"}, {"url": "http://h:1@1"}, {"url": "http://g:2/"}]}
    assert sglang_router._registered(listed) == {"http://h:1", "http://g:2"}


def test_an_install_that_cannot_happen_says_why(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    python, why = sglang_router.provision("/nonexistent/python", blocked / "venv")
    assert python is None and "venv" in why
