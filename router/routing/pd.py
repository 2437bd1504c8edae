"""Prefill/decode pairs: which prefill worker and which decode worker serve one request.

A model whose workers include prefill and decode workers (`WorkerPool.disaggregated`) is served
by pairs (DESIGN.md section 9). The prefill worker's cache is where prefix reuse happens, so
the prefill side is ranked by the configured policy (`kv`: the namespaced prefix hit from the
prefill workers' own KV events against their load) over the model's prefill workers. The
decode side computes no prompt, so it is ranked by load: running requests and the KV they
hold (`kv_tokens`, their prompts moved in), plus the prefix a decode worker already holds
where decode workers publish events (those tokens need no transfer). Under a policy that is
not cache-aware (`round_robin`, `least_load`, `random`), the decode side takes turns or
balances the same way as the prefill side, with its own memory.

The two sides are planned and committed apart (`Planner.plan` with a role; `commit_prefill` is
the planner's own commit, so the prefill decision is shared like any other). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from indexer.service import Namespace
from router.config import PdConfig, PolicyConfig
from router.prompt.output_limit import PREFILL_OUTPUT_TOKENS
from router.prompt.request import ParsedRequest
from router.routing.load import Ticket
from router.routing.namespace import KeyedShadow
from router.routing.planner import Plan, Planner
from router.routing.policy import Candidate, KvPolicy, Policy, build_policy

__all__ = ["DecodePolicy", "PairPlanner", "PdPlan", "decode_policy"]


class DecodePolicy(KvPolicy):
    """A decode worker's score: the prefix it holds against its running requests and their KV."""

    name = "pd_decode"

    def __init__(self, config: PolicyConfig, pd: PdConfig) -> None:
        super().__init__(config)
        self._kv_weight = pd.decode_kv_weight

    def reconfigure_pd(self, config: PolicyConfig, pd: PdConfig) -> None:
        """New weights from the next decision on (a reload)."""
        self.reconfigure(config)
        self._kv_weight = pd.decode_kv_weight

    def load(self, view: Candidate) -> float:
        """Running requests, the KV they hold, and the transfers queued to it."""
        return (
            view.queued_prefill_tokens
            + self._config.decode_weight * view.running
            + self._kv_weight * view.kv_tokens
        )


def decode_policy(config: PolicyConfig, pd: PdConfig) -> Policy:
    """The decode side's policy: by load and held prefix under `kv` (and `approx_tree`, whose
    tree knows nothing a decode needs); otherwise a fresh instance of the configured one."""
    if config.name in ("kv", "approx_tree"):
        return DecodePolicy(config, pd)
    return build_policy(config)


class PdPlan(msgspec.Struct, frozen=True):
    """Both sides of one request's pair, each ranked best first."""

    prefill: Plan
    decode: Plan


class PairPlanner:
    """Plans and commits prefill/decode pairs on top of the planner."""

    def __init__(self, planner: Planner, policy: PolicyConfig, pd: PdConfig) -> None:
        self.planner = planner
        self.decode_policy = decode_policy(policy, pd)

    def reconfigure(self, policy: PolicyConfig, pd: PdConfig) -> None:
        """The decode side's new weights (a reload); the prefill side is the planner's."""
        if isinstance(self.decode_policy, DecodePolicy):
            self.decode_policy.reconfigure_pd(policy, pd)
        else:
            self.decode_policy.reconfigure(policy)

    def applies(self, cache_model: str) -> bool:
        """Whether requests of `cache_model` are served by pairs."""
        return self.planner.pool.disaggregated(cache_model)

    def plan(self, parsed: ParsedRequest, ns: Namespace) -> PdPlan:
        """Both sides ranked; changes no state (the `/admin/route` dry run shows it)."""
        planner = self.planner
        return PdPlan(
            prefill=planner.plan(parsed, ns, role="prefill"),
            decode=planner.plan(parsed, ns, role="decode", policy=self.decode_policy),
        )

    def unserved_rank(self, parsed: ParsedRequest, ns: Namespace, plan: PdPlan) -> str | None:
        """The side ("prefill" or "decode") none of whose workers has the rank the client
        named, though the model has workers of that side (None: both sides offer some): the
        client's error (a 400), as on the whole-request path, not a fleet without workers."""
        if parsed.dp_rank is None:
            return None
        roles = {entry.role for entry in self.planner.pool.serving(ns.model)}
        for side, side_plan in (("prefill", plan.prefill), ("decode", plan.decode)):
            if not side_plan.candidates and side in roles:
                return side
        return None

    def commit_prefill(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        candidate: Candidate,
        *,
        first_try: bool,
        keyed: Sequence[KeyedShadow] = (),
        stores_prompt: bool = True,
    ) -> Ticket:
        """The prefill side is committed like any request: pending marks, policy, load. It
        makes the first token only (SGLang's prefill side sets `max_new_tokens` to 1)."""
        return self.planner.commit(
            ns,
            tokens,
            candidate,
            first_try=first_try,
            output_tokens=PREFILL_OUTPUT_TOKENS,
            keyed=keyed,
            stores_prompt=stores_prompt,
        )

    def commit_decode(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        candidate: Candidate,
        *,
        first_try: bool,
        output_tokens: int | None = None,
        keyed: Sequence[KeyedShadow] = (),
        stores_prompt: bool = True,
    ) -> Ticket:
        """The decode side: its policy learns the choice, the prompt it will hold is marked
        pending there (it caches what it is sent; not with `stores_prompt` False, as
        `Planner.commit`), and its load counts the transfer to come (the tokens it does not
        hold), the KV it keeps until the request ends and the output it may generate
        (`output_tokens`, None: not known)."""
        if first_try:
            self.decode_policy.record(tokens, candidate.target)
        planner = self.planner
        marked = (
            stores_prompt
            and self.decode_policy.marks_pending
            and planner.indexer.has_worker(candidate.worker)
        )
        pending: list[tuple[str, int]] = []
        if marked:
            pending = planner.indexer.add_pending(
                ns, tokens, candidate.worker, candidate.dp_rank, keys_of=planner.keys_of(ns, tokens)
            )
        held = candidate.matched_tokens + candidate.pending_tokens
        ticket = planner.load.begin(
            candidate.worker,
            max(0, len(tokens) - held),
            candidate.dp_rank,
            kv_tokens=len(tokens),
            output_tokens=output_tokens,
        )
        # the other replicas count the decode side's load and marks as this one does
        ticket.pending = pending
        planner.share(ns, tokens, candidate, ticket, marked=marked)
        # the decode side caches the prompt too
        ticket.shadows = planner.shadow(
            ns, tokens, candidate.worker, candidate.dp_rank, keyed, ticket
        )
        return ticket

    def forget(self, worker: str) -> None:
        """A worker left the pool: the decode policy forgets it too."""
        self.decode_policy.forget(worker)
