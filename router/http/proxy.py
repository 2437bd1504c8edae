"""The upstream hop: route a request, forward it to the chosen worker, retry while legal.

The hop runs on the router's own HTTP/1.1 client (`router.http.upstream_client`): aiohttp's
client, which every other outgoing request uses, cost a third more CPU per forwarded request
(docs/benchmarks/proxy.md measures both forwarders side by side).

When the chosen candidate is one data-parallel rank of its worker, the engine is told which:
SGLang's `/generate` takes `routed_dp_rank` in the body (spliced in, every other byte as the
client sent it), its OpenAI routes and every vLLM route the rank header (`indexer.engines`). A
client that named a rank itself is routed to that rank and its request forwarded as it is (a
refusal is its answer). A worker refusing a rank the router chose (`router.http.rank_refusal`:
it restarted with fewer) is not blamed: its settings are read again (`Proxy.ranks_changed`,
waited for no longer than `health.timeout_s`) and, registered anew, the request is retried on
its new ranks; when they cannot tell in time (its server info unreadable, slow) or no attempt
is left, the request is sent to it again without a rank, the engine placing it (predicted no
hit).

A request may be retried on the next-best worker as long as no byte has reached the client: on
a refused or dropped connection, or a 5xx status. The worker's answer is passed through by
`router.http.answer_relay` (a stream's headers only once its first chunk came, so a worker
that dies before answering is retried too). Whose fault a failed attempt was, and what a
request counts as in the metrics (499: its client left; 502: its worker broke a stream off),
is decided once it has ended (`router.http.outcome`: `charge`, `answer_code`).

A model served by prefill/decode pairs is handed to the pair dispatcher (`router.http.pd`,
`PairDispatch`) once its namespace is known; it forwards the decode side's answer through
`forward` with `AnswerHooks` (`router.http.answer_relay`; the pair's: `router.http.pair_hooks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, Protocol, TypeVar

from aiohttp import web

from indexer.service import Namespace
from router.config import RouterConfig
from router.errors import (
    HoldTimeoutError,
    NoWorkerError,
    RequestError,
    UnknownModelError,
    UpstreamError,
    UpstreamTimeoutError,
)
from router.fleet.change import FleetChange
from router.http.answer_relay import AnswerHooks, relay_answer
from router.http.decisions import DecisionStats
from router.http.holding import HeldRequest, HeldRequests
from router.http.hop_headers import HOP_BY_HOP, copy_headers
from router.http.intake import read_request
from router.http.local_shortage import ShortageLog, local_shortage
from router.http.metrics import CLIENT_CLOSED, CLIENT_CLOSED_ERROR, REQUEST_MODEL, RouterMetrics
from router.http.no_worker import no_worker
from router.http.observe import Observation, Observer, observation
from router.http.outcome import AttemptFailed, answer_code, broken_off, charge
from router.http.rank_refusal import RankMoved, RankRetryNotices, without_rank
from router.http.upstream_client import (
    Origin,
    UnsafeHeaderError,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDroppedError,
)
from router.prompt.dp_rank import with_body_field
from router.prompt.request import Endpoint, ParsedRequest
from router.prompt.tokenizer import PromptTokenizer
from router.routing.load import Ticket, Withdraw
from router.routing.planner import Candidate, Plan, Planner

__all__ = ["PairDispatch", "Proxy"]

log = logging.getLogger(__name__)

P = TypeVar("P")  # a plan: one side's (`Plan`) or a pair's (`router.routing.pd.PdPlan`)
# how often a held request is planned again when nothing here answers or ends (a peer
# replica's requests, a worker coming back): its wait is bounded by that, not by traffic
_HOLD_POLL_S = 0.05


# SGLang's header overrides of what the router decides (`entrypoints/request_headers.py`,
# 0.5.23, applied when the engine runs with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1): a
# client's would move a request to another rank or pair than the one the router booked its
# load and pending marks on; a client names a rank the documented ways instead
_ROUTING_OVERRIDES = frozenset(
    {
        "x-override-routed-dp-rank",
        "x-override-disagg-prefill-dp-rank",
        "x-override-bootstrap-host",
        "x-override-bootstrap-port",
        "x-override-bootstrap-room",
    }
)


class PairDispatch(Protocol):
    """Serves the models whose workers form prefill/decode pairs (`router.http.pd`)."""

    def applies(self, cache_model: str) -> bool:
        """Whether requests of `cache_model` go to pairs."""
        ...

    async def handle(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        ns: Namespace,
        started: float,
    ) -> web.StreamResponse:
        """Route and forward one request to a pair."""
        ...


def _same_plan(plan: Plan) -> Plan:
    return plan


class Proxy:
    """Routes and forwards the generation endpoints."""

    def __init__(
        self,
        config: RouterConfig,
        planner: Planner,
        client: UpstreamClient,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        observer: Observer | None = None,
    ) -> None:
        # decision metrics, the recent decisions, traces (`router.http.observe`)
        self.observer = observer or Observer(DecisionStats(), lambda worker: None)
        self._planner = planner
        self._client = client
        self._origins: dict[str, tuple[Origin, str]] = {}  # worker URL -> (origin, base path)
        self._tokenizer = tokenizer
        self._metrics = metrics
        # requests held for a worker with room (`hold_for_room`), woken as requests progress
        self._holding = HeldRequests(_HOLD_POLL_S)
        # a connection to a worker the router cannot open for want of its own descriptors
        # (or socket memory): its 503, said once per interval (`router.http.local_shortage`)
        self.shortages = ShortageLog(config.limits.refusal_log_interval_s)
        self.reconfigure(config)
        self.pairs: PairDispatch | None = None  # set by the app when pairs are possible
        # reads a worker's settings again, waiting at most the given seconds: whether it was
        # registered anew (`Supervisor.reread`; set by the app)
        self.reread: Callable[[str, float], Coroutine[Any, Any, bool]] | None = None
        # a reload's change of the workers under way (`Reloader.fleet_change`; set by the app)
        self.fleet_change: FleetChange | None = None
        self._rank_retries = RankRetryNotices()  # rank-less retries, said once a minute
        planner.on_progress = self._progressed

    def reconfigure(self, config: RouterConfig) -> None:
        """Limits, timeouts and the salt header of `config` for the requests that start from
        now on (a reload); a request in flight keeps its deadline and its retries. With
        `policy.hold_until_room` off, the requests held already are let go."""
        self._config = config
        if config.limits.refusal_log_interval_s != self.shortages.interval_s:
            self.shortages = ShortageLog(config.limits.refusal_log_interval_s)
        # the body is forwarded as the router read it: decoded (`router.http.request_body`);
        # an `Expect: 100-continue` was the router's to answer, and the body goes with the headers
        request_only = {"content-encoding", "expect"} | (
            {config.salt_header.lower()} if config.salt_header else set()
        )
        self._request_drop = HOP_BY_HOP | _ROUTING_OVERRIDES | request_only
        if not config.policy.hold_until_room:
            # turned off: the requests held already go now, each as planned when it wakes
            self._holding.release_all()

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Route one generation request and stream the chosen worker's answer back."""
        obs = self.observer.begin(request, endpoint)
        try:
            response = await self._route(request, endpoint, obs)
        except BaseException as exc:
            obs.close(exc)
            raise
        obs.close(None)
        return response

    async def _route(
        self, request: web.Request, endpoint: Endpoint, obs: Observation
    ) -> web.StreamResponse:
        started = obs.started
        config = self._config  # one config per request, whatever a reload does meanwhile
        try:
            with obs.phase("parse"):
                parsed = await read_request(request, endpoint, config, self._tokenizer)
        except asyncio.CancelledError:
            self.abandoned(request, endpoint)
            raise
        planner = self._planner
        deadline = time.monotonic() + config.timeouts.request_s
        try:
            ns = planner.namespace(parsed, config.limits)
        except (UnknownModelError, NoWorkerError):
            # its model served by nobody for an instant of a change (a worker renamed): served
            # once the change ends, not refused with a 404 a client does not retry
            try:
                if not await self.change_settled(deadline):
                    raise
            except asyncio.CancelledError:
                self.abandoned(request, endpoint)
                raise
            ns = planner.namespace(parsed, config.limits)
        request[REQUEST_MODEL] = ns.model  # a served model's name: a bounded label
        if self._paired(ns):
            return await self._to_pair(request, endpoint, parsed, ns, started)
        paired = False
        try:
            with obs.phase("route"):
                plan = planner.plan(parsed, ns)
                if plan.worker is None and await self.change_settled(deadline):
                    # its workers being added or checked by a change: planned once they are,
                    # in the namespace and on the path the fleet has now (a pair's side
                    # renamed left its model no pair meanwhile, planned as whole requests: it
                    # is one again)
                    ns = planner.namespace(parsed, config.limits)
                    paired = self._paired(ns)
                    if not paired:
                        plan = planner.plan(parsed, ns)
                if not paired:
                    if config.policy.hold_until_room:
                        plan = await self.hold_for_room(
                            plan, lambda: planner.plan(parsed, ns), _same_plan, deadline
                        )
                    obs.planned(plan, ns.model)
        except asyncio.CancelledError:  # left while held for a worker with room
            self.abandoned(request, endpoint)
            raise
        if paired:
            return await self._to_pair(request, endpoint, parsed, ns, started)
        if plan.worker is None:  # the best candidate is unroutable, so all are
            raise NoWorkerError(no_worker(plan, parsed, ns.model, planner.pool, planner.clock()))
        if plan.unindexed is not None:
            self._metrics.unindexed.labels(plan.unindexed).inc()
        failures: list[str] = []
        tried: set[str] = set()
        # failures after the worker got the request, charged once its end says whose they were
        sent_failures: list[tuple[str, bool]] = []
        attempts = 1 + config.limits.max_retries
        attempt = sends = 0
        # the worker that refused the rank the router chose, its new ranks unknown: sent the
        # request again without one (an attempt of its own: the engine ran nothing of it)
        unranked: Candidate | None = None
        while attempt < attempts:
            engine_placed = unranked is not None
            if unranked is not None:
                candidate, unranked = unranked, None
            else:
                if attempt:
                    # re-rank: health, drains and loads may have changed since the last attempt
                    plan = planner.plan(parsed, ns)
                untried = [c for c in plan.ranked() if c.worker not in tried]
                if not untried:
                    break
                candidate = untried[0]
                tried.add(candidate.worker)
                # the last worker left (its other ranks are no retry: a failure is the worker's)
                last_try = attempt == attempts - 1 or all(
                    c.worker == candidate.worker for c in untried
                )
            ticket = planner.commit(
                ns,
                parsed.tokens,
                candidate,
                first_try=sends == 0,
                output_tokens=parsed.output_tokens,
                keyed=planner.keyed(parsed),
                # placed by the engine: which rank holds the prompt is unknown, nothing is
                # marked (marks on every rank would predict hits on all but one: fail closed)
                stores_prompt=parsed.stores_its_tokens and not engine_placed,
                # a whole answer's first byte comes after its decode (`WorkerLoad.blind`)
                whole_answer=not parsed.stream,
            )
            obs.attempt(plan, candidate, sends)
            sends += 1
            body, rank_header = self.tell_rank(endpoint, parsed, candidate)
            rank_moved = None
            if candidate.dp_rank is not None and parsed.dp_rank is None:  # the router's rank
                rank_moved = partial(self.ranks_changed, candidate.worker, deadline)
            try:
                response = await self.forward(
                    request,
                    endpoint,
                    body,
                    candidate,
                    ticket,
                    deadline,
                    rank_header=rank_header,
                    last_try=last_try,
                    rank_moved=rank_moved,
                )
            except RankMoved as exc:
                # a rank it no longer has (restarted with fewer): retried, the worker not blamed
                obs.failed(exc, 400)
                if exc.anew and attempt < attempts - 1:  # on the ranks it has now
                    log.warning("worker %s has other dp ranks now: retried", candidate.worker)
                    tried.discard(candidate.worker)
                    attempt += 1
                    continue
                # its ranks could not be read in time (or no attempt is left to plan again):
                # a 400 for the router's own stale rank would be the client's answer
                self._rank_retries.say(
                    candidate.worker,
                    candidate.dp_rank,
                    "registered anew" if exc.anew else "its ranks not read in time",
                )
                unranked = without_rank(candidate)
                continue
            except AttemptFailed as exc:
                if exc.sent:
                    sent_failures.append((candidate.worker, exc.hard))
                else:
                    planner.record_failure(candidate.worker, hard=exc.hard)
                log.warning("worker %s failed before answering: %s", candidate.worker, exc)
                self._metrics.retries.labels(candidate.worker).inc()
                obs.failed(exc, exc.status)
                failures.append(f"{candidate.worker}: {exc}")
                attempt += 1
                continue
            except asyncio.CancelledError:
                # the client left before its answer was complete: counted where every proxied
                # request is, by the worker serving it, as 499 (nginx's name)
                self._metrics.record(
                    endpoint.value,
                    candidate.worker,
                    CLIENT_CLOSED,
                    len(parsed.tokens),
                    candidate.predicted_split[0],
                    time.perf_counter() - started,
                    ns.model,
                )
                # nobody is charged: the request did not run out of workers, its client left
                # (an earlier attempt's 5xx would charge a worker for a request a retry may
                # well have answered)
                if not ticket.prefilled:
                    # before the worker's first byte: it drops a request whose client left
                    # (SGLang aborts it), queued or prefilling, and may store none of its
                    # prompt; what it did store its events show. Before, its pending marks
                    # stood through their grace, and a sibling sent right after was predicted
                    # the prompt (QA: 128 tokens predicted, 0 cached)
                    ticket.withdraw = max(ticket.withdraw, Withdraw.PENDING)
                raise
            except Exception:  # the request ends here (its deadline passed, ...)
                self._charge(sent_failures, False, plan, tried)
                raise
            finally:
                planner.finish(ticket)
            if response.status >= 500:  # passed through on the last try: a failure too
                sent_failures.append((candidate.worker, False))
            self._charge(sent_failures, response.status < 500, plan, tried)
            self._metrics.record(
                endpoint.value,
                candidate.worker,
                answer_code(request, response.status),
                len(parsed.tokens),
                candidate.predicted_split[0],
                time.perf_counter() - started,
                ns.model,
            )
            obs.finish(response.status, broken_off(request))
            return response
        self._charge(sent_failures, False, plan, tried)
        raise UpstreamError("every worker tried failed: " + "; ".join(failures))

    async def ranks_changed(self, worker: str, deadline: float) -> bool:
        """Whether `worker`'s settings, read again now, registered it anew (other dp ranks),
        waiting no longer than `health.timeout_s` (nor the request `deadline`): what a live
        worker is given to answer a probe. A live server answers its info in milliseconds; one
        that did not by then is hung or broken, and its re-read (asked again `timeout_s`
        apart, each read given 5 times that) goes on without the request waiting for it."""
        if self.reread is None:
            return False
        wait_s = min(deadline - time.monotonic(), self._config.health.timeout_s)
        if wait_s <= 0:
            return False
        # the re-read, the registration and the subscribers it starts outlive this request:
        # started from a context of their own, not the request's (its id on their log lines,
        # its observation kept alive by them)
        reread = asyncio.create_task(self.reread(worker, wait_s), context=contextvars.Context())
        return await reread

    async def change_settled(self, deadline: float) -> bool:
        """Whether a change of the workers was under way (a reload's, or another replica's
        records: `router.fleet.change`) and has ended, so a request that found no worker for
        its model meanwhile is planned again; waits no longer than `deadline` (False then:
        refused as it was)."""
        change = self.fleet_change
        return change is not None and await change.waited(deadline)

    def _paired(self, ns: Namespace) -> bool:
        return self.pairs is not None and self.pairs.applies(ns.model)

    async def _to_pair(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        ns: Namespace,
        started: float,
    ) -> web.StreamResponse:
        assert self.pairs is not None  # `_paired`
        return await self.pairs.handle(request, endpoint, parsed, ns, started)

    def abandoned(self, request: web.Request, endpoint: Endpoint) -> None:
        """Count a request its client left before any worker was sent it (read, or held)."""
        model = request.get(REQUEST_MODEL, "")
        self._metrics.rejected.labels(endpoint.value, CLIENT_CLOSED_ERROR, model).inc()

    def _charge(
        self, sent_failures: list[tuple[str, bool]], answered: bool, plan: Plan, tried: set[str]
    ) -> None:
        """`charge`, for a request whose last plan was `plan` and that was sent to `tried`."""
        routable_untried = any(c.worker not in tried for c in plan.ranked())
        charge(self._planner, sent_failures, answered, routable_untried)

    async def hold_for_room(
        self, plan: P, replan: Callable[[], P], side: Callable[[P], Plan], deadline: float
    ) -> P:
        """The plan to send a request by, once the best (worker, rank) for it has KV room to
        admit it and no request held before it waits for that rank (`policy.hold_until_room`;
        `side` gives the plan whose first choice decides: the plan itself, or a pair's prefill
        side; `replan` plans the request again). Until then the request waits here in its
        rank's queue (`router.http.holding`), planned again when it may go. With
        `limits.max_held_requests` waiting already, the oldest of them goes as planned (the
        worker queues it) and this one waits in its place; with none allowed it goes at once.
        At the request's deadline: HoldTimeoutError, nothing committed (no worker was sent it).
        """
        holding = self._holding
        first = self._must_wait(side(plan), None)
        if first is None:
            return plan
        if holding.count >= self._config.limits.max_held_requests and not holding.release_oldest():
            return plan
        held = holding.enter((first.worker, first.dp_rank))
        self._metrics.held.inc()
        # while held, its uncached prompt counts as queued on the rank it waits for (the
        # score of every other request sees it there); not while it is planned again itself
        load = self._planner.load
        waiting: tuple[str, int | None, int] | None = None
        try:
            while True:
                waiting = (
                    first.worker,
                    first.dp_rank,
                    first.uncached_tokens(side(plan).prompt_tokens),
                )
                load.hold(*waiting)
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(holding.wait_s(held, remaining)):
                            await held.woken.wait()
                    held.woken.clear()
                load.release(*waiting)
                waiting = None
                if time.monotonic() >= deadline:
                    # nothing was sent and nothing is committed: no pending marks, load or
                    # decision for a worker that never saw the request
                    raise HoldTimeoutError(
                        "request deadline passed while it was held for a worker with room "
                        "(policy.hold_until_room); it was never sent to a worker"
                    )
                plan = replan()
                if held.released:  # over the cap, the oldest goes as planned
                    return plan
                found = self._must_wait(side(plan), held)
                if found is None:
                    return plan
                first = found
                holding.move(held, (first.worker, first.dp_rank))
        finally:
            if waiting is not None:
                load.release(*waiting)
            holding.leave(held)

    def _must_wait(self, plan: Plan, held: HeldRequest | None) -> Candidate | None:
        """The plan's first choice when the request waits for it (`policy.hold_until_room`,
        the planner asked it: `Candidate.room`): when it cannot admit the request now, or a
        request held before this one (`held`; None: one not held yet) waits for it. Else None.
        First come, first served, as an engine's queue admits: else a newer request that fits
        takes the room an older one waits for, as often as it comes free."""
        first = plan.candidates[0] if plan.candidates else None
        if first is None or not first.healthy or first.room is None:
            return None
        if first.room is False or self._holding.ahead((first.worker, first.dp_rank), held):
            return first
        return None

    def held(self) -> int:
        """Requests waiting for a worker with room (`policy.hold_until_room`)."""
        return self._holding.count

    def _progressed(self, ticket: Ticket) -> None:
        holding = self._holding
        if holding.count:  # every request's answer and end pass here: nothing held, nothing to do
            holding.progressed((ticket.worker, ticket.dp_rank))

    def tell_rank(
        self,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        candidate: Candidate,
        body: bytes | None = None,
    ) -> tuple[bytes, str | None]:
        """The body to forward (`body`, default the client's) and the rank header to set (if
        any), so that the engine serves the request on the candidate's rank."""
        body = parsed.body if body is None else body
        rank = candidate.dp_rank
        if rank is None:
            return body, None
        spec = self._planner.engine(candidate.worker)
        field = spec.dp_rank_generate_field
        if endpoint is Endpoint.GENERATE and field is not None:
            if parsed.dp_rank is not None:  # the client's body names it already
                return body, None
            return with_body_field(body, field, rank), None
        return body, spec.dp_rank_header

    async def forward(
        self,
        request: web.Request,
        endpoint: Endpoint,
        body: bytes,
        candidate: Candidate,
        ticket: Ticket,
        deadline: float,
        *,
        rank_header: str | None,
        last_try: bool,
        hooks: AnswerHooks | None = None,
        rank_moved: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        """Forward `body` to `candidate` and pass its answer through (with `hooks`: the pair
        dispatcher's decode hop); AttemptFailed while a retry is still legal. `rank_moved`:
        the router chose the candidate's rank; asked when the worker refuses it whether its
        ranks were read again anew (`RankMoved`: the request is tried again either way)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log.warning(
                "the request deadline (timeouts.request_s) passed before worker %s was sent it: "
                "504",
                candidate.worker,
            )
            raise UpstreamTimeoutError("request deadline passed before a worker answered")
        headers = copy_headers(request.headers, self._request_drop)
        headers["Content-Type"] = "application/json"
        if rank_header is not None:
            # replaces a client's own (any case): for a client-named rank it says the same
            headers[rank_header] = str(candidate.dp_rank)
        if hooks is not None:
            headers.update(hooks.request_headers)
        obs = observation(request)
        if obs is not None:
            obs.outgoing(headers)  # x-request-id, traceparent
        origin, base = self._origin(candidate.url)
        loop_deadline = asyncio.get_running_loop().time() + remaining
        headed = False  # the worker's head arrived: a timeout is then its body's
        try:
            async with self._client.post(
                origin,
                base + endpoint.value,
                headers.items(),
                body,
                deadline=loop_deadline,
                connect_timeout_s=self._config.timeouts.connect_s,
            ) as upstream:
                headed = True
                try:
                    return await relay_answer(
                        self._planner,
                        request,
                        upstream,
                        candidate,
                        ticket,
                        last_try=last_try,
                        hooks=hooks,
                        deadline=loop_deadline,
                        rank_moved=rank_moved,
                        stall_s=self._config.timeouts.connect_s,
                    )
                except asyncio.CancelledError:
                    # the client disconnected: drop the upstream connection, do not reuse it
                    upstream.close()
                    raise
        except AttemptFailed:
            raise
        except UnsafeHeaderError as exc:
            ticket.withdraw = Withdraw.ALL  # never sent
            raise RequestError(str(exc)) from exc
        except UpstreamConnectTimeout as exc:
            # could not even connect in connect_s: the next worker may well answer
            ticket.withdraw = Withdraw.ALL
            raise AttemptFailed(f"connect timeout: {exc}", hard=True, sent=False) from exc
        except UpstreamConnectError as exc:
            ticket.withdraw = Withdraw.ALL
            shortage = local_shortage(exc)
            if shortage is not None:
                # the router could not make a socket: its own failure, no retry (any worker
                # would fail alike), the worker not charged; before, a refused connection's
                # 502 opened the healthy worker's circuit
                raise self.shortages.refuse(candidate.worker, shortage) from exc
            raise AttemptFailed(str(exc), hard=True, sent=False) from exc
        except UpstreamDroppedError as exc:
            # it may have computed (and stored) the prompt before the connection dropped
            ticket.withdraw = Withdraw.PENDING
            raise AttemptFailed(f"connection dropped: {exc}", hard=True) from exc
        except TimeoutError as exc:
            ticket.withdraw = Withdraw.PENDING
            charged: str | None = candidate.worker
            if hooks is None:
                self._planner.record_failure(candidate.worker, hard=False)
            else:  # a pair's decode: charged to the side to blame (`PairHooks.timed_out`)
                charged = hooks.timed_out()
            what = "sent the head of its answer but not its body" if headed else "did not answer"
            # a 504 is an upstream failure as much as a dropped connection: logged as those are
            log.warning(
                "worker %s %s within the request timeout (timeouts.request_s): 504, %s",
                candidate.worker,
                what,
                "nobody charged" if charged is None else f"charged to worker {charged}",
            )
            raise UpstreamTimeoutError(
                f"worker {candidate.worker} {what} within the request timeout (timeouts.request_s)"
            ) from exc

    def _origin(self, url: str) -> tuple[Origin, str]:
        found = self._origins.get(url)
        if found is None:
            if len(self._origins) > 4096:  # workers come and go: never an unbounded memo
                self._origins.clear()
            found = self._origins[url] = Origin.split(url)
        return found
