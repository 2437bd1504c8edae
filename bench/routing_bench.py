"""`kvroute bench routing`: every policy against the same seeded workloads, side by side.

For each workload and each KV pressure, the per-worker cache capacity is derived from the
workload's working set (`capacity = working set / (pressure x workers)`), then every policy
runs on a fresh fleet of that capacity (see `bench.harness`). The report (markdown, JSON and
PNG plots) goes to `docs/benchmarks/` unless `--out` says otherwise.

`--quick` is the about-a-minute version (2 workers, small workloads); the default is the full
run the committed report comes from. `--requests N` caps every workload (the CI smoke test
uses it to run a tiny version). `sglang_cache_aware` (SGLang's Rust router, an external
baseline) joins the default policies when `--sglang-router-python` can import `sglang_router`;
a full run that has none installs it into a venv of its own (`bench.sglang_router.install`);
otherwise it is skipped and the report says so. Every section also gets the pooled bound
(`bench.pooled_bound`) and every run its isolation violations (`bench.isolation`).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from bench import sglang_router
from bench.harness import (
    KV_DEFAULT,
    KV_HOLD,
    ORACLE,
    POLICIES,
    SGLANG_CACHE_AWARE,
    FleetSpec,
    PolicyWeights,
    policy_config,
    run_policy,
    settings_not_default,
)
from bench.isolation import workload_violations
from bench.pooled_bound import pooled_replay, replay_hit_rate, ttft_floor_p90_ms
from bench.replica_fleet import REPLICATED, UNSPREAD, run_replicated
from bench.report import write_report
from bench.routing_results import BenchReport, PolicyRun, WorkloadSection
from bench.seed_summary import render_seed_summary
from bench.workloads import (
    MooncakeParams,
    MultiTenantParams,
    SharedPrefixParams,
    Workload,
    capacity_for_pressure,
    kv_pressure,
    load_trace,
    mooncake_replay,
    multi_tenant,
    shared_prefix,
    working_set_tokens,
)
from router.config import PolicyConfig

__all__ = ["SuiteSettings", "add_arguments", "build_workloads", "run", "run_order", "run_suite"]

WORKLOADS = ("multi_tenant", "shared_prefix", "mooncake")
# fleet shapes: `flat` (one cache per worker, every workload and pressure); `dp` (half the
# workers with 2 DP ranks each, one cache per rank) and `tiered` (a host tier of 2x the GPU
# cache behind every worker) run the first workload at the highest pressure; so does `pd` (a
# prefill/decode fleet: 2 prefill and 2 decode workers, the pressure counting the prefill caches)
TOPOLOGIES = ("flat", "dp", "tiered", "pd")
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"
DEFAULT_OUT = Path("docs/benchmarks")
ALL_POLICIES = (*POLICIES, KV_DEFAULT, KV_HOLD, SGLANG_CACHE_AWARE, *REPLICATED)


class SuiteSettings(msgspec.Struct, frozen=True):
    """Everything one routing benchmark run depends on (echoed in the report)."""

    seed: int
    quick: bool
    workloads: tuple[str, ...]
    policies: tuple[str, ...]
    pressures: tuple[float, ...]
    # offered prefill load at zero cache hits (1.0 = the fleet's prefill capacity); sets each
    # workload's arrival rate unless `rate_rps` fixes one for all
    load: float
    rate_rps: float | None
    requests: int | None
    trace: str
    fleet: FleetSpec
    weights: PolicyWeights
    request_timeout_s: float
    topologies: tuple[str, ...] = ("flat",)
    # the interpreter that runs sglang-router, None when it cannot import it (policy skipped)
    sglang_router_python: str | None = None
    # what the user named, echoed in the command and the notes ("": the policy was not chosen)
    sglang_router_python_asked: str = ""
    # why a full run could not install sglang-router ("": it did not need to, or it did)
    sglang_router_install_failure: str = ""
    sglang_router_installed: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvroute bench routing`."""
    parser.add_argument("--quick", action="store_true", help="about a minute on 2 cores")
    parser.add_argument("--seed", type=int, default=1, help="workload and policy seed")
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma list of seeds (overrides --seed): the whole run once per seed, each report "
        "in OUT/seed-N, and OUT/routing_seeds.md with every policy's hit rate over kv's taken "
        "seed by seed (median and range)",
    )
    parser.add_argument(
        "--out", "--output", type=Path, default=DEFAULT_OUT, help="report directory"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma list of {', '.join(ALL_POLICIES)} (default: all but {KV_HOLD} and the "
        f"replica runs; {KV_DEFAULT}, the router's kv with its default weights, joins when "
        f"--kv-*-weight overrides them; {KV_HOLD} is kv with policy.hold_until_room; "
        f"{SGLANG_CACHE_AWARE} runs only when --sglang-router-python can import sglang_router)",
    )
    parser.add_argument(
        "--sglang-router-python",
        default=sglang_router.DEFAULT_PYTHON,
        help="python that can import sglang_router, for the sglang_cache_aware baseline "
        "(default: $KVROUTE_SGLANG_ROUTER_PYTHON or this python; skipped when it cannot)",
    )
    parser.add_argument(
        "--pressures",
        default=None,
        help="comma list of KV pressures to run every workload at (default: quick 2.5, full 1,2.5)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="offered prefill load with no cache hits, as a fraction of the fleet's prefill "
        "capacity; sets each workload's arrival rate (default 1.0)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="fixed arrival rate, requests/s (overrides --load)"
    )
    parser.add_argument("--requests", type=int, default=None, help="cap requests per workload")
    parser.add_argument(
        "--topologies",
        default=None,
        help=f"comma list of {', '.join(TOPOLOGIES)} (default: quick flat, full all): dp runs "
        "workers with 2 DP ranks, tiered adds a host tier, pd runs 2 prefill + 2 decode "
        "workers as pairs; each on the first workload at the highest pressure",
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    parser.add_argument("--workers", type=int, default=None, help="reference workers per fleet")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.5)
    parser.add_argument("--decode-ms-per-token", type=float, default=2.0)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument(
        "--overlap-schedule",
        action="store_true",
        help="workers form their next batch while a prefill runs, before caching its prompts, "
        "as SGLang's default overlap scheduler does (default: they cache first)",
    )
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line to add to the report's notes (repeatable; not echoed in the command)",
    )
    parser.add_argument(
        "--kv-hit-weight",
        type=float,
        default=None,
        help="the router's [policy] hit_weight for kv (default: the router's own default)",
    )
    parser.add_argument(
        "--kv-decode-weight",
        type=float,
        default=None,
        help="the router's [policy] decode_weight for kv (default: the router's own default)",
    )
    parser.add_argument(
        "--kv-eviction-weight",
        type=float,
        default=None,
        help="the router's [policy] eviction_weight for kv (default: the router's own default)",
    )
    parser.add_argument(
        "--kv-room-weight",
        type=float,
        default=None,
        help="the router's [policy] room_weight for kv (default: the router's own default)",
    )


