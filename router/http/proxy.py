"""The upstream hop: forward a request to the chosen worker and pass its answer through.

The hop runs on the router's own HTTP/1.1 client (`router.http.upstream_client`): aiohttp's
client, which every other outgoing request uses, cost a third more CPU per forwarded request
(docs/benchmarks/proxy.md measures both forwarders side by side).

When the chosen candidate is one data-parallel rank of its worker, the engine is told which:
SGLang's `/generate` takes `routed_dp_rank` in the body (spliced in, every other byte as the
client sent it), its OpenAI routes and every vLLM route the rank header (`indexer.engines`). A
client that named a rank itself is routed to that rank and its request forwarded as it is (a
refusal is its answer). A worker refusing a rank the router chose (`refuses_rank`: it restarted
with fewer) is not blamed: its settings are read again (`Proxy.ranks_changed`, waited for no
longer than `health.timeout_s`) and, registered anew, the request is retried on its new ranks;
when they cannot tell in time (its server info unreadable, slow) or no attempt is left, the
request is sent to it again without a rank, the engine placing it (predicted no hit).

A request may be retried on the next-best worker as long as no byte has reached the client: on
a refused or dropped connection, or a 5xx status. Streams are forwarded chunk by chunk, and the
response headers are only sent once the worker produced its first chunk, so a worker that dies
before answering is retried too. Whose fault a failed attempt was (the worker's, for its circuit
breaker, or the request's) is decided once the request has ended (`charge`). A client
that disconnects cancels the handler (aiohttp's handler cancellation), which closes the
upstream connection, which makes the worker abort; the request counts as 499 in the metrics.
A worker that breaks a stream off once it began cannot be retried: its client's connection is
closed (a cut body, not a clean end) and the request counts as 502 (`answer_code`).

A model served by prefill/decode pairs is handed to the pair dispatcher (`router.http.pd`,
`PairDispatch`) once its namespace is known; it forwards the decode side's answer through
`forward` with `AnswerHooks` (headers naming both workers, a wait for the prefill side before
anything is committed to the client, and the prefill's logprobs merged into the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from indexer.service import Namespace
from router.config import RouterConfig
from router.errors import (
    HoldTimeoutError,
    NoWorkerError,
    RequestError,
    UpstreamError,
    UpstreamTimeoutError,
)
from router.http.decisions import DecisionStats
from router.http.direct_answer import ChunkedResponse, SentResponse, send_whole
from router.http.holding import HeldRequest, HeldRequests
from router.http.intake import read_request
from router.http.metrics import (
    CLIENT_CLOSED,
    CLIENT_CLOSED_ERROR,
    REQUEST_MODEL,
    WORKER_BROKE_OFF,
    RouterMetrics,
)
from router.http.observe import Observation, Observer, observation
from router.http.upstream_client import (
    Origin,
    UnsafeHeaderError,
    UpstreamClient,
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDroppedError,
    UpstreamResponse,
)
from router.prompt.dp_rank import with_body_field
from router.prompt.request import Endpoint, ParsedRequest
from router.prompt.tokenizer import PromptTokenizer
from router.routing.load import Ticket, Withdraw
from router.routing.planner import Candidate, Plan, Planner

__all__ = [
    "DP_RANK_HEADER",
    "FORECAST_HEADER",
    "MATCHED_HEADER",
    "PENDING_HEADER",
    "RAW_MATCHED_HEADER",
    "RAW_PENDING_HEADER",
    "WORKER_HEADER",
    "AnswerHooks",
    "AttemptFailed",
    "PairDispatch",
    "Proxy",
    "answer_code",
    "broken_off",
    "charge",
    "refuses_rank",
]

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvroute-worker"
MATCHED_HEADER = "x-kvroute-matched-tokens"
PENDING_HEADER = "x-kvroute-pending-tokens"
# the index's match before the admission-time discount (`router.routing.admission`)
RAW_MATCHED_HEADER = "x-kvroute-raw-matched-tokens"
RAW_PENDING_HEADER = "x-kvroute-raw-pending-tokens"
# when the forecast kept less than the raw match: why the rest is lost (`AdmissionForecast.cause`)
FORECAST_HEADER = "x-kvroute-forecast-lost"
DP_RANK_HEADER = "x-kvroute-dp-rank"  # only when the engine was told a rank
P = TypeVar("P")  # a plan: one side's (`Plan`) or a pair's (`router.routing.pd.PdPlan`)
# how often a held request is planned again when nothing here answers or ends (a peer
# replica's requests, a worker coming back): its wait is bounded by that, not by traffic
_HOLD_POLL_S = 0.05

# hop-by-hop and framing headers are the proxy's own business on each side
_DROP = frozenset(
    h.lower()
    for h in (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "date",
        "server",
    )
)


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


# set on a request whose client left while its answer was written (`answer_code`)
_CLIENT_LEFT = web.RequestKey("kvroute_client_left", bool)


def _client_left(request: web.Request) -> None:
    request[_CLIENT_LEFT] = True


# set on a request whose worker broke its streamed answer off once bytes had reached the
# client: the class name of the upstream error (`broken_off`)
_BROKEN_OFF = web.RequestKey("kvroute_broken_off", str)


def broken_off(request: web.Request) -> str | None:
    """Why the worker broke `request`'s streamed answer off after its status went out to the
    client (the upstream error's class name, the spans' `error.type`), or None."""
    return request.get(_BROKEN_OFF)


def answer_code(request: web.Request, status: int) -> int:
    """The code a forwarded answer counts as in the metrics: the worker's `status`, 499
    (CLIENT_CLOSED) when the client left before it had all of it, or 502 (WORKER_BROKE_OFF)
    when the worker broke a stream off (`broken_off`). A client leaving shows as the handler's
    cancellation or, when the router was writing to it then (or cut a client that stopped
    reading: `ClientStalledError`), as ConnectionResetError; both are 499."""
    if request.get(_CLIENT_LEFT, False):
        return CLIENT_CLOSED
    return WORKER_BROKE_OFF if _BROKEN_OFF in request else status


def _none_routable(candidates: Sequence[Candidate]) -> str:
    """Why a plan has no worker to send to, counted as an operator counts: workers, and their
    ranks where they have several (each rank is a candidate)."""
    workers = len({c.worker for c in candidates})
    if workers == len(candidates):
        return f"no routable worker among {workers}"
    return f"no routable worker among {workers} ({len(candidates)} ranks)"


def charge(
    planner: Planner,
    sent_failures: Sequence[tuple[str, bool]],
    answered: bool,
    routable_untried: bool,
) -> None:
    """Charge the circuit breakers with one request's failures after its workers got it
    (`sent_failures`: worker, hard), once the request ended: `answered` (a worker answered
    it below 500); `routable_untried` whether a routable worker it was never sent to remains
    (a pair: of the side the failures are of).

    A 5xx, a dropped connection or an answer that is not HTTP may be the request's fault
    as much as the worker's: an engine that crashes on one prompt crashes on it on every
    worker, and the retry carries it to each. Charged at once, one such request (a dropped
    connection is a hard failure) would open every circuit of the model and the fleet
    would answer 503 for `breaker.cooldown_s`. So:
    - another worker answered it: the failures were the workers', each charged (a dropped
      connection opens the circuit at once, a 5xx counts toward the threshold);
    - it failed on every routable worker it could go to: the request's; nobody is charged
      (one request never takes the last workers out of rotation);
    - else (the retries ran out with routable workers untried, `max_retries = 0`): nobody
      can tell, so its first worker is charged one ordinary failure, never a hard one. A
      worker that fails every request still reaches the threshold over consecutive ones
      (with too few retries to reach a healthy worker, nothing else would take it out); a
      burst of such requests can at worst leave `max_retries + 1` workers in rotation.
    A worker that is really gone refuses the connection: that is charged at once, the
    request never reached it (`AttemptFailed.sent`). So is a worker that did not answer
    within the request deadline (`Proxy.forward`: one ordinary failure, and no retry).
    """
    if not sent_failures:
        return
    if answered:
        for worker, hard in sent_failures:
            planner.record_failure(worker, hard=hard)
    elif routable_untried:
        planner.record_failure(sent_failures[0][0], hard=False)


# an engine refusing a dp rank it does not have: SGLang 0.5.23's tokenizer manager
# ("routed_dp_rank=2 out of range [0, 1)") and vLLM 0.33's input processor ("data_parallel_rank
# 2 is out of range [0, 1)."). Only that refusal: any 400 saying "out of range" (a sampling
# parameter) would have the worker's settings read again for every such request
_RANK_OUT_OF_RANGE = re.compile(
    rb"(?:routed_dp_rank=|data_parallel_rank )\d+ (?:is )?out of range \[0, "
)


def refuses_rank(status: int, payload: bytes) -> bool:
    """Whether a worker's answer is an engine refusing the dp rank it was told, one it does not
    have (it restarted with fewer ranks; the router's are stale until its settings are read
    again: `Proxy.ranks_changed`)."""
    return status == 400 and _RANK_OUT_OF_RANGE.search(payload) is not None


class _RankMoved(Exception):
    """The worker refused the rank the router chose: the request is tried again, the worker not
    blamed; on its new ranks when its settings, read again, registered it anew (`anew`), else
    without a rank."""

    def __init__(self, worker: str, *, anew: bool) -> None:
        super().__init__(f"worker {worker} refused the dp rank the router chose")
        self.anew = anew


def _unranked(candidate: Candidate) -> Candidate:
    """`candidate`'s worker with no rank told (the engine picks one) and no hit predicted:
    which rank the prompt lands on, and what it holds there, is the engine's to know."""
    return msgspec.structs.replace(
        candidate,
        dp_rank=None,
        matched_tokens=0,
        matched_blocks=0,
        pending_tokens=0,
        by_medium={},
        hit_tokens=0.0,
        admission=None,
        eviction=None,
    )


