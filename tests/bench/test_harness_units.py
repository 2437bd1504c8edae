"""Pieces of the benchmark runner and suite: the oracle, failed requests, rate from load."""

from __future__ import annotations

import argparse
from pathlib import Path

import aiohttp
import msgspec
import pytest

from bench.harness import (
    KV_DEFAULT,
    POLICIES,
    FleetSpec,
    PolicyWeights,
    Target,
    _fleet,
    _Oracle,
    _shared_pages,
    send_generate,
)
from bench.routing_bench import (
    WORKLOADS,
    _command,
    add_arguments,
    build_workloads,
    rate_for_load,
    settings_from_args,
)
from bench.workloads import SEED_INDEPENDENT, BenchRequest
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker


def test_shared_pages_counts_whole_common_pages_without_the_last_token() -> None:
    a = list(range(100))
    assert _shared_pages(a, a, 16) == 96  # 99 matchable tokens -> 6 whole pages
    assert _shared_pages(a, a[:40], 16) == 32  # the other prompt cached 2 whole pages
    b = [*a[:20], -1, *a[21:]]
    assert _shared_pages(a, b, 16) == 16
    assert _shared_pages(a, [7, *a[1:]], 16) == 0
    assert _shared_pages([1], [1], 16) == 0


def _settings(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # without sglang-router whatever the environment says (its own tests cover it)
    return parser.parse_args(["--sglang-router-python", "/nonexistent/python", *argv])


def test_rate_from_load_fills_the_stated_share_of_prefill_capacity() -> None:
    settings = settings_from_args(_settings("--quick", "--workloads", "shared_prefix"))
    (workload,) = build_workloads(settings)
    fleet = FleetSpec(workers=2, prefill_ms_per_token=0.5, time_scale=0.2)
    rate = rate_for_load(workload, fleet, 1.0)
    mean_prompt = workload.prompt_tokens / len(workload.requests)
    # offered prefill seconds per second, spread over the workers, is the load
    assert rate * mean_prompt * 0.5 * 0.2 / 1000.0 / 2 == pytest.approx(1.0)
    assert workload.params["rate_rps"] == pytest.approx(
        rate_for_load(workload, settings.fleet, settings.load)
    )


def test_what_a_seed_changes_is_what_the_reports_say_it_changes() -> None:
    # `--seeds` reports call a seed-independent workload one trace replayed and every other one
    # a workload of its own per seed: both halves must hold of the workloads the suite builds
    def requests(seed: int) -> dict[str, list[BenchRequest]]:
        settings = settings_from_args(_settings("--quick", "--seed", str(seed)))
        return {w.name: w.requests for w in build_workloads(settings)}

    one, two = requests(1), requests(2)
    assert set(one) == set(WORKLOADS)
    assert {name for name in WORKLOADS if one[name] == two[name]} == SEED_INDEPENDENT


def test_bad_command_lines_are_refused() -> None:
    with pytest.raises(SystemExit, match="workloads"):
        settings_from_args(_settings("--workloads", "nope"))
    with pytest.raises(SystemExit, match="pressures"):
        settings_from_args(_settings("--pressures", "0"))
    fixed = settings_from_args(_settings("--quick", "--rate", "5", "--workloads", "mooncake"))
    (workload,) = build_workloads(fixed)
    assert workload.params["rate_rps"] == 5.0


async def test_an_overlapping_fleet_is_asked_for_echoed_and_built() -> None:
    settings = settings_from_args(_settings("--quick", "--overlap-schedule"))
    assert settings.fleet.overlap_schedule
    assert "--overlap-schedule" in _command(settings, Path("out"))
    assert "overlap" not in _command(settings_from_args(_settings("--quick")), Path("out"))
    spec = msgspec.structs.replace(settings.fleet, workers=1, capacity_tokens=1024, time_scale=0)
    async with _fleet(spec) as fleet:
        (worker,) = fleet.values()
        assert worker.config.overlap_schedule


def test_a_kv_weight_override_runs_beside_the_defaults_and_is_echoed() -> None:
    settings = settings_from_args(_settings("--quick", "--kv-eviction-weight", "1"))
    assert settings.weights == PolicyWeights(eviction_weight=1.0)
    assert settings.policies[:2] == ("kv", KV_DEFAULT)
    assert "--kv-eviction-weight 1" in _command(settings, Path("out"))
    plain = settings_from_args(_settings("--quick"))
    assert KV_DEFAULT not in plain.policies and "eviction" not in _command(plain, Path("out"))
    with pytest.raises(SystemExit, match="--kv-eviction-weight must be >= 0"):
        settings_from_args(_settings("--kv-eviction-weight", "-1"))


async def test_oracle_follows_the_cache_and_its_own_in_flight_requests() -> None:
    config = WorkerConfig(page_size=16, capacity_tokens=4096, time_scale=0.0)
    prompt = BenchRequest(arrival_s=0, input_ids=list(range(3, 103)), max_new_tokens=2)
    sibling = BenchRequest(arrival_s=0, input_ids=[*range(3, 83), 200, 201], max_new_tokens=2)
    salted = msgspec.structs.replace(sibling, cache_salt="other-tenant")
    async with (
        ReferenceWorker(config) as a,
        ReferenceWorker(config) as b,
        aiohttp.ClientSession() as session,
    ):
        done = await send_generate(session, Target(url=b.url), prompt, 0, 0.0, 10.0)
        assert done.ok and done.cached_tokens == 0
        oracle = _Oracle([a.url, b.url], page_size=16, seed=1)
        # b holds the first 80 tokens (5 pages) in the unsalted namespace
        chosen = await oracle.choose(session, sibling)
        assert chosen.url == b.url and chosen.route_s is not None
        oracle.release(chosen)
        # another salt never matches there: a tie, broken towards the idle worker a
        other = await oracle.choose(session, salted)
        assert other.url == a.url
        # a fresh salted sibling follows the in-flight salted request to a, although b is idler
        again = await oracle.choose(session, msgspec.structs.replace(salted, max_new_tokens=3))
        assert again.url == a.url
        for target in (other, again):
            oracle.release(target)
        record = await send_generate(session, chosen, sibling, 1, 0.0, 10.0)
        assert record.ok and record.cached_tokens == 80


async def test_oracle_ranks_by_the_hit_a_request_gets_not_the_whole_prompts_match() -> None:
    """A worker that holds all of a page-aligned prompt gives it no more than one that holds
    all but its last page (the last token is always computed): the two tie and the idler one
    wins. The oracle ranked on /debug/match's whole-prompt match and sent it to the busier."""
    config = WorkerConfig(page_size=16, capacity_tokens=4096, time_scale=0.0)
    prompt = BenchRequest(arrival_s=0, input_ids=list(range(3, 67)), max_new_tokens=1)
    near = msgspec.structs.replace(prompt, input_ids=[*range(3, 51), *range(150, 166)])
    other = BenchRequest(arrival_s=0, input_ids=list(range(100, 140)), max_new_tokens=1)
    async with (
        ReferenceWorker(config) as a,
        ReferenceWorker(config) as b,
        aiohttp.ClientSession() as session,
    ):
        for url, request in ((b.url, prompt), (b.url, other), (a.url, near)):
            assert (await send_generate(session, Target(url=url), request, 0, 0.0, 10.0)).ok
        oracle = _Oracle([a.url, b.url], page_size=16, seed=1)
        busy = await oracle.choose(session, other)  # b's own: one in flight there
        assert busy.url == b.url
        # b holds 64 tokens of it, a 48: a request reuses 48 on either
        chosen = await oracle.choose(session, prompt)
        assert chosen.url == a.url
        record = await send_generate(session, chosen, prompt, 1, 0.0, 10.0)
        assert record.ok and record.cached_tokens == 48


async def test_a_dead_worker_is_a_failed_record_not_a_crash() -> None:
    async with ReferenceWorker(WorkerConfig(time_scale=0.0)) as worker:
        url = worker.url
    # the worker is gone: its port refuses connections
    request = BenchRequest(arrival_s=0, input_ids=[5, 6, 7], max_new_tokens=1)
    async with aiohttp.ClientSession() as session:
        record = await send_generate(session, Target(url=url), request, 0, 0.0, 5.0)
    assert not record.ok and "Connect" in record.error


def test_kv_default_joins_only_when_the_weights_are_overridden() -> None:
    assert settings_from_args(_settings()).policies == POLICIES
    tuned = settings_from_args(_settings("--kv-hit-weight", "4"))
    assert tuned.policies[:2] == ("kv", KV_DEFAULT) and set(POLICIES) <= set(tuned.policies)
    assert tuned.weights.hit_weight == 4.0 and tuned.weights.decode_weight is None
    chosen = settings_from_args(_settings("--kv-hit-weight", "4", "--policies", "kv,oracle"))
    assert chosen.policies == ("kv", "oracle")
    with pytest.raises(SystemExit, match="kv-hit-weight"):
        settings_from_args(_settings("--kv-hit-weight", "-1"))
