"""The fleet as the router sees it: workers, their health, breakers, drain flags and models.

A fleet serves models; a model is served by workers (DESIGN.md section 9). A worker serves the
names its config gives, else those it advertised when it registered (`router.fleet`); the pool
keeps, per served name, the workers of that name, so a request is only ever planned among the
workers of its model (`serving`). A fleet whose workers all serve the same names is one pool:
it takes any `model` string, as SGLang does (it ignores the field; clients send "default"),
but a name some worker served and none serves now: that model is gone, not another's alias.
Only once every worker's models are known: a worker not registered yet may serve another
model, so it takes nothing, and a name no known worker serves waits for it (a 503); a request
naming no model ("default", or none) goes meanwhile to the known workers if they serve one.

Plain state, mutated only from the event loop (health checker, proxy, admin API), never across
an await in the middle of an update, so it needs no lock.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator
from typing import NoReturn

import msgspec

from indexer.engines import PdRole
from router.config import BreakerConfig, WorkerConfig
from router.errors import (
    AmbiguousModelError,
    ConflictError,
    ModelUnavailableError,
    NotFoundError,
    UnknownModelError,
)
from router.routing.breaker import BreakerState, CircuitBreaker

__all__ = [
    "ModelChoice",
    "WorkerEntry",
    "WorkerPool",
    "WorkerStatus",
    "WorkerSummary",
    "first_colon_split",
    "split_adapter",
    "splits_served_name_first",
]


class WorkerStatus(enum.StrEnum):
    """Why a worker does or does not take traffic."""

    READY = "ready"
    # added at run time (admin API, reload, another replica) and not yet registered and
    # health-checked: sent nothing until then (`Supervisor.add`)
    CHECKING = "checking"
    # its KV events are another worker's stream (refused when it registered): the same server
    # under a name the config cannot read as its address, or a copy-pasted `events`. Routed, it
    # would be a second candidate for one engine, with half its load each
    DUPLICATE = "duplicate"
    UNHEALTHY = "unhealthy"  # last health check failed
    CIRCUIT_OPEN = "circuit_open"
    DRAINING = "draining"


class WorkerSummary(msgspec.Struct):
    """One worker on `GET /admin/workers`."""

    id: str
    url: str
    status: WorkerStatus
    healthy: bool
    draining: bool
    breaker: BreakerState
    consecutive_failures: int
    model: str  # the name its cache is indexed under ("" while unknown)
    models: list[str]  # every name it serves, that one first
    kv_events: bool
    discovered: bool
    streams: list[str]
    role: PdRole  # prefill/decode disaggregation: "both" serves whole requests
    queued_prefill_tokens: int
    running: int
    # seconds its KV events stay unfollowed, routed by load with no hit predicted: the
    # false-hit watch's quarantine (`FalseHitResponse.respond`); 0: followed
    unfollowed_s: float = 0.0
    # why the tokenizer its server info says cannot be the router's (None: it can, or it says
    # none): nothing of it is predicted (`router.fleet.tokenizer_match`)
    tokenizer_mismatch: str | None = None


class WorkerEntry:
    """One worker and the router's knowledge of it."""

    def __init__(self, config: WorkerConfig, breaker: BreakerConfig) -> None:
        self.config = config
        self.id = config.worker_id
        self.url = config.url.rstrip("/")
        # its server spelled one way (`WorkerConfig.server`), as every replica spells it: what
        # a decision on the wire names besides the id (`router.cluster.wire.Pending.server`)
        scheme, host, port, path = config.server
        host = f"[{host}]" if ":" in host else host
        self.server = f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"
        # optimistic until the first health check says otherwise: the startup registers and
        # checks its workers before it listens (`router.http.app`)
        self.healthy = True
        # False while a worker added at run time waits for its registration and its first
        # health check (`Supervisor.add`): a worker nobody checked may never answer, and the
        # requests sent meanwhile would hang until their timeout
        self.checked = True
        # when a health check last found it down (the supervisor's clock; None: never)
        self.seen_down_at: float | None = None
        # until when its KV events are not followed (the false-hit watch's quarantine; the
        # supervisor's clock; None: followed)
        self.unfollowed_until: float | None = None
        self.draining = False
        self.breaker = CircuitBreaker(breaker.failure_threshold, breaker.cooldown_s)
        # set once the worker's streams are registered with the indexer
        self.streams: list[str] = []
        # the worker whose KV-event stream this one's is, while that refuses its registration
        # (`WorkerStatus.DUPLICATE`: not routed)
        self.same_stream_as: str | None = None
        # the names it serves, its cache's first: the config's, else set when it registers
        # (None until then, () when it advertises none)
        self.models: tuple[str, ...] | None = config.served_models or None
        self.discovered = not config.kv_events and self.models is not None
        # its part in prefill/decode pairs: the config's, else read when it registers
        self.role: PdRole = config.role or "both"
        self.bootstrap_port: int | None = config.bootstrap_port
        # the bootstrap port its server info advertised when last read (None: none, or not
        # read): the config's `bootstrap_port` is taken over it, and said when it differs
        self.advertised_bootstrap_port: int | None = None
        # the KV pool of each of its ranks in tokens, as its /server_info advertised it when it
        # registered (`max_total_num_tokens`); None: unknown, no admission-time forecast
        self.capacity_tokens: int | None = None
        # its host tier per rank in tokens (SGLang HiCache), None: none or not advertised
        self.host_capacity_tokens: int | None = None
        # how many requests each rank runs at once (`max_running_requests`), None: unknown
        self.max_running_requests: int | None = None
        # whether it may batch again before a prompt it admitted is cached (overlap scheduler,
        # chunked prefill: `router.fleet.discovery.caches_prompts_late`; until read: yes)
        self.caches_prompts_late = True
        # whether its /flush_cache can empty one salt's pages (its /server_info says so)
        self.flushes_by_salt = False
        # the LoRA adapters it lists by name (vLLM's /v1/models cards with a parent): id ->
        # the base model's name
        self.adapters: dict[str, str] = {}
        # the engine version its /server_info advertises (SGLang's `version`), None: unknown
        self.version: str | None = None

    @property
    def splits_served_name_first(self) -> bool | None:
        """Whether it reads a `model` holding ":" as `split_adapter` does (None: unknown)."""
        return splits_served_name_first(self.config.engine, self.version)

    @property
    def cache_model(self) -> str:
        """The model its KV events are indexed under: its first name ("" while unknown)."""
        return self.models[0] if self.models else ""

    def status(self, now: float) -> WorkerStatus:
        """The worker's routing status at `now`."""
        if self.draining:
            return WorkerStatus.DRAINING
        if not self.checked:
            return WorkerStatus.CHECKING
        if self.same_stream_as is not None:
            return WorkerStatus.DUPLICATE
        if not self.healthy:
            return WorkerStatus.UNHEALTHY
        if not self.breaker.allows(now):
            return WorkerStatus.CIRCUIT_OPEN
        return WorkerStatus.READY

    def routable(self, now: float) -> bool:
        """Whether new requests may go to this worker at `now`."""
        return self.status(now) is WorkerStatus.READY

    def unfollowed_s(self, now: float) -> float:
        """The seconds its KV events stay unfollowed from `now` (0: followed), as
        `/admin/workers`, `/metrics` and the dashboard show them."""
        until = self.unfollowed_until
        return 0.0 if until is None else max(0.0, until - now)