class AttemptFailed(Exception):
    """An attempt that failed before any byte reached the client."""

    def __init__(
        self, message: str, *, hard: bool, status: int | None = None, sent: bool = True
    ) -> None:
        super().__init__(message)
        self.hard = hard
        self.status = status  # the worker's HTTP status, when it answered one
        # whether the worker got the request: a failure after it may be the request's own
        # (`charge`); one before it (no connection) is the worker's
        self.sent = sent


class AnswerHooks:
    """What a caller adds to one forwarded answer (the pair dispatcher); by default nothing."""

    def __init__(self) -> None:
        self.request_headers: dict[str, str] = {}  # set on the upstream request
        self.headers: dict[str, str] = {}  # set on the answer (after the proxy's own)

    async def before_commit(self, status: int) -> None:
        """Awaited once the worker answered (`status`), before anything reaches the client;
        raising makes the attempt fail (AttemptFailed: retried)."""

    def passes_through(self, status: int, last_try: bool, payload: bytes) -> bool:
        """Whether the worker's 5xx `status` (its body: `payload`) is the client's answer (else
        AttemptFailed). With hooks, the caller charges the failure to whichever worker it
        blames (a pair's decode may fail for its prefill, and say so in its body): once the
        request ended (`charge`), or at once in `timed_out`."""
        return last_try

    def timed_out(self) -> None:
        """The request deadline passed before the worker answered (UpstreamTimeoutError)."""

    def body(self, payload: bytes) -> bytes:
        """A whole (non-streamed) answer, as the client gets it."""
        return payload

    def chunk(self, data: bytes) -> bytes:
        """One streamed chunk, as the client gets it."""
        return data

    def end(self) -> bytes:
        """What the stream ends with, after the last chunk."""
        return b""


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


