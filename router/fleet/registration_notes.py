"""What the log says about workers' registrations, each thing once.

A worker is registered again and again: its refusals are retried on every health round, and a
restart, a STALE stream or a reload registers it anew. What a registration finds (why it was
refused, a replay socket it cannot trust, a config naming models the worker does not advertise,
a configured role or bootstrap port the worker does not advertise, an adapter name workers of
several base models list, a tokenizer that cannot be the router's)
is said when it is new or changed, never on every round: the same line every
`health.interval_s` would bury the log. The admin API shows the last of them (`refusal`,
`doubt`, `tokenizer_mismatch`).
"""

from __future__ import annotations

import logging

from indexer.engines import PdRole
from router.errors import RequestError
from router.routing.pool import WorkerEntry, WorkerPool

__all__ = ["RegistrationNotes"]

log = logging.getLogger(__name__)

# per kind of note, how many workers' are kept: workers come and go, and a line said again
# costs nothing
_KEPT = 4096


def _warn_once(said: dict[str, str], worker: str, note: str) -> None:
    """Say `note` of `worker` unless it is what `said` (each worker's last note, bounded)
    holds: re-registrations and re-reads of its settings would repeat it."""
    if said.get(worker) == note:
        return
    if len(said) >= _KEPT:
        said.clear()
    said[worker] = note
    log.warning("worker %s: %s", worker, note)


