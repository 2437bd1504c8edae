"""Prefill/decode pairs on the wire: one request served by a prefill worker and a decode worker.

The pair is chosen by `router.routing.pd` (the prefill side by the configured policy over the
model's prefill workers, the decode side by load), and formed the way the prefill worker's
engine forms it (`indexer.engines.PdPairing`):
- SGLang (`BOOTSTRAP_ROOM`): the request goes to both at once, each with the prefill's
  bootstrap host and port and the same fresh random room (`router.http.bootstrap_fields`). The
  client gets the decode's answer, streamed through; with `return_logprob` the prefill's input
  logprobs are merged in (`router.http.pair_hooks`).
- vLLM (`KV_TRANSFER_PARAMS`, its NIXL proxy protocol): the request goes to the prefill first,
  then with the `kv_transfer_params` of its answer to the decode
  (`router.http.kv_transfer_params`).

Both legs carry the request's `x-request-id` (the client's well-formed one untouched, else the
router's) and the same `traceparent`; vLLM's legs are paired by that id.

A rank the client named that no worker of one side has is a 400, as on the whole-request path.
A prefill that refuses a rank the router told it ("routed_dp_rank=... out of range": it
restarted with fewer ranks) has its settings read again (`Proxy.ranks_changed`) and the pair is
retried, on its new ranks, without blaming it.

Failure: until a byte reached the client, a failed pair is retried on another pair, leaving out
the worker blamed (`router.http.pair_hooks.PairHooks.blamed`). A decode's failures other than a
timeout wait `_BLAME_GRACE_S` to hear whether its prefill died mid-transfer (then the prefill
is blamed). A prefill that gave up waiting for its decode to take the KV blames the decode by
its word, or neither, and the retry avoids the pair (`router.http.pair_handoff`); what the two
workers did since may blame one (`router.http.pair_faults`). A decode that could not reach the
prefill's bootstrap server has the prefill's settings read again and the pair retried where
they changed (`router.http.bootstrap_unreachable`). A leg the router could not even connect for
want of its own descriptors is the router's 503, no retry, neither worker charged
(`router.http.local_shortage`). The request deadline bounds it all.
Failures are charged once the request ended (`router.http.pair_failure.PairCharges`). An answer
is counted by the task that wrote it (`PairDispatcher._answered`), whatever the client does
next."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from indexer.engines import PdPairing
from indexer.service import Namespace
from router.config import RouterConfig
from router.errors import NoWorkerError, RequestError, UpstreamError, UpstreamTimeoutError
from router.http.bootstrap_fields import BootstrapFields
from router.http.bootstrap_unreachable import (
    BootstrapUnreachable,
    UnreachableNotices,
    advertised_otherwise,
    bootstrap_moved,
)
from router.http.hop_headers import connection_named
from router.http.kv_transfer_params import decode_body, pair_request_id, prefill_body
from router.http.local_shortage import local_shortage
from router.http.metrics import CLIENT_CLOSED, RouterMetrics
from router.http.no_worker import none_routable
from router.http.observe import REQUEST_ID_HEADER, Observation, client_request_id, observation
from router.http.outcome import AttemptFailed, answer_code, broken_off
from router.http.pair_failure import (
    HandoffFailed,
    PairCharges,
    PrefillFailed,
    PrefillRefused,
    withdraw_at_least,
)
from router.http.pair_faults import PairFaults, Side
from router.http.pair_handoff import HandoffFault, handoff_fault
from router.http.pair_hooks import (
    PREFILL_HEADER,
    PREFILL_RANK_HEADER,
    PairHooks,
    wants_logprobs,
)
from router.http.proxy import Proxy
from router.http.rank_refusal import refuses_rank
from router.prompt.dp_rank import DP_RANK_HEADER
from router.prompt.request import Endpoint, ParsedRequest
from router.routing.load import Ticket, Withdraw
from router.routing.pd import PairPlanner, PdPlan
from router.routing.planner import Plan
from router.routing.policy import Candidate

__all__ = ["PairDispatcher"]

log = logging.getLogger(__name__)

# how long a failed decode waits to learn whether its prefill died (then the prefill is blamed)
_BLAME_GRACE_S = 1.0
_TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as a client sent it


class PairDispatcher:
    """Routes and forwards the requests of models served by prefill/decode pairs."""

    def __init__(
        self,
        config: RouterConfig,
        pairs: PairPlanner,
        proxy: Proxy,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._pairs = pairs
        self._proxy = proxy
        self._session = session
        self._metrics = metrics
        self._bootstrap = BootstrapFields(pairs.planner)
        self._unreachable = UnreachableNotices()
        self._faults = PairFaults()

    def reconfigure(self, config: RouterConfig) -> None:
        """Limits and timeouts of `config` for the requests that start from now on."""
        self._config = config

    def applies(self, cache_model: str) -> bool:
        """Whether `cache_model` is served by pairs."""
        return self._pairs.applies(cache_model)

    async def handle(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        ns: Namespace,
        started: float,
    ) -> web.StreamResponse:
        """Route one request to a pair, retrying on another pair while no byte was sent."""
        pairs, planner = self._pairs, self._pairs.planner
        deadline = time.monotonic() + self._config.timeouts.request_s
        failed: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        failed_pairs: set[tuple[str, str]] = set()  # failed, the side not told
        # prefill -> the decodes charged on its word ("no decode came") in this request
        on_its_word: dict[str, list[str]] = {}
        failures: list[str] = []
        charges = PairCharges(planner)
        last_status: int | None = None
        attempts = 1 + self._config.limits.max_retries
        obs = observation(request)  # the decision is the prefill side's: its prefix is reused
        for attempt in range(attempts):
            if attempt and time.monotonic() >= deadline:
                # no retry after the deadline: it would charge a worker never asked
                last_status = 504
                failures.append("the request deadline passed")
                break
            with obs.phase("route") if obs is not None else contextlib.nullcontext():
                plan = pairs.plan(parsed, ns)  # re-ranked each time: health and loads move
                if attempt == 0 and (plan.prefill.worker is None or plan.decode.worker is None):
                    # a side being renamed, added or checked by a change of the fleet: paired
                    # once it is (it raised NoWorkerError at once, amid a rename under traffic)
                    try:
                        if await self._proxy.change_settled(deadline):
                            plan = pairs.plan(parsed, ns)
                    except asyncio.CancelledError:  # left while waiting: the proxy's count
                        self._proxy.abandoned(request, endpoint)
                        raise
                if attempt == 0 and self._config.policy.hold_until_room:
                    # the prefill side is where the prefix is reused: held until it has room
                    try:
                        plan = await self._proxy.hold_for_room(
                            plan, lambda: pairs.plan(parsed, ns), _prefill_side, deadline
                        )
                    except asyncio.CancelledError:  # left while held: counted as the proxy's
                        self._proxy.abandoned(request, endpoint)
                        raise
                if obs is not None and attempt == 0:
                    obs.planned(plan.prefill, ns.model)  # on the `route` span
            charges.plan = plan
            prefills = [c for c in plan.prefill.ranked() if c.worker not in failed["prefill"]]
            decodes = [c for c in plan.decode.ranked() if c.worker not in failed["decode"]]
            if not prefills or not decodes:
                if attempt:
                    break
                unserved = pairs.unserved_rank(parsed, ns, plan)
                if unserved is not None:
                    raise RequestError(
                        f"no {unserved} worker has the dp rank {parsed.dp_rank} asked for"
                    )
                side = "prefill" if not prefills else "decode"
                of_side = plan.prefill if side == "prefill" else plan.decode
                raise NoWorkerError(
                    none_routable(of_side.candidates, planner.pool, planner.clock(), side)
                )
            pair = _untried(prefills, decodes, failed_pairs | self._faults.avoided())
            pair = pair or _untried(prefills, decodes, failed_pairs)
            if pair is None:
                break  # (a retry: the first attempt always has one)
            prefill, decode = pair
            charges.tried["prefill"].add(prefill.worker)
            charges.tried["decode"].add(decode.worker)
            # which side could be retried on another worker: a 5xx of the decode is the
            # client's answer when the side it is blamed on has none left (`PairHooks`).
            # Counted over every worker of each side, not only the routable ones: a drained or
            # recovering worker may take the retry by then, and a 5xx passed through too soon
            # could not be taken back
            left = {
                side: bool(
                    {c.worker for c in side_plan.candidates} - failed[side] - {chosen.worker}
                )
                for side, side_plan, chosen in (
                    ("prefill", plan.prefill, prefill),
                    ("decode", plan.decode, decode),
                )
            }
            last_try = attempt == attempts - 1
            first = attempt == 0
            p_ticket = pairs.commit_prefill(
                ns,
                parsed.tokens,
                prefill,
                first_try=first,
                keyed=planner.keyed(parsed),
                stores_prompt=parsed.stores_its_tokens,
            )
            d_ticket = pairs.commit_decode(
                ns,
                parsed.tokens,
                decode,
                first_try=first,
                output_tokens=parsed.output_tokens,
                keyed=planner.keyed(parsed),
                stores_prompt=parsed.stores_its_tokens,
            )
            if obs is not None:
                obs.attempt(plan.prefill, prefill, attempt)
            unreachable = False
            blamed: Candidate | None  # None: the pair's failure, its side not told
            on_word = False  # blamed on the other worker's word only (`HandoffFailed`)
            hooks = PairHooks(
                prefill,
                decode,
                planner,
                left,
                partial(self._prefilled, p_ticket),
                partial(self._answered, request, endpoint, parsed, ns, started, obs, charges),
                self._faults,
            )
            try:
                if planner.engine(prefill.worker).pd_pairing is PdPairing.KV_TRANSFER_PARAMS:
                    return await self._prefill_first(
                        request, endpoint, parsed, hooks, (p_ticket, d_ticket), deadline, last_try
                    )
                return await self._both_at_once(
                    request, endpoint, parsed, hooks, (p_ticket, d_ticket), deadline, last_try
                )
            except asyncio.CancelledError:
                # the client left before its answer was complete: 499, by the worker its
                # request counts at, as the proxy counts it (an answer it had is counted)
                if not hooks.counted:
                    self._metrics.record(
                        endpoint.value,
                        prefill.worker,
                        CLIENT_CLOSED,
                        len(parsed.tokens),
                        prefill.predicted_split[0],
                        time.perf_counter() - started,
                        ns.model,
                    )
                # a side that had not answered may store none of the prompt (its request
                # aborted): its pending marks go, as a single worker's do (`Proxy`)
                for ticket in (p_ticket, d_ticket):
                    if not ticket.prefilled:
                        withdraw_at_least(ticket, Withdraw.PENDING)
                raise
            except PrefillFailed as exc:
                blamed, hard, reason, status = prefill, exc.hard, str(exc), exc.status
                error: Exception = exc
                at_once = not exc.sent or exc.timed_out
                # the decode got no KV: it stored nothing of the prompt but what its events
                # show (vLLM's was never sent the request)
                withdraw_at_least(p_ticket, Withdraw.PENDING)
                withdraw_at_least(
                    d_ticket, Withdraw.ALL if hooks.task is None else Withdraw.PENDING
                )
                if isinstance(exc, BootstrapUnreachable):
                    moved = await bootstrap_moved(
                        self._proxy, planner, prefill.worker, exc.port, deadline
                    )
                    if moved is not None and not last_try:
                        # the router's port was stale (a restart): not the worker's failure
                        log.warning("prefill worker %s %s: retried", prefill.worker, moved)
                        continue
                    # its bootstrap server is gone (or configured wrong): charged at once, as
                    # a refused connection is; an unchanged port fails the same on a retry
                    unreachable = at_once = moved is None
            except HandoffFailed as exc:
                # the prefill gave up waiting for its decode to take the KV: the decode's
                # failure, or either's (`router.http.pair_handoff`), unless one side failed
                # so before with another partner (`PairFaults`); charged, if at all, once the
                # request ended, as a 5xx is
                told: Side | None = "decode" if exc.fault is HandoffFault.DECODE else None
                side_of, shown = self._faults.blame(
                    prefill.worker, decode.worker, told, lambda w: planner.pool.find(w) is not None
                )
                blamed = None if side_of is None else decode if side_of == "decode" else prefill
                hard, reason, status, at_once = False, str(exc), exc.status, False
                error = exc
                # on the prefill's word alone, the retry avoids the pair, not the decode: it
                # may be the prefill's own bootstrap (QA: the only decode left out, a healthy
                # pair untried); it goes with another prefill, and is not charged if it answers
                on_word = not shown
                if shown:
                    other = "decode" if side_of == "prefill" else "prefill"
                    reason = (
                        f"{exc.said} (it failed so with another {other} before)"
                        if side_of == "prefill"
                        else f"{reason} (it failed so with another prefill before)"
                    )
                withdraw_at_least(p_ticket, Withdraw.PENDING)
                withdraw_at_least(d_ticket, Withdraw.PENDING)
            except AttemptFailed as exc:
                blamed, hard, reason, status = decode, exc.hard, str(exc), exc.status
                error = exc
                at_once = not exc.sent
                withdraw_at_least(p_ticket, Withdraw.PENDING)  # cut off, unless it answered already
            except PrefillRefused as exc:
                withdraw_at_least(d_ticket, Withdraw.ALL)  # no KV ever came: nothing stored there
                if (
                    refuses_rank(exc.status, exc.payload)
                    and prefill.dp_rank is not None
                    and parsed.dp_rank is None
                    and await self._proxy.ranks_changed(prefill.worker, deadline)
                    # the retry takes an attempt: on the last one the worker's 400 is the
                    # client's answer (the loop would end with no failure to tell: an empty
                    # 502); the next requests go to the ranks read again
                    and not last_try
                ):
                    # a rank the router told it, which it no longer has (restarted with fewer
                    # ranks): retried on the ranks it has now, the worker not blamed
                    log.warning("prefill worker %s has other dp ranks now: retried", prefill.worker)
                    continue
                charges.settle(True)  # a worker answered it (below 500): earlier failures theirs
                # the client's answer, counted and named as a proxied one is
                self._metrics.record(
                    endpoint.value,
                    prefill.worker,
                    exc.status,
                    len(parsed.tokens),
                    prefill.predicted_split[0],
                    time.perf_counter() - started,
                    ns.model,
                )
                refusal = web.Response(
                    status=exc.status, body=exc.payload, content_type="application/json"
                )
                refusal.headers[PREFILL_HEADER] = prefill.worker
                if prefill.dp_rank is not None:
                    refusal.headers[PREFILL_RANK_HEADER] = str(prefill.dp_rank)
                if obs is not None:
                    obs.response_headers(refusal.headers)
                    obs.finish(exc.status)
                return refusal
            except Exception:  # the request ends here (its deadline passed, ...)
                withdraw_at_least(p_ticket, Withdraw.PENDING)
                withdraw_at_least(d_ticket, Withdraw.PENDING)
                charges.settle(False)
                raise
            finally:
                planner.finish(p_ticket)
                planner.finish(d_ticket)
            if obs is not None:
                obs.failed(error, status, reason)
            last_status = status
            self._metrics.retries.labels((blamed or prefill).worker).inc()
            if blamed is None:
                # either side failed: the retry avoids this pair, each worker may go with
                # another partner (leaving both out failed requests with a healthy pair
                # untried, the only decode among them); neither is charged, blaming the wrong
                # one would take a healthy worker out (its partners tell it later: `PairFaults`)
                failed_pairs.add((prefill.worker, decode.worker))
                log.warning(
                    "the pair of prefill worker %s and decode worker %s failed before answering: "
                    "%s; the retry takes another pair, neither charged",
                    prefill.worker,
                    decode.worker,
                    reason,
                )
                failures.append(f"prefill {prefill.worker} and decode {decode.worker}: {reason}")
                continue
            side = "prefill" if blamed is prefill else "decode"
            if on_word:
                failed_pairs.add((prefill.worker, decode.worker))
                on_its_word.setdefault(prefill.worker, []).append(decode.worker)
            else:
                failed[side].add(blamed.worker)
            if side == "prefill":  # its word about its decodes before is not taken now
                for worker in on_its_word.pop(prefill.worker, []):
                    charges.retract("decode", worker)
            if at_once:  # it never got the request, or did not answer within the deadline
                planner.record_failure(blamed.worker, hard=hard)
            else:  # the request's fault as much as the worker's, maybe: charged at its end
                charges.failed(side, blamed.worker, hard)
            if unreachable:
                self._unreachable.say(
                    blamed.worker, reason, advertised=advertised_otherwise(planner, blamed.worker)
                )
            else:
                log.warning("%s worker %s failed before answering: %s", side, blamed.worker, reason)
            failures.append(f"{side} {blamed.worker}: {reason}")
        charges.settle(False)
        message = "every pair tried failed: " + "; ".join(failures)
        if last_status == 504:
            # the last failure was a timeout (a worker's own 504, or the deadline): a client
            # told 502 would take a slow fleet for a broken one
            raise UpstreamTimeoutError(message)
        raise UpstreamError(message)

    def _answered(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        ns: Namespace,
        started: float,
        obs: Observation | None,
        charges: PairCharges,
        hooks: PairHooks,
        response: web.StreamResponse,
    ) -> None:
        """The bookkeeping of a pair's answer, done by the task that wrote it, right after (no
        await between): the handler wakes only later, and a client closing its connection once
        it has its answer cancels the handler before that (`handler_cancellation`)."""
        prefill = hooks.prefill
        if hooks.charged is not prefill:  # the decode got its KV
            self._pairs.planner.record_success(prefill.worker)
        blamed = hooks.charged
        if response.status >= 500 and blamed is not None:  # a failure passed through
            charges.failed("prefill" if blamed is prefill else "decode", blamed.worker, False)
        if response.status < 500:
            self._faults.answered(prefill.worker, hooks.decode.worker)
            charges.settle(True, (prefill.worker, hooks.decode.worker))
        else:
            charges.settle(False)
        hooks.counted = True
        self._metrics.record(
            endpoint.value,
            prefill.worker,  # a pair's request counts where its prefix was matched
            answer_code(request, response.status),
            len(parsed.tokens),
            prefill.predicted_split[0],
            time.perf_counter() - started,
            ns.model,
        )
        if obs is not None:
            obs.finish(response.status, broken_off(request))

    async def _decode(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: bytes,
        hooks: PairHooks,
        ticket: Ticket,
        deadline: float,
        rank_header: str | None,
        last_try: bool,
    ) -> web.StreamResponse:
        """The decode side's answer, passed through to the client and counted."""
        response = await self._proxy.forward(
            request,
            endpoint,
            body,
            hooks.decode,
            ticket,
            deadline,
            rank_header=rank_header,
            last_try=last_try,
            hooks=hooks,
        )
        hooks.answered(hooks, response)
        return response

    # ----------------------------------------------------------------- SGLang

    async def _both_at_once(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        hooks: PairHooks,
        tickets: tuple[Ticket, Ticket],
        deadline: float,
        last_try: bool,
    ) -> web.StreamResponse:
        proxy = self._proxy
        prefill, decode = hooks.prefill, hooks.decode
        p_ticket, ticket = tickets
        hooks.bootstrap_port = port = self._bootstrap.port(prefill)
        base = self._bootstrap.body(endpoint, parsed, prefill, port)
        p_body, p_rank = proxy.tell_rank(endpoint, parsed, prefill, base)
        d_body, d_rank = proxy.tell_rank(endpoint, parsed, decode, base)
        prefill_task = hooks.task = asyncio.create_task(
            self._prefill(request, endpoint, p_body, prefill, p_rank, deadline, p_ticket)
        )
        hooks.merge = b'"return_logprob"' in parsed.body and wants_logprobs(parsed.body)
        decode_task = asyncio.create_task(
            self._decode(request, endpoint, d_body, hooks, ticket, deadline, d_rank, last_try)
        )
        try:
            done, _ = await asyncio.wait(
                {prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if decode_task not in done and not hooks.committed:
                failure = prefill_task.exception()
                if failure is not None:
                    # the prefill failed (or refused) while its decode waits for KV that will
                    # never come: stop the decode and try another pair
                    decode_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await decode_task
                    if isinstance(failure, PrefillFailed) and failure.timed_out:
                        # the deadline, the decode waiting too: its own timeout would have
                        # come at the same moment, and is charged so (`PairHooks.timed_out`)
                        hooks.timed_out(prefill_waiting=True)  # (it says so in the log)
                        raise _stalled(hooks, failure)
                    if isinstance(failure, PrefillFailed) and failure.handoff is not None:
                        # it gave up waiting for its decode, which has not answered either:
                        # not the prefill's failure alone (`router.http.pair_handoff`)
                        raise _handoff_failed(failure, failure.handoff, prefill) from failure
                    raise failure
            try:
                return await decode_task
            except AttemptFailed as exc:
                # a 5xx was judged as it came (`passes_through`); a lost connection, now
                blamed = hooks.verdict or hooks.blamed(False)
                if blamed is decode and not prefill_task.done():
                    # a decode failing before its first byte is often its prefill dying
                    # mid-transfer: a moment to hear of it
                    await asyncio.wait({prefill_task}, timeout=_BLAME_GRACE_S)
                if prefill_task.done() and not prefill_task.cancelled():
                    failure = prefill_task.exception()
                    if (
                        isinstance(failure, PrefillFailed)
                        and failure.handoff is not None
                        and not hooks.unreachable
                    ):
                        # both sides failed on the handoff, each waiting for the other: which
                        # one broke it cannot be told
                        raise _handoff_failed(
                            failure, HandoffFault.EITHER, prefill, exc
                        ) from failure
                    if isinstance(failure, PrefillFailed | PrefillRefused):
                        raise failure from exc
                if hooks.unreachable:
                    raise BootstrapUnreachable(
                        f"its decode {decode.worker} could not reach its bootstrap server at port "
                        f"{hooks.bootstrap_port} ({exc})",
                        port=hooks.bootstrap_port,
                        status=exc.status,
                    ) from exc
                if blamed is prefill:
                    # retried on another prefill: this one took the request and sent no KV
                    raise PrefillFailed(
                        f"its decode {decode.worker} got no KV ({exc})",
                        hard=False,
                        status=exc.status,
                    ) from exc
                raise
            except UpstreamTimeoutError as exc:
                if hooks.charged is prefill or hooks.stalled:
                    raise _stalled(hooks, exc) from exc
                raise
        finally:
            for task in (decode_task, prefill_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(decode_task, prefill_task, return_exceptions=True)

    # ----------------------------------------------------------------- vLLM

    async def _prefill_first(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        hooks: PairHooks,
        tickets: tuple[Ticket, Ticket],
        deadline: float,
        last_try: bool,
    ) -> web.StreamResponse:
        p_ticket, ticket = tickets
        prefill, decode = hooks.prefill, hooks.decode
        proxy = self._proxy
        # vLLM pairs the two legs by their X-Request-Id
        request_id = pair_request_id(request)
        p_body, p_rank = proxy.tell_rank(endpoint, parsed, prefill, prefill_body(endpoint, parsed))
        payload = await self._prefill(
            request, endpoint, p_body, prefill, p_rank, deadline, p_ticket, request_id=request_id
        )
        d_body, d_rank = proxy.tell_rank(endpoint, parsed, decode, decode_body(parsed, payload))
        hooks.request_headers[REQUEST_ID_HEADER] = request_id
        return await self._decode(
            request, endpoint, d_body, hooks, ticket, deadline, d_rank, last_try
        )

    # ----------------------------------------------------------------- the prefill hop

    async def _prefill(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: bytes,
        prefill: Candidate,
        rank_header: str | None,
        deadline: float,
        ticket: Ticket,
        *,
        request_id: str | None = None,
    ) -> bytes:
        """The prefill side's whole answer; PrefillFailed (retry) or PrefillRefused (4xx).

        Its answer is the end of its part (`_prefilled`).
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:  # not the worker's failure: it was never asked
            raise UpstreamTimeoutError("the request deadline passed before the prefill was asked")
        timeout = aiohttp.ClientTimeout(total=remaining, connect=self._config.timeouts.connect_s)
        headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
        # the client's headers this leg copies, but none its `Connection` names: those are the
        # client's hop's only, as on the decode leg (`copy_headers`); before, this leg passed
        # on an Authorization, a rank or a trace context the client had named there
        hop_only = connection_named(request.headers.getall("Connection", ()))
        auth = request.headers.get("Authorization")
        if auth is not None and "authorization" not in hop_only:
            headers["Authorization"] = auth
        if rank_header is not None:
            headers[rank_header] = str(prefill.dp_rank)
        elif (named := request.headers.get(DP_RANK_HEADER)) is not None and (
            DP_RANK_HEADER.lower() not in hop_only
        ):
            # the client's rank, forwarded as it wrote it (the decode hop copies it too);
            # before, a prefill whose ranks the router does not know never got it
            headers[DP_RANK_HEADER] = named
        # the request's id and trace context, as its decode hop gets them: the client's id
        # untouched when well formed (else the router's); the client's trace context, replaced
        # by the attempt's span when the router traces
        for name in _TRACE_HEADERS:
            if name in request.headers and name not in hop_only:
                headers[name] = request.headers[name]
        if request_id is None:  # not observed: the client's, unless hop-by-hop
            request_id = client_request_id(request.headers)
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        obs = observation(request)
        if obs is not None:
            obs.outgoing(headers)
        try:
            async with self._session.post(
                prefill.url + endpoint.value, data=body, headers=headers, timeout=timeout
            ) as resp:
                payload = await resp.read()
                status = resp.status
        # a failure takes back what routing marked there at the pair's end (`Planner.withdraw`),
        # as the proxy's: all of it when the worker never got the request or refused it (4xx:
        # nothing scheduled), its pending marks when it may have stored the prompt first
        except TimeoutError as exc:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(
                "no answer within the request deadline", hard=False, status=504, timed_out=True
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            ticket.withdraw = Withdraw.ALL
            shortage = local_shortage(exc)
            if shortage is not None:  # the router's own failure, as on the decode leg (`Proxy`)
                raise self._proxy.shortages.refuse(prefill.worker, shortage) from exc
            raise PrefillFailed(f"connection lost: {exc}", hard=True, sent=False) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(f"connection lost: {exc}", hard=True) from exc
        except aiohttp.ClientError as exc:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(f"{type(exc).__name__}: {exc}", hard=False) from exc
        if status >= 500:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(
                f"HTTP {status}: {payload[:200]!r}",
                hard=False,
                status=status,
                handoff=handoff_fault(payload),
            )
        if status >= 400:
            ticket.withdraw = Withdraw.ALL
            raise PrefillRefused(status, payload)
        self._prefilled(ticket)
        return payload

    def _prefilled(self, ticket: Ticket) -> None:
        """The prefill side's part is over (it answered, or its decode did): `ticket` stops
        counting as queued prefill and as running there (once)."""
        self._pairs.planner.first_byte(ticket)
        self._pairs.planner.finish(ticket)


def _handoff_failed(
    failure: PrefillFailed,
    fault: HandoffFault,
    prefill: Candidate,
    decode_said: Exception | None = None,
) -> HandoffFailed:
    """The failure of a pair whose prefill gave up handing its KV to its decode (`failure`),
    as `fault` blames it, worded for the side blamed (with the decode's own failure,
    `decode_said`, when it had one)."""
    if fault is HandoffFault.DECODE:
        message = f"it never took the KV of prefill {prefill.worker}, which says: {failure}"
    else:
        message = f"their KV handoff failed; prefill {prefill.worker} says: {failure}"
        if decode_said is not None:
            message += f"; the decode: {decode_said}"
    said = f"its KV handoff failed; prefill {prefill.worker} says: {failure}"
    return HandoffFailed(message, fault=fault, status=failure.status, said=said)


def _stalled(hooks: PairHooks, cause: Exception) -> UpstreamTimeoutError:
    """The 504 of a pair whose request deadline passed with its decode not answered, worded
    for the side charged (`PairHooks.timed_out`)."""
    prefill, decode = hooks.prefill.worker, hooks.decode.worker
    if not hooks.stalled:
        message = f"prefill {prefill} sent decode {decode} no KV within the request timeout"
    elif hooks.charged is hooks.decode:
        message = (
            f"decode {decode} took no KV from prefill {prefill} within the request timeout (it "
            "failed so with another prefill before)"
        )
    elif hooks.charged is hooks.prefill:
        message = (
            f"prefill {prefill} sent decode {decode} no KV within the request timeout (it "
            "failed so with another decode before)"
        )
    else:
        message = (
            f"neither prefill {prefill} nor decode {decode} answered within the request "
            "timeout: no KV was handed over, and which of them is stuck is not known yet "
            "(neither charged)"
        )
    error = UpstreamTimeoutError(message)
    error.__cause__ = cause
    return error


def _untried(
    prefills: list[Candidate], decodes: list[Candidate], failed: set[tuple[str, str]]
) -> tuple[Candidate, Candidate] | None:
    """The best-ranked pair not among the `failed` pairs (prefill first: its prefix is the
    reuse), or None."""
    for prefill in prefills:
        for decode in decodes:
            if (prefill.worker, decode.worker) not in failed:
                return prefill, decode
    return None


def _prefill_side(plan: PdPlan) -> Plan:
    """A pair is held for its prefill side, where its prefix is reused."""
    return plan.prefill
