"""What a config reload changes: the diff between the running config and a new file (pure).

A reload (`router.http.reload`) applies some settings to the running router and cannot apply
others without a restart (the listen address, the indexer, the tokenizer, the admin token,
tracing, the cluster...). Each key is one or the other by this module's table: a key not listed
as live needs a restart, so a setting added to the config later is reported, never silently
ignored. The config a reload runs on is the new file with every restart-only key kept at its
running value: the router never claims a setting it does not apply, and the next reload reports
the same keys again until a restart.

Workers are diffed by id: added, removed, or changed (same id, other settings: replaced).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.config import RouterConfig, WorkerConfig

__all__ = ["ConfigDiff", "diff_configs", "worker_settings"]

# section -> its fields a running router takes live (None: every field)
_LIVE: dict[str, frozenset[str] | None] = {
    # the tree of approx_tree is sized at start (approx_max_tree_size, its eviction interval), and
    # another policy name is another policy with its own memory
    "policy": frozenset(
        {
            "seed",
            "hit_weight",
            "decode_weight",
            "decode_step_weight",
            "room_weight",  # read per decision by the policy (the planner counts it always)
            "medium_weights",
            "approx_cache_threshold",
            "approx_balance_abs",
            "approx_balance_rel",
            "hold_until_room",  # read per request by the proxy
            "hold_output_ratio",
        }
    ),
    "timeouts": None,
    "health": None,
    "breaker": None,
    "pd": None,
    # max_body_bytes is also aiohttp's client_max_size and idle_timeout_s its keep-alive
    # timeout, both fixed when the server starts; the rest apply to new connections
    "limits": frozenset(
        {
            "max_retries",
            "max_held_requests",
            "max_json_depth",
            "max_salt_bytes",
            "max_adapter_name_bytes",
            "max_connections",
            "header_timeout_s",
            "body_timeout_s",
            "refusal_log_interval_s",
        }
    ),
    "query": frozenset({"token"}),  # read per request; `enabled` decides a route at start
}
_LIVE_SCALARS = frozenset({"salt_header"})


class ConfigDiff(msgspec.Struct, frozen=True, kw_only=True):
    """What a reload did: the answer of POST /admin/reload and the SIGHUP log line."""

    workers_added: list[str] = []
    workers_removed: list[str] = []
    workers_changed: list[str] = []  # same id, other settings: removed and added again
    changed: list[str] = []  # dotted keys now running with the file's value
    needs_restart: list[str] = []  # dotted keys that differ in the file, kept at the old value
    # workers added or changed that could not be registered yet (down, or refused), with why:
    # in the pool, routed by load alone, retried on every health round
    not_registered: dict[str, str] = {}
    # workers added or changed that were registered, with what in their config to check (event
    # sockets other than the ones they advertise): their streams may predict nothing
    warnings: dict[str, str] = {}
    # with a [cluster]: workers the file names, its entry unchanged by this reload, that run
    # otherwise (or not at all) as the cluster's record has them, with why: the file's entry is
    # not applied (an admin change, or another replica's newer file, stands)
    kept_by_cluster: dict[str, str] = {}

    @property
    def empty(self) -> bool:
        """Whether the file says what the router already runs."""
        return not (
            self.workers_added
            or self.workers_removed
            or self.workers_changed
            or self.changed
            or self.needs_restart
        )

    def summary(self) -> str:
        """One line for the log."""
        kept = (
            f"kept by the cluster (the file's entry not applied): {', '.join(self.kept_by_cluster)}"
        )
        if self.empty:
            return "nothing changed" + (f"; {kept}" if self.kept_by_cluster else "")
        parts = []
        for label, keys in (
            ("workers added", self.workers_added),
            ("workers removed", self.workers_removed),
            ("workers changed", self.workers_changed),
            ("changed", self.changed),
            ("needs restart (kept)", self.needs_restart),
        ):
            if keys:
                parts.append(f"{label}: {', '.join(keys)}")
        if self.not_registered:
            waiting = ", ".join(f"{k} ({why})" for k, why in self.not_registered.items())
            parts.append(f"not registered yet: {waiting}")
        if self.warnings:
            parts.append("check: " + ", ".join(f"{k} ({why})" for k, why in self.warnings.items()))
        if self.kept_by_cluster:
            parts.append(kept)
        return "; ".join(parts)


def _fields(struct: msgspec.Struct) -> dict[str, Any]:
    return {f.name: getattr(struct, f.name) for f in msgspec.structs.fields(struct)}


def _section(name: str, old: Any, new: Any) -> tuple[Any, list[str], list[str]]:
    """(the section to run, keys changed live, keys kept for a restart) of one section."""
    if old == new:
        return old, [], []
    live = _LIVE.get(name, frozenset())
    if not isinstance(old, msgspec.Struct) or not isinstance(new, msgspec.Struct):
        # an optional section appearing or going ([cluster]), or a plain table ([fleet])
        return old, [], [name]
    changed: list[str] = []
    kept: dict[str, Any] = {}
    old_fields, new_fields = _fields(old), _fields(new)
    for field, value in new_fields.items():
        if value == old_fields[field]:
            continue
        if live is None or field in live:
            changed.append(f"{name}.{field}")
        else:
            kept[field] = old_fields[field]
    running = msgspec.structs.replace(new, **kept) if kept else new
    return running, changed, [f"{name}.{field}" for field in kept]


def _workers(
    old: tuple[WorkerConfig, ...], new: tuple[WorkerConfig, ...]
) -> tuple[list[str], list[str], list[str]]:
    before = {w.worker_id: w for w in old}
    after = {w.worker_id: w for w in new}
    added = [wid for wid in after if wid not in before]
    removed = [wid for wid in before if wid not in after]
    changed = [wid for wid, w in after.items() if wid in before and before[wid] != w]
    return added, removed, changed


def worker_settings(mine: WorkerConfig, theirs: WorkerConfig) -> list[tuple[str, Any, Any]]:
    """The settings of one worker that differ between two configs of it: (field, in `mine`,
    in `theirs`), what a log line names (worker settings hold no secret: `WorkerConfig`)."""
    return [
        (name, getattr(mine, name), getattr(theirs, name))
        for name in mine.__struct_fields__
        if getattr(mine, name) != getattr(theirs, name)
    ]


def diff_configs(old: RouterConfig, new: RouterConfig) -> tuple[RouterConfig, ConfigDiff]:
    """The config to run after reloading `new` over `old`, and what changes.

    The returned config is `new` with every key that needs a restart at its value in `old`.
    """
    changed: list[str] = []
    restart: list[str] = []
    running: dict[str, Any] = {}
    for name, value in _fields(new).items():
        previous = getattr(old, name)
        if name == "workers":
            running[name] = value
        elif name in _LIVE_SCALARS:
            running[name] = value
            if value != previous:
                changed.append(name)
        else:
            running[name], live, kept = _section(name, previous, value)
            changed += live
            restart += kept
    added, removed, replaced = _workers(old.workers, new.workers)
    diff = ConfigDiff(
        workers_added=added,
        workers_removed=removed,
        workers_changed=replaced,
        changed=changed,
        needs_restart=restart,
    )
    return msgspec.structs.replace(old, **running), diff