def _csv(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: unknown {bad or 'empty list'}; choose from {allowed}")
    return items


def _policies(args: argparse.Namespace, sglang: bool) -> tuple[str, ...]:
    """The policies to run; `sglang`: whether sglang-router can run (else it is left out)."""
    if args.policies is not None:
        chosen = _csv(args.policies, ALL_POLICIES, "policies")
        return tuple(p for p in chosen if sglang or p != SGLANG_CACHE_AWARE)
    policies = list(POLICIES)
    if sglang:  # beside the kvroute policy that mimics it
        policies.insert(policies.index("approx_tree") + 1, SGLANG_CACHE_AWARE)
    if any(
        w is not None
        for w in (
            args.kv_hit_weight,
            args.kv_decode_weight,
            args.kv_eviction_weight,
            args.kv_room_weight,
        )
    ):
        # show what the override buys: the router's defaults run right after the tuned kv
        policies.insert(1, KV_DEFAULT)
    return tuple(policies)


def settings_from_args(args: argparse.Namespace) -> SuiteSettings:
    """Validate the command line into settings (defaults depend on --quick)."""
    quick = bool(args.quick)
    pressures_text = args.pressures or ("2.5" if quick else "1,2.5")
    try:
        pressures = tuple(float(p) for p in pressures_text.split(","))
    except ValueError as exc:
        raise SystemExit(f"--pressures: {exc}") from exc
    if any(p <= 0 for p in pressures):
        raise SystemExit("--pressures must be > 0")
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    if args.workers is not None and args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    for flag, value in (
        ("--kv-hit-weight", args.kv_hit_weight),
        ("--kv-decode-weight", args.kv_decode_weight),
        ("--kv-eviction-weight", args.kv_eviction_weight),
        ("--kv-room-weight", args.kv_room_weight),
    ):
        if value is not None and value < 0:
            raise SystemExit(f"{flag} must be >= 0")
    wanted = args.policies is None or SGLANG_CACHE_AWARE in args.policies.split(",")
    asked_python = str(args.sglang_router_python) if wanted else ""
    sglang = wanted and sglang_router.importable(asked_python)
    failure = ""
    installed = False
    if wanted and not sglang and not quick and asked_python == sglang_router.DEFAULT_PYTHON:
        # the full run's headline comparison is against the real router: bring it in
        python, where = sglang_router.provision(asked_python)
        if python is None:
            failure = where
        else:
            asked_python, sglang, installed = python, True, True
    fleet = FleetSpec(
        workers=args.workers or (2 if quick else 4),
        page_size=args.page_size,
        capacity_tokens=args.page_size,  # replaced per section from the pressure
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        max_running_requests=args.max_running_requests,
        time_scale=args.time_scale,
        overlap_schedule=args.overlap_schedule,
    )
    return SuiteSettings(
        seed=args.seed,
        quick=quick,
        workloads=_csv(args.workloads, WORKLOADS, "workloads"),
        policies=_policies(args, sglang),
        pressures=pressures,
        load=args.load,
        rate_rps=args.rate,
        requests=args.requests,
        trace=str(args.trace),
        fleet=fleet,
        topologies=_csv(
            args.topologies or ("flat" if quick else ",".join(TOPOLOGIES)), TOPOLOGIES, "topologies"
        ),
        weights=PolicyWeights(
            hit_weight=args.kv_hit_weight,
            decode_weight=args.kv_decode_weight,
            eviction_weight=args.kv_eviction_weight,
            room_weight=args.kv_room_weight,
        ),
        request_timeout_s=args.request_timeout,
        sglang_router_python=asked_python if sglang else None,
        sglang_router_python_asked=asked_python,
        sglang_router_install_failure=failure,
        sglang_router_installed=installed,
    )


def _command(settings: SuiteSettings, out: Path) -> str:
    f = settings.fleet
    argv = ["kvroute", "bench", "routing"]
    if settings.quick:
        argv.append("--quick")
    argv += ["--seed", str(settings.seed), "--workloads", ",".join(settings.workloads)]
    argv += ["--policies", ",".join(settings.policies)]
    argv += ["--pressures", ",".join(f"{p:g}" for p in settings.pressures)]
    if settings.rate_rps is not None:
        argv += ["--rate", f"{settings.rate_rps:g}"]
    else:
        argv += ["--load", f"{settings.load:g}"]
    argv += ["--workers", str(f.workers)]
    argv += ["--topologies", ",".join(settings.topologies)]
    if settings.requests is not None:
        argv += ["--requests", str(settings.requests)]
    if Path(settings.trace).resolve() != DEFAULT_TRACE:
        argv += ["--trace", settings.trace]
    argv += ["--page-size", str(f.page_size)]
    argv += ["--prefill-ms-per-token", f"{f.prefill_ms_per_token:g}"]
    argv += ["--decode-ms-per-token", f"{f.decode_ms_per_token:g}"]
    argv += ["--max-running-requests", str(f.max_running_requests)]
    argv += ["--time-scale", f"{f.time_scale:g}"]
    if f.overlap_schedule:
        argv.append("--overlap-schedule")
    if settings.weights.hit_weight is not None:
        argv += ["--kv-hit-weight", f"{settings.weights.hit_weight:g}"]
    if settings.weights.decode_weight is not None:
        argv += ["--kv-decode-weight", f"{settings.weights.decode_weight:g}"]
    if settings.weights.eviction_weight is not None:
        argv += ["--kv-eviction-weight", f"{settings.weights.eviction_weight:g}"]
    if settings.weights.room_weight is not None:
        argv += ["--kv-room-weight", f"{settings.weights.room_weight:g}"]
    if settings.sglang_router_python_asked not in ("", sys.executable):
        argv += ["--sglang-router-python", settings.sglang_router_python_asked]
    argv += ["--out", str(out)]
    return shlex.join(argv)


def _build(name: str, settings: SuiteSettings, rate: float) -> Workload:
    quick = settings.quick
    if name == "multi_tenant":
        mt = MultiTenantParams(
            system_prompt_tokens=768, user_tokens=96, assistant_tokens=48, rate_rps=rate
        )
        if quick:
            mt = MultiTenantParams(
                tenants=8,
                shared_prompt_tenants=3,
                system_prompt_tokens=384,
                conversations_per_tenant=2,
                turns=3,
                user_tokens=96,
                assistant_tokens=48,
                rate_rps=rate,
                min_turn_gap_s=0.3,
            )
        workload = multi_tenant(mt, settings.seed)
    elif name == "shared_prefix":
        sp = SharedPrefixParams(
            groups=80, prefix_tokens=1024, users_per_group=2, questions_per_user=2, rate_rps=rate
        )
        if quick:
            sp = SharedPrefixParams(
                groups=12, prefix_tokens=1024, users_per_group=2, questions_per_user=2,
                rate_rps=rate,
            )  # fmt: skip
        workload = shared_prefix(sp, settings.seed)
    else:
        rows = load_trace(Path(settings.trace))
        mc = MooncakeParams(rate_rps=rate)
        if quick:
            mc = MooncakeParams(rate_rps=rate, replay_block_tokens=32, max_requests=96)
        workload = mooncake_replay(rows, mc, settings.seed)
    if settings.requests is not None:
        workload = msgspec.structs.replace(
            workload, requests=workload.requests[: settings.requests]
        )
    return workload


def rate_for_load(workload: Workload, fleet: FleetSpec, load: float) -> float:
    """Arrival rate at which the workload's prompts, all uncached, would take `load` of the
    fleet's prefill capacity (wall-clock prefill cost per token after the time scale)."""
    mean_prompt = workload.prompt_tokens / max(1, len(workload.requests))
    wall_s_per_token = fleet.prefill_ms_per_token * fleet.time_scale / 1000.0
    if wall_s_per_token <= 0:
        return 50.0
    return load * fleet.workers / (mean_prompt * wall_s_per_token)


def build_workloads(settings: SuiteSettings) -> list[Workload]:
    """The chosen workloads at their mode's size and arrival rate (fixed, or from the load)."""
    out: list[Workload] = []
    for name in settings.workloads:
        if settings.rate_rps is not None:
            out.append(_build(name, settings, settings.rate_rps))
            continue
        # the shape does not depend on the rate: build once to measure it, then at the rate
        probe = _build(name, settings, 1.0)
        out.append(_build(name, settings, rate_for_load(probe, settings.fleet, settings.load)))
    return out


def _notes(settings: SuiteSettings) -> list[str]:
    notes = [
        "`oracle` is the harness routing by itself: it asks every worker's `/debug/match` for "
        "the hit the request would get there (its cached prefix in the request's namespace, "
        "the prompt's last token left out), adds what its own in-flight requests "
        "there are about to cache, and takes the longest (ties: fewest in flight). It ignores "
        "load. It is a greedy affinity oracle, not a bound: the longest match at each arrival "
        "is not the placement that keeps the most reuse over the run (it copies a prefix "
        "wherever it first lands and never weighs what a placement evicts), so a router can "
        "exceed its hit rate.",
        "Open-loop arrivals: every request leaves at its scheduled time whatever happened to "
        "earlier ones; `multi_tenant` delays a conversation's next turn at least the think time.",
        "Routing overhead for router policies: paired tiny probes on the idle fleet after the "
        "workload (through the router minus direct to the same worker), i.e. the whole proxy "
        "hop; for `oracle`, each request's `/debug/match` fan-out.",
        "Everything (workers, router, load generator) shares one event loop on a shared 2-core "
        "machine: absolute latencies include that contention; compare policies within a run.",
        "Policies run one after another, each on a fresh fleet. Their order rotates by one "
        "place per section, from an offset the seed sets (`bench.routing_bench.run_order`), so "
        "the drift of a long run does not always fall on the same policy; the tables list "
        "them in a fixed order all the same.",
    ]
    if KV_HOLD in settings.policies:
        notes.append(
            f"`{KV_HOLD}` is the router's `kv` policy with `policy.hold_until_room`: a request "
            "waits in the router while the (worker, rank) it would go to has no KV room to "
            "admit it (docs/router.md, Holding requests until a worker has room)."
        )
    if KV_DEFAULT in settings.policies:
        notes.append(
            f"`{KV_DEFAULT}` is the router's `kv` policy with the router's default weights, run "
            "beside `kv` (which uses the weights named under Fleet) so the effect of the "
            "override is measured in the same run; targets are read from `kv`."
        )
    notes.append(
        "Isolation: every request carries its tenant's `cache_salt` to every router, kvroute's "
        "and SGLang's alike. A worker-reported cached token that only another salt's prompt "
        "could have produced is an isolation violation: it is counted in the Isolation table "
        "and the `isolation violations` column, and left out of the hit rate (`reported` in "
        "the JSON keeps the workers' own count)."
    )
    notes.append(
        "`% of pooled bound`: the policy's hit rate over the hit rate of one LRU cache of the "
        "fleet's whole capacity on the same trace (`bench/pooled_bound.py`); partitioning the "
        "capacity across workers mostly loses against it, so the distance to 100% is roughly "
        "what routing could still win (the oracle's share: what greedy longest-match placement "
        "reaches). It is a reference, not a strict bound: a share a few points above 100% is "
        "LRU's own doing, not a better router: LRU is not "
        "the optimal eviction, and the live fleet touches its caches in another order (at "
        "admission and completion, not arrival). `sglang_cache_aware` can also exceed it "
        "through what the isolation count cannot see: with the salt dropped, tenants that "
        "share a system prompt share one copy of it on its workers, which leaves room for more."
    )
    if settings.sglang_router_python is None and settings.sglang_router_python_asked:
        why = (
            f" The full run tried to install it (`python3 -m venv {sglang_router.VENV}`, "
            f"`pip install {sglang_router.PINNED}`) and could not: "
            f"{settings.sglang_router_install_failure}."
            if settings.sglang_router_install_failure
            else ""
        )
        notes.append(
            f"`{SGLANG_CACHE_AWARE}` (SGLang's Rust router, `sglang-router` on PyPI) was "
            f"skipped: `{settings.sglang_router_python_asked}` cannot import `sglang_router`."
            + why
            + " Install it into some environment and pass that python with "
            "`--sglang-router-python` (or `KVROUTE_SGLANG_ROUTER_PYTHON`) to add the baseline; "
            "the targets are then read against `approx_tree`."
        )
    elif settings.sglang_router_python is not None:
        installed = (
            "; the bench's own venv, which a full run creates with `pip install "
            f"{sglang_router.PINNED}` when no python at hand has sglang-router"
            if settings.sglang_router_installed
            else ""
        )
        notes.append(
            f"`{SGLANG_CACHE_AWARE}` is SGLang's own Rust router (`sglang-router` "
            f"{sglang_router.version(settings.sglang_router_python)}, run by "
            f"`{settings.sglang_router_python} -m sglang_router.launch_router --policy "
            f"cache_aware` with its defaults{installed}) in front of a fresh fleet; the "
            "targets are read against it. It gets no KV events: it routes on its own "
            "approximate radix tree of the text of each request's `input_ids` (ids joined by "
            "spaces) with its load-balance thresholds. It drops `cache_salt` from `/generate` "
            "and `/v1/chat/completions` (kept on `/v1/completions`), so its workers see every "
            "tenant in one unsalted namespace and serve one tenant's pages to another: those "
            "tokens are isolation violations, not hits. Routing overhead: paired probes as "
            "for kvroute, the direct half to the workers in turn (it does not say which "
            "worker it chose)."
        )
        notes.append(
            "`approx_tree` mirrors sglang-router's `cache_aware` (0.3.2 defaults: balance on "
            "requests in flight, abs 64 and rel 1.5; cache threshold 0.3 on the matched share of "
            "the prompt; the smallest tree for new prefixes; size-bounded LRU eviction of the "
            "tree every 60 s) inside kvroute, over token ids instead of characters and with the "
            "salt forwarded; the fidelity table holds it against the real one."
        )
    return notes


def _replica_notes(sections: list[WorkloadSection]) -> list[str]:
    """Hit rate of three replicas (sharing, alone) as a ratio of one replica's, per section."""
    from bench.routing_results import summarize

    notes = []
    for section in sections:
        runs = {run.policy: summarize(run) for run in section.runs if run.records}
        one = runs.get("kv")
        if one is None or not one.hit_rate:
            continue
        parts = [
            f"`{name}` {runs[name].hit_rate / one.hit_rate:.3f}x"
            + (" (the control: every request to one of them)" if name in UNSPREAD else "")
            for name in REPLICATED
            if name in runs
        ]
        if parts:
            notes.append(
                f"{section.workload} at KV pressure {section.pressure:.2f}: hit rate of three "
                f"kv replicas (requests spread at random) over one kv replica's "
                f"({one.hit_rate:.1%}): " + ", ".join(parts) + " (`bench/replica_fleet.py`)"
            )
    return notes


TOPOLOGY_LABELS = {
    "flat": "",
    "dp": " [dp 2 ranks]",
    "tiered": " [GPU + host tier]",
    "pd": " [prefill/decode 2P+2D]",
}
TOPOLOGY_NOTES = {
    "flat": "",
    "dp": "; fleet: half the workers, each with 2 data-parallel ranks (one cache and one "
    "KV-event stream per rank), the KV pressure counting every rank's cache",
    "pd": "; fleet: 2 prefill and 2 decode workers served as pairs (SGLang's bootstrap-room "
    "protocol: the router picks the prefill worker by its policy and the decode worker by "
    "load, or by its policy's turns), the decode side paying the KV transfer; the KV pressure "
    "counts the prefill caches, where prefix reuse happens; the hit rate is the prefill side's "
    "(`cached_tokens` as the decode relays it); no oracle (it routes single workers)",
    "tiered": "; fleet: every worker has a host tier of twice its GPU cache, which keeps a copy "
    "of every page the GPU caches (SGLang HiCache's write-through, medium CPU_PINNED) and keeps it "
    "once the GPU evicts the page, loaded back on a hit at the host load cost; the KV pressure "
    "counts the GPU caches only",
}


# why the benchmark's kv differs from the router's defaults, setting by setting
_WHY_NOT_DEFAULT = {
    "seed": "the run's --seed",
    "admission_batch_window_ms": "the simulated fleet's decode step, decode_ms_per_token x "
    "time_scale, as an operator sets it for their fleet",
    "decode_step_weight": "the simulated fleet's decode step in prefill tokens, "
    "decode_ms_per_token / prefill_ms_per_token, as an operator sets it for their fleet",
    "hit_weight": "--kv-hit-weight",
    "decode_weight": "--kv-decode-weight",
    "eviction_weight": "--kv-eviction-weight",
    "room_weight": "--kv-room-weight",
}


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def kv_settings_line(settings: SuiteSettings) -> str:
    """Every setting of the benchmark's `kv` router that differs from the router's defaults,
    with why (the Fleet section's line: "the router's defaults" would hide them)."""
    config = policy_config("kv", settings.fleet, settings.seed, settings.weights)
    described = []
    for name, (value, default) in settings_not_default(config).items():
        why = _WHY_NOT_DEFAULT.get(name)
        described.append(
            f"{name}={_shown(value)} (router default {_shown(default)}"
            + (f"; {why})" if why else ")")
        )
    if not described:
        return "the router's defaults, every one"
    return "the router's defaults but " + ", ".join(described)


def topology_fleet(fleet: FleetSpec, topology: str) -> FleetSpec:
    """The fleet a topology runs on (its capacity is set per section from the pressure)."""
    if topology == "dp":
        return msgspec.structs.replace(fleet, workers=max(1, fleet.workers // 2), dp_size=2)
    if topology == "pd":
        # `workers` counts the caches that reuse prefixes (the prefill side's) for the pressure
        return msgspec.structs.replace(fleet, workers=2, prefill_workers=2, decode_workers=2)
    return fleet


def run_order(policies: list[str], seed: int, section: int) -> list[str]:
    """The order the policies of one section run in: rotated one place per section from an
    offset the seed sets, so the drift of a long run (the machine's load, what the earlier
    fleets left behind) does not always fall on the same policy (the report lists them in
    their fixed order all the same)."""
    if not policies:
        return []
    shift = (seed + section) % len(policies)
    return policies[shift:] + policies[:shift]


def _plan(settings: SuiteSettings, workloads: list[Workload]) -> list[tuple[str, Workload, float]]:
    """(topology, workload, asked pressure) for every section, in report order."""
    plan = []
    if "flat" in settings.topologies:
        plan += [("flat", w, p) for w in workloads for p in settings.pressures]
    for topology in settings.topologies:
        if topology != "flat" and workloads:
            plan.append((topology, workloads[0], max(settings.pressures)))
    return plan


async def run_suite(settings: SuiteSettings, console: Console, command: str) -> BenchReport:
    """Run every workload x pressure x policy and gather the report."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    workloads = build_workloads(settings)
    sections: list[WorkloadSection] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        for index, (topology, workload, asked) in enumerate(_plan(settings, workloads)):
            page = settings.fleet.page_size
            rate = float(workload.params["rate_rps"])  # type: ignore[arg-type]
            working = working_set_tokens(workload.requests, page)
            longest = max(len(r.input_ids) for r in workload.requests)
            # room for two running prompts at once, or a worker could only run them one by one
            output = max(r.max_new_tokens for r in workload.requests)
            floor = 2 * (longest + output + page)
            spec = topology_fleet(settings.fleet, topology)
            caches = spec.workers * spec.dp_size
            capacity = capacity_for_pressure(working, caches, asked, page, floor)
            pressure = kv_pressure(working, caches, capacity)
            spec = msgspec.structs.replace(spec, capacity_tokens=capacity)
            if topology == "tiered":
                spec = msgspec.structs.replace(spec, host_capacity_tokens=2 * capacity)
            label = workload.name + TOPOLOGY_LABELS[topology]
            console.print(
                f"[bold]{escape(label)}[/]: {len(workload.requests)} requests at "
                f"{rate:.1f} req/s; working set {working} tokens; fleet "
                f"{spec.workers} x {spec.dp_size} x {capacity} tokens; "
                f"[bold]KV pressure {pressure:.2f}[/]"
                + (f" (asked {asked:g}; capacity floor {floor})" if pressure < asked else "")
            )
            done: dict[str, PolicyRun] = {}
            policies = [p for p in settings.policies if topology != "pd" or p != ORACLE]
            for policy in run_order(policies, settings.seed, index):
                task = progress.add_task(
                    f"{label} p={pressure:.2f} {policy:<12}",
                    total=len(workload.requests),
                )

                def advance(_: object, task: TaskID = task) -> None:
                    progress.advance(task)

                try:
                    if policy in REPLICATED:  # three kv replicas, sharing or not
                        run = await run_replicated(
                            policy, workload, spec, settings.seed, advance,
                            settings.request_timeout_s, settings.weights,
                        )  # fmt: skip
                    else:
                        run = await run_policy(
                            policy, workload, spec, settings.seed, advance,
                            settings.request_timeout_s, settings.weights,
                            settings.sglang_router_python,
                        )  # fmt: skip
                except Exception as exc:  # a policy that cannot run is reported, not fatal
                    run = PolicyRun(
                        policy=policy,
                        records=[],
                        wall_s=0.0,
                        note=f"did not run: {type(exc).__name__}: {exc}",
                    )
                progress.stop_task(task)
                workload_violations(
                    workload.requests, run.records, page, by_worker=not spec.disaggregated
                )
                done[policy] = run
            runs = [done[policy] for policy in policies]  # the report's fixed order
            # the host tier keeps a copy of what the GPU holds: the larger pool is what both keep
            pooled = caches * max(capacity, spec.host_capacity_tokens)
            replay = pooled_replay(workload.requests, page_size=page, capacity_tokens=pooled)
            bound = replay_hit_rate(replay)
            ttft_floor = ttft_floor_p90_ms(replay, spec.prefill_ms_per_token * spec.time_scale)
            sections.append(
                WorkloadSection(
                    workload=label,
                    description=workload.description + TOPOLOGY_NOTES[topology],
                    seed=workload.seed,
                    params=workload.params,
                    requests=len(workload.requests),
                    rate_rps=rate,
                    working_set_tokens=working,
                    capacity_tokens=capacity,
                    workers=spec.workers,
                    pressure=pressure,
                    runs=runs,
                    dp_size=spec.dp_size,
                    host_capacity_tokens=spec.host_capacity_tokens,
                    pooled_hit_rate=bound,
                    ttft_floor_p90_ms=ttft_floor,
                )
            )
    fleet = msgspec.structs.asdict(settings.fleet)
    fleet["capacity_tokens"] = "per section (from the KV pressure), see below"
    fleet["worker"] = "in-process reference workers (`workers.worker.ReferenceWorker`)"
    fleet["requests"] = "streaming SGLang `/generate` with `input_ids` and `cache_salt`"
    defaults = PolicyConfig()
    hit = settings.weights.hit_weight
    decode = settings.weights.decode_weight
    evict = settings.weights.eviction_weight
    room = settings.weights.room_weight
    fleet["kv_policy_weights"] = (
        f"hit_weight={defaults.hit_weight if hit is None else hit:g}"
        + (" (router default)" if hit is None else " (set by --kv-hit-weight)")
        + f", decode_weight={defaults.decode_weight if decode is None else decode:g}"
        + (" (router default)" if decode is None else " (set by --kv-decode-weight)")
        + f", eviction_weight={defaults.eviction_weight if evict is None else evict:g}"
        + (" (router default)" if evict is None else " (set by --kv-eviction-weight)")
        + f", room_weight={defaults.room_weight if room is None else room:g}"
        + (" (router default)" if room is None else " (set by --kv-room-weight)")
    )
    fleet["kv_settings"] = kv_settings_line(settings)
    fleet["offered_load"] = (
        f"fixed rate {settings.rate_rps:g} req/s"
        if settings.rate_rps is not None
        else f"{settings.load:g} x the fleet's prefill capacity with no cache hits "
        "(sets each workload's arrival rate)"
    )
    notes = _notes(settings) + _replica_notes(sections)
    return BenchReport(
        command=command,
        seed=settings.seed,
        mode="quick" if settings.quick else "full",
        started_at=started,
        fleet=fleet,
        sections=sections,
        notes=notes,
    )


def seeds_from_args(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The seeds of `--seeds` (None: one run, `--seed`); SystemExit names a bad list."""
    if args.seeds is None:
        return None
    try:
        seeds = tuple(int(s) for s in args.seeds.split(","))
    except ValueError as exc:
        raise SystemExit(f"--seeds: a comma list of integers ({exc})") from exc
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: {args.seeds} names a seed twice")
    return seeds


def run(args: argparse.Namespace) -> int:
    """Run the suite (once, or once per seed) and write the reports; 1 when a policy could
    not run at all."""
    seeds = seeds_from_args(args)
    settings = settings_from_args(args)
    console = Console(stderr=True)
    out: Path = args.out
    if seeds is None:
        report = _run_one(args, settings, out, console)
        return 1 if any(not r.records for s in report.sections for r in s.runs) else 0
    reports = [
        _run_one(args, msgspec.structs.replace(settings, seed=seed), out / f"seed-{seed}", console)
        for seed in seeds
    ]
    command = _command(settings, out).replace(
        f"--seed {settings.seed}", f"--seeds {','.join(map(str, seeds))}", 1
    )
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "routing_seeds.md"
    summary.write_text(render_seed_summary(reports, command), encoding="utf-8")
    console.print(f"across seeds: {summary}")
    return 1 if any(not r.records for rep in reports for s in rep.sections for r in s.runs) else 0


def _run_one(
    args: argparse.Namespace, settings: SuiteSettings, out: Path, console: Console
) -> BenchReport:
    command = _command(settings, out)
    console.print(f"[dim]{command}[/]")
    report = asyncio.run(run_suite(settings, console, command))
    report.notes.extend(args.note)
    path = write_report(report, out)
    failed = [
        f"{s.workload}/{r.policy}"
        for s in report.sections
        for r in s.runs
        if not r.records or not all(rec.ok for rec in r.records)
    ]
    console.print(f"report: {path}")
    if failed:
        # requests may fail under load (the report counts them); a policy that never ran may not
        console.print(f"[yellow]incomplete runs: {', '.join(failed)}[/]")
    return report
