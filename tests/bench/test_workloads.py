"""The benchmark workloads: seeded, shaped as documented, and honest about KV pressure."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from bench.workloads import (
    BenchRequest,
    MooncakeParams,
    MultiTenantParams,
    SharedPrefixParams,
    TraceRow,
    WorkloadError,
    capacity_for_pressure,
    kv_pressure,
    load_trace,
    mooncake_replay,
    multi_tenant,
    poisson_arrivals,
    shared_prefix,
    synthesize_mooncake_trace,
    working_set_tokens,
    write_trace,
)
from indexer.protocol.tokens import BOS_TOKEN_ID, BYTE_OFFSET, VOCAB_SIZE

SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_sample.jsonl"
SMALL_MT = MultiTenantParams(
    tenants=5,
    shared_prompt_tenants=3,
    system_prompt_tokens=200,
    conversations_per_tenant=3,
    turns=3,
    user_tokens=40,
    assistant_tokens=20,
    rate_rps=50.0,
    min_turn_gap_s=0.2,
)


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def test_same_seed_same_workload_other_seed_differs() -> None:
    assert multi_tenant(SMALL_MT, 3) == multi_tenant(SMALL_MT, 3)
    assert multi_tenant(SMALL_MT, 3).requests != multi_tenant(SMALL_MT, 4).requests
    sp = SharedPrefixParams(groups=3, prefix_tokens=100, users_per_group=2, questions_per_user=2)
    assert shared_prefix(sp, 1) == shared_prefix(sp, 1)
    assert shared_prefix(sp, 1).requests != shared_prefix(sp, 2).requests


def test_multi_tenant_shape() -> None:
    w = multi_tenant(SMALL_MT, 11)
    reqs = w.requests
    assert len(reqs) == 5 * 3 * 3
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    # one salt per tenant, distinct across tenants, never empty
    salts: dict[str, str | None] = {}
    for r in reqs:
        assert r.cache_salt
        assert salts.setdefault(r.tenant, r.cache_salt) == r.cache_salt
    assert len(set(salts.values())) == 5
    # every token is a byte token after BOS (chat prompt)
    for r in reqs:
        assert r.input_ids[0] == BOS_TOKEN_ID
        assert all(BYTE_OFFSET <= t < VOCAB_SIZE for t in r.input_ids[1:])
    # turns of one conversation: in order, spaced by the think time, each a strict prefix
    # extension of the previous one
    by_session: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 15
    for turns in by_session.values():
        assert len(turns) == 3
        for earlier, later in itertools.pairwise(turns):
            assert _is_prefix(earlier.input_ids, later.input_ids)
            assert later.arrival_s - earlier.arrival_s >= SMALL_MT.min_turn_gap_s - 1e-9


def test_multi_tenant_identical_system_prompts_across_salts() -> None:
    """The false-hit trap: same system prompt tokens, different salts."""
    w = multi_tenant(SMALL_MT, 5)
    first: dict[str, list[int]] = {}
    for r in w.requests:
        first.setdefault(r.tenant, r.input_ids[:200])
    shared = {first[f"t{t}"][:150].__repr__() for t in range(3)}
    own = {first[f"t{t}"][:150].__repr__() for t in range(3, 5)}
    assert len(shared) == 1
    assert len(own) == 2 and not (own & shared)


def test_shared_prefix_shape() -> None:
    sp = SharedPrefixParams(
        groups=4, prefix_tokens=300, users_per_group=3, questions_per_user=2, question_tokens=20
    )
    w = shared_prefix(sp, 9)
    assert len(w.requests) == 4 * 3 * 2
    groups: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        assert r.cache_salt is None
        assert len(r.input_ids) == 1 + 300 + 1 + 20
        groups.setdefault(r.tenant, []).append(r)
    assert len(groups) == 4
    heads = {tuple(rs[0].input_ids[:301]) for rs in groups.values()}
    assert len(heads) == 4
    for rs in groups.values():
        assert {tuple(r.input_ids[:301]) for r in rs} == {tuple(rs[0].input_ids[:301])}


def test_poisson_rate_is_close_to_stated() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    times = poisson_arrivals(4000, 25.0, random.Random(seed))
    assert times[0] == 0.0
    rate = (len(times) - 1) / times[-1]
    assert 23.0 < rate < 27.0


def test_sample_trace_loads_and_is_what_the_generator_makes(tmp_path: Path) -> None:
    rows = load_trace(SAMPLE)
    assert rows == synthesize_mooncake_trace(7)
    out = tmp_path / "t.jsonl"
    write_trace(rows, out)
    assert out.read_bytes() == SAMPLE.read_bytes()


def test_mooncake_replay_shares_prefixes_by_hash_id() -> None:
    rows = [
        TraceRow(timestamp=0, input_length=1024, output_length=10, hash_ids=[1, 2]),
        TraceRow(timestamp=2000, input_length=1500, output_length=999, hash_ids=[1, 2, 3]),
        TraceRow(timestamp=1000, input_length=300, output_length=5, hash_ids=[7]),
    ]
    w = mooncake_replay(rows, MooncakeParams(replay_block_tokens=16, rate_rps=None), 0)
    a, c, b = w.requests  # sorted by timestamp
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 2.0]
    assert len(a.input_ids) == 32 and len(b.input_ids) == 47 and len(c.input_ids) == 10
    assert b.input_ids[:32] == a.input_ids
    assert c.input_ids != a.input_ids[:10]
    assert b.max_new_tokens == 32 and a.max_new_tokens == 10
    rescaled = mooncake_replay(rows, MooncakeParams(replay_block_tokens=16, rate_rps=4.0), 0)
    assert rescaled.requests[-1].arrival_s == pytest.approx(0.5)


def test_bad_trace_lines_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"x"')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        load_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(WorkloadError, match=r":1:"):
        load_trace(bad)


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(WorkloadError, match="tenants"):
        MultiTenantParams(tenants=0)
    with pytest.raises(WorkloadError, match="shared_prompt_tenants"):
        MultiTenantParams(tenants=2, shared_prompt_tenants=3)
    with pytest.raises(WorkloadError, match="rate_rps"):
        SharedPrefixParams(rate_rps=0)


def test_working_set_counts_namespaces_and_whole_pages() -> None:
    ids = list(range(10, 10 + 40))
    one = BenchRequest(arrival_s=0, input_ids=ids, max_new_tokens=1, cache_salt="a")
    same = BenchRequest(arrival_s=1, input_ids=ids[:35], max_new_tokens=1, cache_salt="a")
    other_salt = BenchRequest(arrival_s=2, input_ids=ids, max_new_tokens=1, cache_salt="b")
    assert working_set_tokens([one], 16) == 32  # the trailing 8 tokens are not a page
    assert working_set_tokens([one, same], 16) == 32
    assert working_set_tokens([one, same, other_salt], 16) == 64
    assert kv_pressure(64, 2, 16) == 2.0
    cap = capacity_for_pressure(6400, 4, 2.0, 16, floor_tokens=0)
    assert cap == 800 and kv_pressure(6400, 4, cap) == 2.0
    assert capacity_for_pressure(6400, 4, 2.0, 16, floor_tokens=2000) == 2000
