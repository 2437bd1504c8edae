"""Seeded routing workloads: multi-tenant salted chat, shared-prefix groups, Mooncake trace replay.

Every generator is pure: the same parameters and seed give the same requests, token for token
and arrival for arrival, so every policy in a run faces exactly the same load. Prompts are token
ids of the built-in byte tokenizer (the one the reference workers and the router share), sent as
`input_ids`, so the router, the workers and the harness's oracle all see identical tokens.

Workloads:
- `multi_tenant`: T tenants, each with its own `cache_salt`; the first `shared_prompt_tenants`
  of them use the *identical* system prompt text (a salt-blind router sees false hits there:
  the workers never share cache across salts). Each tenant holds several conversations whose
  turns re-send the whole history, so prefixes grow turn by turn.
- `shared_prefix`: the llm-d benchmark shape: G groups, each with a long shared prefix, U users
  per group asking short questions after it. Unsalted.
- `mooncake_replay`: rows of a Mooncake trace (`timestamp` ms, `input_length`, `output_length`,
  `hash_ids`); each hash id maps to a deterministic block of tokens so rows that share ids
  share prefixes. `synthesize_mooncake_trace` made the shipped sample. The seed does not change
  it (`SEED_INDEPENDENT`): a replay is the trace's rows, so every seed replays one trace.

Arrivals are open loop: the harness sends each request at its `arrival_s`, whatever the state
of earlier ones. The KV pressure of a workload on a fleet is its working set (distinct
namespaced prompt tokens, whole pages only, over the whole run) divided by the fleet's total
cache capacity.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from indexer.protocol.tokens import BYTE_OFFSET, VOCAB_SIZE, ByteTokenizer, render_chat

__all__ = [
    "SEED_INDEPENDENT",
    "BenchRequest",
    "MooncakeParams",
    "MultiTenantParams",
    "SharedPrefixParams",
    "TraceRow",
    "Workload",
    "WorkloadError",
    "capacity_for_pressure",
    "kv_pressure",
    "load_trace",
    "mooncake_replay",
    "multi_tenant",
    "poisson_arrivals",
    "shared_prefix",
    "synthesize_mooncake_trace",
    "working_set_tokens",
    "write_trace",
]

_TOKENIZER = ByteTokenizer()

# Workloads whose requests the seed does not change. A trace replay is its rows: a seeded window
# or sample of them would cut the multi-turn sessions whose shared prefixes are why a trace is
# replayed, and `--trace FILE` must replay FILE, not part of it. So `--seeds` repeats one trace
# (only the routers' seeded picks and the run's timing differ), and the reports say so.
SEED_INDEPENDENT = frozenset({"mooncake"})
_WORDS_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class WorkloadError(ValueError):
    """A workload that cannot be built: bad parameters or a malformed trace line (named)."""


class BenchRequest(msgspec.Struct, frozen=True):
    """One request of a workload: when to send it and what to send."""

    arrival_s: float
    input_ids: list[int]
    max_new_tokens: int
    cache_salt: str | None = None
    # labels for the report; never the salt itself
    tenant: str = ""
    session: str = ""


class Workload(msgspec.Struct, frozen=True):
    """A named, fully materialized request list plus the parameters that made it."""

    name: str
    description: str
    seed: int
    params: dict[str, object]
    requests: list[BenchRequest]

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def prompt_tokens(self) -> int:
        """Total prompt tokens over all requests."""
        return sum(len(r.input_ids) for r in self.requests)


class MultiTenantParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of the multi-tenant salted chat workload."""

    tenants: int = 16
    shared_prompt_tenants: int = 4
    system_prompt_tokens: int = 1024
    conversations_per_tenant: int = 6
    turns: int = 4
    user_tokens: int = 128
    assistant_tokens: int = 64
    max_new_tokens: int = 16
    rate_rps: float = 20.0
    # a conversation's next turn never arrives sooner than this after its previous one
    min_turn_gap_s: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, "tenants", "conversations_per_tenant", "turns", "max_new_tokens")
        _positive(self, "system_prompt_tokens", "user_tokens", "assistant_tokens")
        if not 0 <= self.shared_prompt_tenants <= self.tenants:
            raise WorkloadError("shared_prompt_tenants must be between 0 and tenants")
        if self.rate_rps <= 0 or self.min_turn_gap_s < 0:
            raise WorkloadError("rate_rps must be > 0 and min_turn_gap_s >= 0")


class SharedPrefixParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of the llm-d style shared-prefix workload."""

    groups: int = 32
    prefix_tokens: int = 2048
    users_per_group: int = 4
    questions_per_user: int = 3
    question_tokens: int = 64
    max_new_tokens: int = 16
    rate_rps: float = 20.0

    def __post_init__(self) -> None:
        _positive(self, "groups", "prefix_tokens", "users_per_group", "questions_per_user")
        _positive(self, "question_tokens", "max_new_tokens")
        if self.rate_rps <= 0:
            raise WorkloadError("rate_rps must be > 0")


class MooncakeParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a Mooncake trace is replayed."""

    # tokens one hash id stands for in the file (Mooncake uses 512)
    trace_block_tokens: int = 512
    # tokens one hash id becomes on the wire; smaller keeps CPU-simulated prompts affordable
    replay_block_tokens: int = 64
    # mean arrival rate after rescaling the trace's timestamps; None keeps the recorded pace
    rate_rps: float | None = 20.0
    max_requests: int | None = None
    max_new_tokens_cap: int = 32

    def __post_init__(self) -> None:
        _positive(self, "trace_block_tokens", "replay_block_tokens", "max_new_tokens_cap")
        if self.rate_rps is not None and self.rate_rps <= 0:
            raise WorkloadError("rate_rps must be > 0")
        if self.max_requests is not None and self.max_requests <= 0:
            raise WorkloadError("max_requests must be > 0")


