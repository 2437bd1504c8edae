"""A model served by one side of prefill/decode pairs only: said in the log, once.

A model whose workers are all prefill workers (or all decode workers) takes no request: each is
a 503 naming the side it lacks (`router.http.proxy`). Before, nothing else said it: the startup
and a reload logged each worker's role, and the operator learnt of it from the clients. After
each health round (the first right after the startup's registrations) the pool is looked at
(`PdSides.check`): a model found one-sided by two rounds running is said in one WARNING line,
said again only when what is said of it changes, and its end in one INFO line. Two rounds: a
reload that renames a model's only decode worker removes it before it adds its new id, and a
round in between would say so for nothing.
"""

from __future__ import annotations

import logging
from collections import Counter

from indexer.engines import PdRole
from router.routing.pool import WorkerPool

__all__ = ["PdSides", "one_sided"]

log = logging.getLogger(__name__)

_OTHER: dict[PdRole, PdRole] = {"prefill": "decode", "decode": "prefill"}


def one_sided(pool: WorkerPool) -> dict[str, str]:
    """Per model whose workers are all of one side of the pairs, what that does (the models of
    workers whose models are not known yet are left out)."""
    roles: dict[str, Counter[PdRole]] = {}
    for entry in pool:
        if entry.cache_model:
            roles.setdefault(entry.cache_model, Counter())[entry.role] += 1
    notes: dict[str, str] = {}
    for model, counted in roles.items():
        if len(counted) != 1:
            continue
        ((role, count),) = counted.items()
        other = _OTHER.get(role)
        if other is None:
            continue  # whole-request workers only
        notes[model] = (
            f"its {count} {role} worker(s) have no {other} worker to pair with: every request "
            f"is refused (503, no routable {other} worker) until a {other} worker serves it; "
            f"check the workers' `role` (in the config, or the `disaggregation_mode` they "
            "advertise)"
        )
    return notes


class PdSides:
    """What was said of the models served by one side of the pairs, so that it is said once."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}  # found by the last round
        self._said: dict[str, str] = {}  # said in the log, and not over

    def check(self, pool: WorkerPool) -> None:
        """Look at `pool` after a health round: say a model found one-sided by this round and
        the one before, and the end of one said."""
        now = one_sided(pool)
        for model, note in now.items():
            if self._seen.get(model) == note and self._said.get(model) != note:
                self._said[model] = note
                log.warning("model %r: %s", model, note)
        for model in [m for m in self._said if m not in now]:
            del self._said[model]
            log.info("model %r is no longer served by one side of the pairs only", model)
        self._seen = now
