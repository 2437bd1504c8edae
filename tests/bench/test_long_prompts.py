"""`kvroute bench proxy`'s long-prompt scenario: real SGLang `/generate` bodies through a real
router to a real reference worker."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from bench import sglang_router
from bench.proxy_bench import _SGLANG_CACHE_AWARE, _long_prompt_section, long_prompts
from router.service import RouterService
from tests.router.conftest import router_config
from workers.config import WorkerConfig as ReferenceConfig
from workers.worker import ReferenceWorker


def test_the_prompts_share_a_system_prompt_and_split_over_two_tenants() -> None:
    request = long_prompts(256, documents=4)
    assert request.path == "/generate"
    bodies = [msgspec.json.decode(b) for b in request.bodies]
    ids = [b["input_ids"] for b in bodies]
    assert [len(i) for i in ids] == [256] * 4
    assert all(i[:128] == ids[0][:128] for i in ids)  # the shared system prompt
    assert len({tuple(i[128:]) for i in ids}) == 4  # each its own document
    assert [b["cache_salt"] for b in bodies] == ["tenant-0", "tenant-1"] * 2
    assert all(b["sampling_params"] == {"max_new_tokens": 1} for b in bodies)


async def test_the_section_measures_direct_and_the_router_without_errors() -> None:
    args = argparse.Namespace(
        deadline_s=20.0,
        throughput_requests=400,
        concurrency=4,
        rounds=2,
        latency_requests=50,
        long_prompt_tokens=512,
        sglang_router_found=(None, "--skip-sglang-router"),
    )
    notes: list[str] = []
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as worker,
        RouterService(router_config([("w0", worker.url)])) as router,
    ):
        section = await _long_prompt_section(args, worker.url, router.url, notes)
    assert set(section.rates) == {"direct", "kvroute"}
    assert all(rate > 0 for rate in section.rates.values())
    rows = {row.split(" | ")[0].lstrip("| "): row.split(" | ") for row in section.tput_rows}
    assert rows["direct"][2] == "0" and rows["kvroute"][2] == "0"  # no errors
    assert section.concurrency == 4 and section.requests == 60  # a tenth, at least 60
    assert "512-token prompts" in section.title
    assert notes == ["sglang-router not measured on long prompts: --skip-sglang-router"]


@pytest.mark.skipif(
    not sglang_router.installed(),
    reason="no python at hand imports sglang_router (KVROUTE_SGLANG_ROUTER_PYTHON, the bench venv)",
)
async def test_sglang_routers_cpu_per_long_prompt_is_counted() -> None:
    # the section once launched sglang-router without registering its process: its CPU was "-"
    python = sglang_router.installed()
    assert python
    args = argparse.Namespace(
        deadline_s=20.0,
        throughput_requests=400,
        concurrency=4,
        rounds=2,
        latency_requests=50,
        long_prompt_tokens=512,
        sglang_router_found=(python, "this test"),
    )
    notes: list[str] = []
    async with (
        ReferenceWorker(ReferenceConfig(time_scale=0.0, page_size=16)) as worker,
        RouterService(router_config([("w0", worker.url)])) as router,
    ):
        section = await _long_prompt_section(args, worker.url, router.url, notes)
    assert section.rates[_SGLANG_CACHE_AWARE] > 0
    # counted (a key: its process is known), whatever it measured: a few hundred requests
    # may take less CPU than one /proc tick (10 ms), and read 0 (CI did, once)
    assert _SGLANG_CACHE_AWARE in section.cpu_us, section.cpu_us
    row = next(r for r in section.tput_rows if r.startswith(f"| {_SGLANG_CACHE_AWARE} |"))
    assert not row.rstrip(" |").endswith("-"), row