def _copy_headers(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    # copy, then delete: multidict does the case folding in C (3x faster than filtering here)
    out = CIMultiDict(headers)
    # the headers `Connection` names are hop-by-hop too (RFC 9110, 7.6.1): this hop's only
    named = out.getall("Connection", ())
    for name in drop:
        if name in out:
            del out[name]
    for value in named:
        for name in value.split(","):
            out.popall(name.strip(), None)
    return out


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
        self.reconfigure(config)
        self.pairs: PairDispatch | None = None  # set by the app when pairs are possible
        # reads a worker's settings again, waiting at most the given seconds: whether it was
        # registered anew (`Supervisor.reread`; set by the app)
        self.reread: Callable[[str, float], Coroutine[Any, Any, bool]] | None = None
        # requests held for a worker with room (`hold_for_room`), woken as requests progress
        self._holding = HeldRequests(_HOLD_POLL_S)
        planner.on_progress = self._progressed

    def reconfigure(self, config: RouterConfig) -> None:
        """Limits, timeouts and the salt header of `config` for the requests that start from
        now on (a reload); a request in flight keeps its deadline and its retries."""
        self._config = config
        # the body is forwarded as the router read it: decoded (aiohttp undoes Content-Encoding);
        # an `Expect: 100-continue` was the router's to answer, and the body goes with the headers
        request_only = {"content-encoding", "expect"} | (
            {config.salt_header.lower()} if config.salt_header else set()
        )
        self._request_drop = _DROP | _ROUTING_OVERRIDES | request_only

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
        ns = planner.namespace(parsed)
        request[REQUEST_MODEL] = ns.model  # a served model's name: a bounded label
        if self.pairs is not None and self.pairs.applies(ns.model):
            return await self.pairs.handle(request, endpoint, parsed, ns, started)
        deadline = time.monotonic() + config.timeouts.request_s
        try:
            with obs.phase("route"):
                plan = planner.plan(parsed, ns)
                if config.policy.hold_until_room:
                    plan = await self.hold_for_room(
                        plan, lambda: planner.plan(parsed, ns), _same_plan, deadline
                    )
                obs.planned(plan, ns.model)
        except asyncio.CancelledError:  # left while held for a worker with room
            self.abandoned(request, endpoint)
            raise
        if plan.worker is None:  # the best candidate is unroutable, so all are
            if not plan.candidates and parsed.dp_rank is not None:
                raise RequestError(f"no worker has the dp rank {parsed.dp_rank} asked for")
            if not plan.candidates:
                # a model of pairs that lost one side (removed): it takes no whole requests
                roles = {e.role for e in planner.pool.serving(ns.model)}
                if len(roles) == 1 and roles != {"both"}:
                    side = "decode" if roles == {"prefill"} else "prefill"
                    raise NoWorkerError(f"no routable {side} worker among 0")
            raise NoWorkerError(_none_routable(plan.candidates))
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
                keyed=parsed.keyed,
                # placed by the engine: which rank holds the prompt is unknown, nothing is
                # marked (marks on every rank would predict hits on all but one: fail closed)
                stores_prompt=parsed.stores_its_tokens and not engine_placed,
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
            except _RankMoved as exc:
                # a rank it no longer has (restarted with fewer): retried, the worker not blamed
                obs.failed(str(exc), 400)
                if exc.anew and attempt < attempts - 1:  # on the ranks it has now
                    log.warning("worker %s has other dp ranks now: retried", candidate.worker)
                    tried.discard(candidate.worker)
                    attempt += 1
                    continue
                # its ranks could not be read in time (or no attempt is left to plan again):
                # a 400 for the router's own stale rank would be the client's answer
                log.warning(
                    "worker %s refused dp rank %s, %s: retried without a rank",
                    candidate.worker,
                    candidate.dp_rank,
                    "registered anew" if exc.anew else "its ranks not read in time",
                )
                unranked = _unranked(candidate)
                continue
            except AttemptFailed as exc:
                if exc.sent:
                    sent_failures.append((candidate.worker, exc.hard))
                else:
                    planner.record_failure(candidate.worker, hard=exc.hard)
                log.warning("worker %s failed before answering: %s", candidate.worker, exc)
                self._metrics.retries.labels(candidate.worker).inc()
                obs.failed(str(exc), exc.status)
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
                    candidate.matched_tokens,
                    time.perf_counter() - started,
                    ns.model,
                )
                # nobody is charged: the request did not run out of workers, its client left
                # (an earlier attempt's 5xx would charge a worker for a request a retry may
                # well have answered)
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
                candidate.matched_tokens,
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
        ranks were read again anew (_RankMoved: the request is tried again either way)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeoutError("request deadline passed before a worker answered")
        headers = _copy_headers(request.headers, self._request_drop)
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
                    return await self._answer(
                        request,
                        upstream,
                        candidate,
                        ticket,
                        last_try=last_try,
                        hooks=hooks,
                        deadline=loop_deadline,
                        rank_moved=rank_moved,
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
            raise AttemptFailed(str(exc), hard=True, sent=False) from exc
        except UpstreamDroppedError as exc:
            # it may have computed (and stored) the prompt before the connection dropped
            ticket.withdraw = Withdraw.PENDING
            raise AttemptFailed(f"connection dropped: {exc}", hard=True) from exc
        except TimeoutError as exc:
            ticket.withdraw = Withdraw.PENDING
            if hooks is None:
                self._planner.record_failure(candidate.worker, hard=False)
            else:
                hooks.timed_out()
            if headed:
                raise UpstreamTimeoutError(
                    f"worker {candidate.worker} sent the head of its answer but not its body "
                    "within the request timeout (timeouts.request_s)"
                ) from exc
            raise UpstreamTimeoutError(
                f"worker {candidate.worker} did not answer within the request timeout "
                "(timeouts.request_s)"
            ) from exc

    def _origin(self, url: str) -> tuple[Origin, str]:
        found = self._origins.get(url)
        if found is None:
            if len(self._origins) > 4096:  # workers come and go: never an unbounded memo
                self._origins.clear()
            found = self._origins[url] = Origin.split(url)
        return found

    async def _answer(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        candidate: Candidate,
        ticket: Ticket,
        *,
        last_try: bool,
        hooks: AnswerHooks | None = None,
        deadline: float | None = None,
        rank_moved: Callable[[], Awaitable[bool]] | None = None,
    ) -> web.StreamResponse:
        """Pass the worker's answer through; raises AttemptFailed while a retry is still legal.
        `deadline` (event-loop time) bounds the client's reading too: a client that stops
        reading holds the request, its worker connection and its load no longer than that."""
        if not 200 <= upstream.status < 300:
            # its end takes back what routing marked (`Planner.withdraw`): a worker that
            # refused the request (4xx: SGLang validates before scheduling) stored nothing
            status = upstream.status
            ticket.withdraw = Withdraw.ALL if 400 <= status < 500 else Withdraw.PENDING
        payload: bytes | None = None  # read already
        if upstream.status >= 500:
            if hooks is not None:
                # read first: whom a pair's failure is blamed on may be in its body
                payload = await upstream.read()
                last_try = hooks.passes_through(upstream.status, last_try, payload)
            if not last_try:
                raise AttemptFailed(f"HTTP {upstream.status}", hard=False, status=upstream.status)
            # passed through, but still a failure: charged once the request ended (`charge`:
            # by `_route`, or the pair dispatcher's `_answered`)
        if upstream.status == 400 and rank_moved is not None:
            payload = await upstream.read()
            if refuses_rank(upstream.status, payload):
                raise _RankMoved(candidate.worker, anew=await rank_moved())
        out = _copy_headers(upstream.headers, _DROP)
        out[WORKER_HEADER] = candidate.worker
        # what the worker is predicted to reuse at admission; the index's raw answer beside it
        matched, pending = candidate.predicted_split
        out[MATCHED_HEADER] = str(matched)
        out[PENDING_HEADER] = str(pending)
        out[RAW_MATCHED_HEADER] = str(candidate.matched_tokens)
        out[RAW_PENDING_HEADER] = str(candidate.pending_tokens)
        if candidate.admission is not None and candidate.admission.cause:
            out[FORECAST_HEADER] = candidate.admission.cause
        if candidate.dp_rank is not None:
            out[DP_RANK_HEADER] = str(candidate.dp_rank)
        if hooks is not None:
            out.update(hooks.headers)
        obs = observation(request)
        if obs is not None:
            obs.response_headers(out)
        streaming = payload is None and (
            "text/event-stream" in upstream.headers.get("Content-Type", "")
            or "chunked" in upstream.headers.get("Transfer-Encoding", "").lower()
        )
        if not streaming:
            if payload is None:
                payload = await upstream.read()
            if hooks is not None:
                self._planner.first_byte(ticket)
                await hooks.before_commit(upstream.status)
                payload = hooks.body(payload)
            if obs is not None:
                obs.first_byte()
            # the client has its answer before the router's bookkeeping (this request's own
            # below, and its end's in the caller): at low concurrency that is latency saved
            try:
                response = await send_whole(
                    request, upstream.status, out, payload, deadline=deadline
                )
            except ConnectionResetError:  # gone, or cut at the deadline: the worker answered
                response = SentResponse(upstream.status, out, False, 0)
                _client_left(request)
            if hooks is None:
                self._planner.first_byte(ticket)
            if obs is not None:
                obs.body(payload)
            if upstream.status < 500:
                self._planner.record_success(candidate.worker)
            return response
        # wait for the first chunk before committing headers: until then, a retry is legal
        first = await upstream.readany()
        self._planner.first_byte(ticket)
        if hooks is not None:
            await hooks.before_commit(upstream.status)
        if obs is not None:
            obs.first_byte()
        return await self._stream(request, upstream, out, first, candidate.worker, hooks, deadline)

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        headers: CIMultiDict[str],
        first: bytes,
        worker: str,
        hooks: AnswerHooks | None = None,
        deadline: float | None = None,
    ) -> web.StreamResponse:
        response = ChunkedResponse(status=upstream.status, headers=headers, deadline=deadline)
        chunk = first
        obs = observation(request)
        try:
            await response.prepare(request)
            while chunk:
                data = chunk if hooks is None else hooks.chunk(chunk)
                await response.write(data)
                if obs is not None:
                    obs.chunk(data)  # its usage is read once the stream ends
                try:
                    chunk = await upstream.readany()
                except (UpstreamClientError, TimeoutError) as exc:
                    # bytes already reached the client, so no retry; cut the connection so
                    # the client sees a truncated stream, not a clean end. The request deadline
                    # passing while the worker streams is no failure of it (it was answering:
                    # counted, a long generation would reopen a recovering worker's circuit)
                    if not isinstance(exc, TimeoutError):
                        self._planner.record_failure(worker, hard=True)
                        log.warning("worker %s failed mid-stream: %s", worker, type(exc).__name__)
                        # the client's status line said the worker's 200: counted as that,
                        # the failure would show in no error rate (`answer_code`)
                        request[_BROKEN_OFF] = type(exc).__name__
                    else:
                        log.info("a stream from worker %s was cut at the request deadline", worker)
                    upstream.close()
                    if request.transport is not None:
                        request.transport.close()
                    return response
            if hooks is not None and (tail := hooks.end()):
                await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:
            # the client went away, or stopped reading until the deadline and was cut
            # (`ClientStalledError`; left to `forward`, either would count against the worker
            # and retry a request whose bytes were sent); closing the upstream connection makes
            # the worker abort. The worker was streaming: it works (a recovering worker's
            # circuit closes on it, as on a whole answer)
            upstream.close()
            self._planner.record_success(worker)
            _client_left(request)
            return response
        except asyncio.CancelledError:
            # the client went away and aiohttp cancelled the handler: the same (`forward`
            # closes the upstream connection)
            self._planner.record_success(worker)
            raise
        if upstream.status < 500:  # a streamed 5xx is a failure (`_route` charges it)
            self._planner.record_success(worker)
        return response