# the SGLang releases kvroute supports whose OpenAI layer (`_parse_model_parameter`) reads a
# `model` holding ":" as `split_adapter` does (0.5.23), and those that split it at the first
# ":" whatever they serve (0.5.17-0.5.22: a served `org/m:v1` is adapter `v1` of `org/m`)
_SERVED_NAME_FIRST = ((0, 5, 23), (0, 5, 23))
_FIRST_COLON = ((0, 5, 17), (0, 5, 22))
# what a request that asks for no model in particular names (SGLang ignores the field; clients
# send "default")
_UNNAMED = frozenset(("", "default"))
_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:[-+].*)?")


def splits_served_name_first(engine: str, version: str | None) -> bool | None:
    """Whether a worker reads a `model` holding ":" as `split_adapter` does: True for SGLang
    0.5.23, False for 0.5.17-0.5.22 (the first ":" splits); None when not known (no version
    advertised, a pre-release or another release). vLLM names an adapter by itself, never
    as `base:adapter`: the router reads its requests its own way (`WorkerPool.resolve`)."""
    if engine != "sglang":
        return True
    found = _RELEASE.fullmatch(version.strip()) if version else None
    if found is None:
        return None
    release = tuple(map(int, found.groups()))
    if _SERVED_NAME_FIRST[0] <= release <= _SERVED_NAME_FIRST[1]:
        return True
    if _FIRST_COLON[0] <= release <= _FIRST_COLON[1]:
        return False
    return None