class TraceRow(msgspec.Struct, frozen=True):
    """One line of a Mooncake trace file."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _positive(params: msgspec.Struct, *names: str) -> None:
    for name in names:
        if getattr(params, name) <= 0:
            raise WorkloadError(f"{name} must be > 0")


def poisson_arrivals(count: int, rate_rps: float, rng: random.Random) -> list[float]:
    """`count` arrival times (s) of a Poisson process at `rate_rps`, the first one at 0."""
    times: list[float] = []
    now = 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate_rps)
        times.append(now)
    return times


def _words(rng: random.Random, tokens: int) -> str:
    """Lowercase pseudo-words of exactly `tokens` bytes (one byte = one token)."""
    out: list[str] = []
    size = 0
    while size <= tokens:
        word = "".join(rng.choices(_WORDS_ALPHABET, k=rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:tokens]


def _chat_ids(messages: Sequence[dict[str, str]]) -> list[int]:
    return _TOKENIZER.encode(render_chat(messages), add_bos=True)


def multi_tenant(params: MultiTenantParams, seed: int) -> Workload:
    """Multi-tenant salted conversations with growing prefixes, Poisson arrivals."""
    rng = random.Random(f"multi_tenant:{seed}")
    shared_system = _words(rng, params.system_prompt_tokens)
    salts: list[str] = []
    systems: list[str] = []
    for t in range(params.tenants):
        salts.append(f"salt-{seed}-{t}-{rng.getrandbits(64):016x}")
        if t < params.shared_prompt_tenants:
            systems.append(shared_system)
        else:
            systems.append(_words(rng, params.system_prompt_tokens))

    conversations = [
        (t, c) for t in range(params.tenants) for c in range(params.conversations_per_tenant)
    ]
    rng.shuffle(conversations)
    total = len(conversations) * params.turns
    times = poisson_arrivals(total, params.rate_rps, rng)

    history: dict[tuple[int, int], list[dict[str, str]]] = {}
    last_arrival: dict[tuple[int, int], float] = {}
    unstarted = list(conversations)
    requests: list[BenchRequest] = []

    def open_turns() -> list[tuple[tuple[int, int], float]]:
        # a conversation of k turns so far holds 2k messages (system + user, then pairs)
        return [(c, at) for c, at in last_arrival.items() if len(history[c]) < 2 * params.turns]

    delay = 0.0
    for planned in times:
        now = planned + delay
        waiting = open_turns()
        eligible = [c for c, at in waiting if now - at >= params.min_turn_gap_s]
        if not eligible and not unstarted:
            # only conversations still in their think time remain: the clock moves on
            shift = min(at for _, at in waiting) + params.min_turn_gap_s - now
            delay += shift
            now += shift
            eligible = [c for c, at in waiting if now - at >= params.min_turn_gap_s - 1e-9]
        # uniform over "start one of the unstarted" and each eligible conversation
        pick = rng.randrange(len(unstarted) + len(eligible))
        if pick < len(unstarted):
            conv = unstarted.pop(pick)
            history[conv] = [{"role": "system", "content": systems[conv[0]]}]
        else:
            conv = eligible[pick - len(unstarted)]
            history[conv].append(
                {"role": "assistant", "content": _words(rng, params.assistant_tokens)}
            )
        history[conv].append({"role": "user", "content": _words(rng, params.user_tokens)})
        last_arrival[conv] = now
        tenant, index = conv
        requests.append(
            BenchRequest(
                arrival_s=now,
                input_ids=_chat_ids(history[conv]),
                max_new_tokens=params.max_new_tokens,
                cache_salt=salts[tenant],
                tenant=f"t{tenant}",
                session=f"t{tenant}c{index}",
            )
        )
    return Workload(
        name="multi_tenant",
        description=(
            f"{params.tenants} salted tenants ({params.shared_prompt_tenants} share one identical "
            f"system prompt text), {params.conversations_per_tenant} conversations each, "
            f"{params.turns} turns re-sending the growing history"
        ),
        seed=seed,
        params=msgspec.structs.asdict(params),
        requests=requests,
    )


def shared_prefix(params: SharedPrefixParams, seed: int) -> Workload:
    """llm-d style groups: a long shared prefix per group, short questions per user."""
    rng = random.Random(f"shared_prefix:{seed}")
    prefixes = [_words(rng, params.prefix_tokens) for _ in range(params.groups)]
    prompts: list[tuple[int, int, str]] = []
    for g in range(params.groups):
        for u in range(params.users_per_group):
            for _ in range(params.questions_per_user):
                prompts.append((g, u, _words(rng, params.question_tokens)))
    rng.shuffle(prompts)
    times = poisson_arrivals(len(prompts), params.rate_rps, rng)
    requests = [
        BenchRequest(
            arrival_s=at,
            input_ids=_TOKENIZER.encode(prefixes[g] + "\n" + question, add_bos=True),
            max_new_tokens=params.max_new_tokens,
            tenant=f"g{g}",
            session=f"g{g}u{u}",
        )
        for at, (g, u, question) in zip(times, prompts, strict=True)
    ]
    return Workload(
        name="shared_prefix",
        description=(
            f"{params.groups} groups x {params.prefix_tokens}-token shared prefix x "
            f"{params.users_per_group} users x {params.questions_per_user} "
            f"{params.question_tokens}-token questions"
        ),
        seed=seed,
        params=msgspec.structs.asdict(params),
        requests=requests,
    )


def _block_tokens(hash_id: int, size: int) -> list[int]:
    # a function of the hash id alone: equal ids are equal tokens in every run and every trace
    rng = random.Random(f"mooncake-block:{hash_id}")
    return [rng.randrange(BYTE_OFFSET, VOCAB_SIZE) for _ in range(size)]


def mooncake_replay(rows: Sequence[TraceRow], params: MooncakeParams, seed: int) -> Workload:
    """Requests of a Mooncake trace: hash ids become token blocks, timestamps arrival times.

    `seed` is only recorded in the workload: the rows alone make the requests.
    """
    if params.max_requests is not None:
        rows = rows[: params.max_requests]
    if not rows:
        raise WorkloadError("the trace has no rows")
    ordered = sorted(rows, key=lambda r: r.timestamp)
    start_ms = ordered[0].timestamp
    span_s = (ordered[-1].timestamp - start_ms) / 1000.0
    scale = 1.0
    if params.rate_rps is not None and len(ordered) > 1 and span_s > 0:
        # stretch or squeeze the recorded pace so that the mean rate is the stated one
        scale = ((len(ordered) - 1) / params.rate_rps) / span_s
    cache: dict[int, list[int]] = {}
    requests: list[BenchRequest] = []
    for i, row in enumerate(ordered):
        ids: list[int] = []
        for h in row.hash_ids:
            block = cache.get(h)
            if block is None:
                block = cache[h] = _block_tokens(h, params.replay_block_tokens)
            ids.extend(block)
        want = math.ceil(row.input_length * params.replay_block_tokens / params.trace_block_tokens)
        ids = ids[: max(1, want)] if ids else _block_tokens(-1 - i, max(1, want))
        requests.append(
            BenchRequest(
                arrival_s=(row.timestamp - start_ms) / 1000.0 * scale,
                input_ids=ids,
                max_new_tokens=max(1, min(row.output_length, params.max_new_tokens_cap)),
                session=f"r{i}",
            )
        )
    return Workload(
        name="mooncake",
        description=(
            f"Mooncake trace replay, {len(requests)} rows, one hash id = "
            f"{params.replay_block_tokens} tokens (file: {params.trace_block_tokens})"
        ),
        seed=seed,
        params=msgspec.structs.asdict(params),
        requests=requests,
    )


def load_trace(path: Path) -> list[TraceRow]:
    """Rows of a Mooncake JSONL trace; a malformed line raises WorkloadError naming it."""
    decoder = msgspec.json.Decoder(TraceRow)
    rows: list[TraceRow] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise WorkloadError(f"{path}:{number}: {exc}") from exc
            if row.input_length < 0 or row.output_length < 0:
                raise WorkloadError(f"{path}:{number}: lengths must be >= 0")
            rows.append(row)
    return rows


def write_trace(rows: Iterable[TraceRow], path: Path) -> None:
    """Write rows as Mooncake JSONL (one object per line, the format's field order)."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            ts = int(row.timestamp) if float(row.timestamp).is_integer() else row.timestamp
            obj = {
                "timestamp": ts,
                "input_length": row.input_length,
                "output_length": row.output_length,
                "hash_ids": row.hash_ids,
            }
            f.write(json.dumps(obj, separators=(", ", ": ")) + "\n")


def synthesize_mooncake_trace(
    seed: int,
    rows: int = 400,
    system_prompts: int = 12,
    sessions: int = 64,
    rate_rps: float = 4.0,
) -> list[TraceRow]:
    """A synthetic trace in Mooncake's shape: shared system prefixes and multi-turn sessions.

    Each session starts from one of a few popular system prefixes (Zipf-like popularity) and
    grows by a few blocks per turn; hash ids are allocated in first-use order as in the real
    traces. This is how `bench/data/mooncake_sample.jsonl` was made.
    """
    rng = random.Random(f"mooncake-synth:{seed}")
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system_blocks = [fresh(rng.randint(2, 8)) for _ in range(system_prompts)]
    weights = [1.0 / (k + 1) for k in range(system_prompts)]
    contexts: list[list[int]] = []
    for _ in range(sessions):
        base = rng.choices(system_blocks, weights=weights)[0]
        contexts.append(list(base))
    out: list[TraceRow] = []
    now_ms = 0.0
    for _ in range(rows):
        now_ms += rng.expovariate(rate_rps) * 1000.0
        s = rng.randrange(sessions)
        contexts[s].extend(fresh(rng.randint(1, 3)))
        ids = list(contexts[s])
        partial = rng.randint(1, 512)
        out.append(
            TraceRow(
                timestamp=float(int(now_ms)),
                input_length=(len(ids) - 1) * 512 + partial,
                output_length=rng.randint(8, 400),
                hash_ids=ids,
            )
        )
        # the answer joins the context of the next turn, as the next prompt re-sends it
        contexts[s].extend(fresh(1))
        if len(contexts[s]) > 24:
            contexts[s] = list(rng.choices(system_blocks, weights=weights)[0])
    return out


def working_set_tokens(requests: Iterable[BenchRequest], page_size: int) -> int:
    """Distinct namespaced prompt tokens in whole pages: what the fleet would need to cache."""
    seen: set[int] = set()
    for r in requests:
        ids = r.input_ids
        h = hash(("salt", r.cache_salt))
        for start in range(0, len(ids) - page_size + 1, page_size):
            h = hash((h, tuple(ids[start : start + page_size])))
            seen.add(h)
    return len(seen) * page_size


def kv_pressure(working_set: int, workers: int, capacity_tokens: int) -> float:
    """Working set tokens over total fleet cache capacity."""
    return working_set / (workers * capacity_tokens)


def capacity_for_pressure(
    working_set: int, workers: int, pressure: float, page_size: int, floor_tokens: int
) -> int:
    """Per-worker capacity (whole pages, at least `floor_tokens`) that yields `pressure`."""
    if pressure <= 0 or workers <= 0:
        raise WorkloadError("pressure and workers must be > 0")
    raw = working_set / (pressure * workers)
    pages = max(math.ceil(floor_tokens / page_size), int(raw // page_size))
    return pages * page_size