class RegistrationNotes:
    """The last thing said per worker about its registration, so that it is said once."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        # per worker, the last reason it could not be registered that was logged (`refused`)
        self._said: dict[str, str] = {}
        # per worker, what its registration found suspect but registered anyway (`doubted`)
        self._doubts: dict[str, str] = {}
        # per worker, the configured and advertised models that contradict, as last said
        # (`check_named`)
        self._misnamed: dict[str, str] = {}
        # the adapters workers of several base models list, as last said (`say_ambiguous`)
        self._ambiguous: dict[str, tuple[str, ...]] = {}
        # per worker, why its tokenizer cannot be the router's, as last said (`check_tokenizer`)
        self._tokenizers: dict[str, str] = {}
        # per worker, the configured and advertised roles that contradict, as last said
        # (`check_role`)
        self._roles: dict[str, str] = {}
        # per worker, the configured and advertised bootstrap ports that differ, as last said
        # (`check_bootstrap_port`)
        self._ports: dict[str, str] = {}
        # per worker, the advertised settings taken as unknown, as last said (`check_settings`)
        self._settings: dict[str, str] = {}

    def forget(self, worker: str) -> None:
        """`worker` was removed from the pool: one added again under its id (a reload that
        changed it) has its own reasons."""
        self._doubts.pop(worker, None)
        self._misnamed.pop(worker, None)
        self._tokenizers.pop(worker, None)
        self._roles.pop(worker, None)
        self._ports.pop(worker, None)
        self._settings.pop(worker, None)
        # fewer workers list fewer bases: said again if a registration makes one ambiguous
        self._ambiguous = self._pool.ambiguous_adapters()
        self._said.pop(worker, None)

    def refusal(self, worker: str) -> str | None:
        """Why `worker` could not be registered, as last logged (None: nothing logged)."""
        return self._said.get(worker)

    def registered(self, worker: str) -> None:
        """`worker` was registered: a refusal after this is said again."""
        self._said.pop(worker, None)

    def refused(self, entry: WorkerEntry, exc: RequestError) -> None:
        """Say why `entry` cannot be registered: once, and again only when the reason changes
        (the health rounds retry every `health.interval_s`: the same line every round would
        bury the log)."""
        said = str(exc).removeprefix(f"worker {entry.id}: ")  # the line names it already
        if self._said.get(entry.id) == said:
            log.debug("worker %s: %s (still)", entry.id, said)
            return
        if len(self._said) >= _KEPT:
            self._said.clear()
        self._said[entry.id] = said
        log.warning("worker %s: %s (retrying on each health round)", entry.id, said)

    def doubt(self, worker: str) -> str | None:
        """What `worker`'s registration found suspect in its config, as logged (None: nothing):
        registered all the same (`router.fleet.advertised.replay_proof`, `block_size_note`; a
        role, bootstrap port or model its config gives that the worker contradicts). Before,
        a reload's answer named only the first kind: a prefill configured `role = "decode"`
        was said in the log alone, and the answer warned of nothing."""
        said = [
            note
            for kind in (self._doubts, self._roles, self._ports, self._misnamed)
            if (note := kind.get(worker)) is not None
        ]
        return "; ".join(said) or None

    def doubted(self, worker: str, note: str | None) -> None:
        """What `worker`'s registration found suspect now (None: nothing): said once per worker
        and note (re-registrations would repeat it)."""
        if note is None:
            self._doubts.pop(worker, None)
            return
        _warn_once(self._doubts, worker, note)

    def check_named(self, entry: WorkerEntry, advertised: list[str]) -> None:
        """Say when none of the models `entry`'s config names is one it advertises (once per
        worker and names: re-registrations would repeat it). The config's names are used all
        the same (a router-side name is allowed); what this catches is a URL pointing at
        another model's worker, whose requests it would answer with that model."""
        configured = entry.config.served_models
        if not configured or not advertised or set(configured) & set(advertised):
            self._misnamed.pop(entry.id, None)
            return
        note = (
            f"the config says it serves {', '.join(map(repr, configured))}, it advertises "
            f"{', '.join(map(repr, advertised))}: routed as the config says; check its url"
        )
        _warn_once(self._misnamed, entry.id, note)

    def check_role(self, entry: WorkerEntry, advertised: PdRole | None) -> None:
        """Say when the role `entry`'s config gives contradicts the one the worker advertises
        (`advertised`, SGLang's `disaggregation_mode`; None: it says none), once per worker and
        roles (re-registrations, and re-reads of its settings, would repeat it). The config's
        role is used all the same, as it is meant to override; what this catches is a role
        written on the wrong worker: every pair through it fails, and its error (the decode
        cannot reach the "prefill"'s bootstrap server) sends the operator to look at ports."""
        configured = entry.config.role
        if configured is None or advertised is None or configured == advertised:
            self._roles.pop(entry.id, None)
            return
        note = (
            f"the config says role {configured!r}, the worker advertises {advertised!r} (its "
            f"disaggregation_mode): routed as a {configured} worker, as the config says, and "
            "each pair through it is likely to fail; fix `role` in its config, or leave it "
            "out to take the worker's"
        )
        _warn_once(self._roles, entry.id, note)

    def check_bootstrap_port(
        self, entry: WorkerEntry, role: PdRole, advertised: int | None
    ) -> None:
        """Say when the bootstrap port `entry`'s config gives it, routed as a prefill worker
        (`role`), is not the one the worker advertises (`advertised`, SGLang's
        `disaggregation_bootstrap_port`; None: it says none), once per worker and ports (as
        `check_role`). The config's port is told its decodes all the same, as it is meant to
        override (a port mapped between the worker and its decodes); what this catches is a
        port written wrong: every pair through it fails, and before, nothing said why but the
        decodes' "cannot reach the bootstrap server", charged to the worker."""
        configured = entry.config.bootstrap_port
        if role != "prefill" or None in (configured, advertised) or configured == advertised:
            self._ports.pop(entry.id, None)
            return
        note = (
            f"the config says bootstrap_port {configured}, the worker advertises {advertised} "
            f"(its disaggregation_bootstrap_port): its decodes are told {configured}, as the "
            f"config says, and each pair through it fails unless {configured} reaches its "
            "bootstrap server (a mapped port); fix `bootstrap_port` in its config, or leave it "
            "out to take the worker's"
        )
        _warn_once(self._ports, entry.id, note)

    def tokenizer_mismatch(self, worker: str) -> str | None:
        """Why `worker`'s tokenizer cannot be the router's, as last said (None: it can, or
        cannot be told)."""
        return self._tokenizers.get(worker)

    def check_tokenizer(self, worker: str, note: str | None) -> None:
        """What `worker`'s settings, read just now, say of its tokenizer against the router's
        (`router.fleet.tokenizer_match`; None: nothing wrong, or nothing to tell): said once
        per worker and note, at registration and again when a re-read changes it. Before,
        nothing said it: a router tokenizing otherwise than its workers predicted 0 everywhere,
        its streams `synced`, and no counter rose. A mismatch that ends (the worker restarted
        with the router's kind of tokenizer) is said too: before, the WARNING stood last in the
        log while the admin API no longer showed it."""
        if note is None:
            if self._tokenizers.pop(worker, None) is not None:
                log.info(
                    "worker %s: its server info no longer says a tokenizer the router's cannot "
                    "be: the tokenizer mismatch is over",
                    worker,
                )
            return
        if self._tokenizers.get(worker) == note:
            return
        if len(self._tokenizers) >= _KEPT:
            self._tokenizers.clear()
        self._tokenizers[worker] = note
        log.warning("worker %s: %s", worker, note)

    def check_settings(self, worker: str, note: str | None) -> None:
        """What `worker`'s settings, read just now, advertise that is taken as unknown
        (`router.fleet.discovery.settings_note`; None: nothing): said once per worker and
        note, at registration and when a re-read changes it. Before, an advertised
        `hicache_ratio` of 1e308 made the registration raise (an ERROR traceback, a 500 on
        `POST /admin/workers`), and absurd capacities were taken silently."""
        if note is None:
            self._settings.pop(worker, None)
            return
        if self._settings.get(worker) == note:
            return
        if len(self._settings) >= _KEPT:
            self._settings.clear()
        self._settings[worker] = note
        log.warning("worker %s: its server info advertises %s", worker, note)

    def say_ambiguous(self, entry: WorkerEntry) -> None:
        """Say which adapter names `entry`'s registration made ambiguous (workers of several
        base models list them: their requests are refused, `WorkerPool.resolve`): once per
        name and bases, here rather than on each refused request."""
        now = self._pool.ambiguous_adapters()
        for name, bases in now.items():
            if self._ambiguous.get(name) != bases:
                log.warning(
                    "worker %s: LoRA adapter %r is listed by workers of several base models "
                    "(%s): requests naming it alone are refused (400) until each base's "
                    "adapter is served under its own name",
                    entry.id,
                    name,
                    ", ".join(repr(base) for base in bases),
                )
        self._ambiguous = now