def split_adapter(model: str, served: Iterable[str]) -> tuple[str, str | None]:
    """SGLang's `base:adapter` spelling: (base model, LoRA adapter or None).

    As SGLang's OpenAI layer reads it (`OpenAIServingBase._parse_model_parameter`, 0.5.23): a
    name without ":" or equal to a served name is the model itself; one starting with a served
    name and ":" names that model and the adapter after it (served names may hold a colon, e.g.
    object-storage URIs); otherwise the first ":" splits. Both halves are stripped and an empty
    adapter is none. A router in front of several models tries each served name (the longest
    first, so "a:b" beats "a" for "a:b:c") where SGLang compares with its one name.
    """
    if ":" not in model:
        return model, None
    names = sorted((n for n in served if model == n or model.startswith(n + ":")), key=len)
    if names and model == names[-1]:
        return model, None
    if names:
        base, adapter = names[-1], model[len(names[-1]) + 1 :]
    else:
        base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def first_colon_split(model: str) -> tuple[str, str | None]:
    """`model` as SGLang 0.5.17-0.5.22 read it: split at its first ":" whatever they serve."""
    if ":" not in model:
        return model, None
    base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


class ModelChoice(msgspec.Struct, frozen=True):
    """The model a request's `model` string resolved to."""

    model: str  # the served name it resolved to ("" in a fleet whose workers name none)
    # the name its workers' caches are indexed under, and the key of `WorkerPool.serving`
    cache_model: str
    adapter: str | None  # the LoRA adapter the string names (`base:adapter`), if any
    # whether its workers read a request's `lora_path` (SGLang's field): vLLM ignores unknown
    # fields and serves the base model, so there the field names no adapter's pages
    reads_lora_path: bool = True


class WorkerPool:
    """Workers by id, in the order they were added, and the models they serve."""

    def __init__(self, breaker: BreakerConfig) -> None:
        self._breaker = breaker
        self._workers: dict[str, WorkerEntry] = {}
        self._by_server: dict[str, WorkerEntry] = {}  # `WorkerEntry.server` -> its entry
        # asked on every request, so kept and rebuilt on membership changes (`_reindex`)
        self._everyone: tuple[WorkerEntry, ...] = ()
        self._by_model: dict[str, tuple[WorkerEntry, ...]] = {}
        self._cache_model: dict[str, str] = {}  # served name -> `ModelChoice.cache_model`
        self._single: ModelChoice | None = ModelChoice("", "", None)
        self._names_adapters = False
        self._adapters: dict[str, str] = {}  # adapter -> base model, as the workers list them
        # adapters that workers of several base models list: adapter -> those bases (`resolve`)
        self._ambiguous: dict[str, tuple[str, ...]] = {}
        # names some worker served and none serves now: a one-pool fleet's any-name rule must
        # not hand their requests to the model left (a pool's last worker removed, or back
        # serving another model)
        self._ever: set[str] = set()
        self._gone: frozenset[str] = frozenset()
        # cache names whose every worker is vLLM (`ModelChoice.reads_lora_path`)
        self._vllm_only: frozenset[str] = frozenset()
        # workers whose models are not known yet (not registered): a name nobody is known to
        # serve may be theirs (`_refuse`)
        self._unknown = 0
        self._known_one: str | None = None

    def reconfigure(self, breaker: BreakerConfig) -> None:
        """Every worker's breaker, and those of workers added later, with `breaker`'s bounds."""
        self._breaker = breaker
        for entry in self._workers.values():
            entry.breaker.reconfigure(breaker.failure_threshold, breaker.cooldown_s)

    def add(self, config: WorkerConfig) -> WorkerEntry:
        """Add a worker; its id must be new."""
        entry = WorkerEntry(config, self._breaker)
        if entry.id in self._workers:
            raise ConflictError(f"worker {entry.id!r} already exists")
        for other in self._workers.values():
            if other.config.server == config.server:
                raise ConflictError(f"{config.url} is worker {other.id!r} already")
        self._workers[entry.id] = entry
        self._by_server[entry.server] = entry
        self._reindex()
        return entry

    def remove(self, worker_id: str) -> WorkerEntry:
        """Take a worker out of the pool."""
        try:
            entry = self._workers.pop(worker_id)
        except KeyError:
            raise NotFoundError(f"no worker {worker_id!r}") from None
        if self._by_server.get(entry.server) is entry:
            del self._by_server[entry.server]
        self._reindex()
        return entry

    def set_models(
        self,
        entry: WorkerEntry,
        models: tuple[str, ...],
        adapters: dict[str, str] | None = None,
    ) -> None:
        """Record the names `entry` serves (discovered), and the LoRA adapters it lists by
        name; ignored once it left the pool."""
        if self._workers.get(entry.id) is entry:
            entry.models = models
            if adapters is not None:
                entry.adapters = adapters
            self._reindex()

    def get(self, worker_id: str) -> WorkerEntry:
        """The worker with this id."""
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFoundError(f"no worker {worker_id!r}") from None

    def find(self, worker_id: str) -> WorkerEntry | None:
        """The worker with this id, or None."""
        return self._workers.get(worker_id)

    def server_of(self, worker_id: str) -> str | None:
        """The server (`WorkerEntry.server`) the id names here, or None: not in the pool."""
        entry = self._workers.get(worker_id)
        return None if entry is None else entry.server

    def worker_at(self, server: str) -> str | None:
        """The id of the worker at `server` (`WorkerEntry.server`) here, or None."""
        entry = self._by_server.get(server)
        return None if entry is None else entry.id

    def served(self) -> tuple[str, ...]:
        """Every name a worker serves, in the order the workers were added."""
        return tuple(self._by_model)

    def ambiguous_adapters(self) -> dict[str, tuple[str, ...]]:
        """The LoRA adapters that workers of several base models list by name, each with
        those bases (sorted): requests naming one by itself are refused (`resolve`)."""
        return dict(self._ambiguous)

    def resolve(self, model: str) -> ModelChoice:
        """The served model a request naming `model` goes to; UnknownModelError when the fleet
        serves several and none of them is `model` (or its base, in the `base:adapter` form),
        or `model` is gone (`_refuse`: ModelUnavailableError instead while some worker's
        models are not known, the fleet then being no one pool); AmbiguousModelError when
        `model` is an adapter that workers of several base models list."""
        bases = self._ambiguous.get(model)
        if bases is not None and model not in self._by_model:
            # any pick would be a guess that changes with the workers (the last one listed
            # won: removing an unrelated worker moved a tenant to another base model)
            raise AmbiguousModelError(model, bases)
        parent = self._adapters.get(model)
        if parent is not None and model not in self._by_model and parent in self._by_model:
            # an adapter named by itself (vLLM): its base's pool, its pages its own namespace
            cache = self._single.cache_model if self._single else self._cache_model[parent]
            return ModelChoice(parent, cache, model, cache not in self._vllm_only)
        base, adapter = split_adapter(model, self._by_model)
        if (
            self._gone
            and base not in self._by_model  # a served name (one may hold a colon) is served
            and (model in self._gone or split_adapter(model, self._gone)[0] in self._gone)
        ):
            self._refuse(model)
        if self._single is not None:
            # one pool takes every name (SGLang ignores it), and keeps the alias it was asked
            served = base if base in self._by_model else self._single.model
            if self._names_adapters and model not in self._by_model:
                # vLLM serves a name that is not its model's only as a LoRA adapter's (the
                # events' `lora_name`), whose pages are never the base model's
                adapter = model
            return ModelChoice(served, self._single.cache_model, adapter, not self._names_adapters)
        if base not in self._by_model:
            if model in _UNNAMED and self._known_one is not None:
                # no model asked for, and the known workers serve one: theirs, while the others
                # register (any model does for this client; a name would not). Else a worker
                # still loading, or one just added, would turn every such request away
                base = self._known_one
            else:
                self._refuse(model)
        cache = self._cache_model[base]
        return ModelChoice(base, cache, adapter, cache not in self._vllm_only)

    def split_contested(self, model: str) -> bool:
        """Whether SGLang 0.5.17-0.5.22 read `model` (an OpenAI request's) otherwise than
        `resolve` does: it is, or starts with, a served name holding a ":" (the first ":"
        is then not where 0.5.23 splits)."""
        return ":" in model and split_adapter(model, self._by_model) != first_colon_split(model)

    def _refuse(self, model: str) -> NoReturn:
        """A 404 only when the fleet is known not to serve `model` (every worker's models are
        known); while some are not, a 503: it may be theirs. Before, a fleet swapped in one
        reload, or whose only worker was down, answered 404 (an OpenAI client does not retry
        one) for a model it was about to serve again. An empty pool knows of no model it does
        not serve either (its workers being renamed, on a replica reading another's reload):
        a 503 too, where it said "this fleet serves " and no model."""
        if self._unknown or not self._everyone:
            raise ModelUnavailableError(model, self.served(), self._unknown)
        raise UnknownModelError(model, self.served())

    def set_role(
        self,
        entry: WorkerEntry,
        role: PdRole,
        bootstrap_port: int | None,
        *,
        advertised_port: int | None = None,
    ) -> None:
        """Record the prefill/decode role `entry` takes (its config's, else what it
        advertised) and the bootstrap port it `advertised_port`; ignored once it left the
        pool."""
        if self._workers.get(entry.id) is entry:
            entry.role, entry.bootstrap_port = role, bootstrap_port
            entry.advertised_bootstrap_port = advertised_port

    def disaggregated(self, cache_model: str) -> bool:
        """Whether `cache_model` is served by prefill/decode pairs (it has workers of each)."""
        roles = {entry.role for entry in self.serving(cache_model)}
        return "prefill" in roles and "decode" in roles

    def serving(self, cache_model: str) -> tuple[WorkerEntry, ...]:
        """The workers a request resolved to `cache_model` (`resolve`) may go to."""
        if self._single is not None:
            return self._everyone
        return self._by_model.get(cache_model, ())

    def _reindex(self) -> None:
        by_model: dict[str, list[WorkerEntry]] = {}
        for entry in self._workers.values():
            for name in entry.models or ():
                by_model.setdefault(name, []).append(entry)
        self._everyone = tuple(self._workers.values())
        self._unknown = sum(entry.models is None for entry in self._everyone)
        self._by_model = {name: tuple(entries) for name, entries in by_model.items()}
        self._ever.update(by_model)
        self._gone = frozenset(self._ever.difference(by_model))
        # vLLM workers only: a request naming another model names a LoRA adapter (`resolve`)
        self._names_adapters = bool(self._everyone) and all(
            e.config.engine == "vllm" for e in self._everyone
        )
        # A name's requests are matched against the cache of its workers' first name when that
        # name has exactly the same workers (aliases listed alike); otherwise under the name
        # itself, which keeps `serving(cache_model)` equal to the workers of the name.
        groups = {name: frozenset(e.id for e in entries) for name, entries in by_model.items()}
        self._cache_model = {}
        for name, entries in by_model.items():
            first = entries[0].cache_model
            self._cache_model[name] = first if groups.get(first) == groups[name] else name
        self._index_adapters(groups)
        self._vllm_only = frozenset(
            cache
            for name, cache in self._cache_model.items()
            if all(e.config.engine == "vllm" for e in by_model[name])
        )
        # every named worker serving every name: one pool, which also takes unnamed workers;
        # but only once every worker's models are known. A worker not registered yet (down at
        # startup, its server info slow, just added) may serve another model: until it says,
        # each request goes to the known workers of the name it gives, and a name no known
        # worker serves is a 503 (`_refuse`). Before, the known workers' one model took every
        # name meanwhile (a down model-y worker's requests were answered by model-x) and the
        # unknown workers took the requests of that model too.
        one_known = len(set(groups.values())) <= 1
        if not self._unknown and one_known:
            first_name = next(iter(by_model), "")
            self._single = ModelChoice(first_name, self._cache_model.get(first_name, ""), None)
        else:
            self._single = None
        # the one model the known workers serve while others are unknown (`resolve`: what a
        # request naming no model goes to meanwhile)
        self._known_one = next(iter(by_model)) if by_model and one_known and self._unknown else None

    def _index_adapters(self, groups: dict[str, frozenset[str]]) -> None:
        """Each adapter name the workers list, by the base model its cards name: one base
        (or bases that are one pool's aliases, served by the same workers) is that base's;
        several are ambiguous (`resolve`). A base no worker serves is a pool of its own: the
        adapter may be that worker's, under a name its config replaced (fail closed)."""
        parents: dict[str, set[str]] = {}
        for entry in self._everyone:
            for name, parent in entry.adapters.items():
                parents.setdefault(name, set()).add(parent)
        self._adapters, self._ambiguous = {}, {}
        for name, bases in parents.items():
            # a served base is its workers (aliases share them), an unserved one its own name
            pools: set[frozenset[str] | str] = {groups.get(base) or base for base in bases}
            if len(pools) == 1:
                self._adapters[name] = min(bases)  # aliases of one pool: any names it
            else:
                self._ambiguous[name] = tuple(sorted(bases))

    def __iter__(self) -> Iterator[WorkerEntry]:
        return iter(self._everyone)

    def __len__(self) -> int:
        return len(self._workers)
