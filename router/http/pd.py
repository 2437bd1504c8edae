"""Prefill/decode pairs on the wire: one request served by a prefill worker and a decode worker.

The pair is chosen by `router.routing.pd` (the prefill side by the configured policy over the
model's prefill workers, the decode side by load), and formed the way the prefill worker's
engine forms it (`indexer.engines.PdPairing`):
- SGLang (`BOOTSTRAP_ROOM`): the request goes to both at once, each with `bootstrap_host` (the
  prefill's host), `bootstrap_port` (its bootstrap port) and the same fresh random
  `bootstrap_room`, spliced into the body as the client sent it (a room per item of a batched
  `/generate`); both are also told `disagg_prefill_dp_rank` when the prefill side runs on a
  named rank (the router's, or the client's where the router does not know the prefill's
  ranks): SGLang 0.5.23's prefill then skips its room check, and its decode looks for the KV
  on that rank. A prefill worker with several DP ranks runs a request on rank
  `room % dp_size` (SGLang 0.5.23's `follow_bootstrap_room`), and fails its KV handoff when
  told another rank, so the room is drawn among those that name the rank the router chose.
  The client gets the decode's answer, streamed through; with `return_logprob` the prefill's
  `meta_info.input_token_logprobs` are put before the decode's, as SGLang's router merges them.
- vLLM (`KV_TRANSFER_PARAMS`, its NIXL proxy protocol): the request goes to the prefill first
  with `max_tokens` (and `max_completion_tokens`) 1, `stream` false, no `stream_options` and
  `kv_transfer_params` asking for a remote decode; the `kv_transfer_params` of its answer go
  with the original request to the decode, both under one `X-Request-Id`.

Both legs carry the request's `x-request-id` (the client's well-formed one untouched, else the
router's) and the same `traceparent`; vLLM's legs are paired by that id.

A rank the client named that no worker of one side has is a 400, as on the whole-request path.
A prefill that refuses a rank the router told it ("routed_dp_rank=... out of range": it
restarted with fewer ranks) has its settings read again (`Proxy.ranks_changed`) and the pair is
retried, on its new ranks, without blaming it.

Failure: until a byte reached the client, a failed pair is retried on another pair, leaving out
the worker blamed (`_PairHooks.blamed`). A decode that times out (answers 504, SGLang's
`kv_transfer_timeout`, or outlives the request deadline) while its prefill has not answered is
the prefill's failure: SGLang's prefill answers once its KV is handed over, so the KV never
came. A prefill that failed is blamed for its decode's failure (a prefill dying mid-transfer:
its connection drops, or its decode's transfer is cut, whichever the router hears first; a
decode's other failures wait `_BLAME_GRACE_S` to hear of it). So is a decode that says it could
not reach the prefill's bootstrap server (`_BOOTSTRAP_UNREACHABLE`): the prefill's settings are
read again and the pair retried where its port or role changed (a restart the router missed),
else it is charged at once. Any other failure of the decode is its own. The engine's 5xx is the
client's answer when the side it is blamed on has no other worker to retry on; the request
deadline bounds it all. Failures are charged to the workers
blamed as a whole request's are (`router.http.outcome.charge`), side by side, once the request
ended (`_Charges`): a prompt every prefill fails opens no circuit. An answer is counted by the
task that wrote it (`PairDispatcher._answered`), whatever the client does next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from indexer.engines import VLLM_PREFILL_KV_TRANSFER_PARAMS, PdPairing
from indexer.service import Namespace
from router.config import RouterConfig
from router.errors import NoWorkerError, RequestError, UpstreamError, UpstreamTimeoutError
from router.http.answer_relay import (
    FORECAST_HEADER,
    MATCHED_HEADER,
    PENDING_HEADER,
    RAW_MATCHED_HEADER,
    RAW_PENDING_HEADER,
    AnswerHooks,
)
from router.http.metrics import CLIENT_CLOSED, RouterMetrics
from router.http.observe import REQUEST_ID_HEADER, Observation, observation
from router.http.outcome import AttemptFailed, answer_code, broken_off, charge
from router.http.proxy import Proxy
from router.http.rank_refusal import refuses_rank
from router.prompt.dp_rank import DP_RANK_HEADER, with_body_members
from router.prompt.request import Endpoint, ParsedRequest
from router.routing.load import Ticket, Withdraw
from router.routing.pd import PairPlanner, PdPlan
from router.routing.planner import Plan, Planner
from router.routing.policy import Candidate

__all__ = ["DECODE_HEADER", "PREFILL_HEADER", "PairDispatcher", "PrefillFailed"]

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-kvroute-prefill-worker"
PREFILL_RANK_HEADER = "x-kvroute-prefill-dp-rank"
DECODE_HEADER = "x-kvroute-decode-worker"
_ROOMS = 2**63  # SGLang's router draws bootstrap rooms in [0, 2**63)
# how long a failed decode waits to learn whether its prefill died (then the prefill is blamed)
_BLAME_GRACE_S = 1.0
_json = msgspec.json.Encoder()
_TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as a client sent it
# a decode that could not reach its prefill's bootstrap server, as SGLang's decode says it
# ("Could not fetch prefill parallel info from bootstrap_addr: host:port") and the reference
# worker's (502 `kv_transfer_failed`, "cannot reach the prefill's bootstrap server host:port"):
# the prefill's side of the pair failed (gone, or the router names a stale bootstrap port), not
# the decode, which would else be blamed and the 5xx passed through for good, logged nowhere
_BOOTSTRAP_UNREACHABLE = re.compile(
    rb"Could not fetch prefill parallel info|cannot reach the prefill's bootstrap server"
)
# a prefill whose bootstrap server its decodes cannot reach is said at most this often
_SAY_UNREACHABLE_S = 60.0


class PrefillFailed(Exception):
    """The prefill side of a pair failed before the client got a byte (the pair is retried)."""

    def __init__(
        self,
        message: str,
        *,
        hard: bool,
        status: int | None = None,
        sent: bool = True,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.hard = hard
        self.status = status  # the worker's HTTP status, or 504 for the deadline passing
        self.sent = sent  # whether the worker got the request (`AttemptFailed.sent`)
        # no answer within the request deadline: charged at once, as the proxy charges it
        self.timed_out = timed_out


class _BootstrapUnreachable(PrefillFailed):
    """The decode could not reach the prefill's bootstrap server at `port` (the one the pair
    was told): the prefill's failure, charged at once unless its settings, read again, give
    another port or role (then retried there, not blamed)."""

    def __init__(self, message: str, *, port: int | None, status: int | None) -> None:
        super().__init__(message, hard=False, status=status)
        self.port = port


class _Charges:
    """A pair request's failures after their worker got the request, per side, charged once
    the request ended (`charge`, as a whole request's): an engine that fails one prompt fails
    it on every prefill (or decode) the retry carries it to, and charged at once that one
    prompt opened every circuit of the side."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner
        self.sent: dict[str, list[tuple[str, bool]]] = {"prefill": [], "decode": []}
        self.tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        self.plan: PdPlan | None = None  # the request's last plan
        self._settled = False

    def failed(self, side: str, worker: str, hard: bool) -> None:
        self.sent[side].append((worker, hard))

    def settle(self, answered: bool) -> None:
        """The request ended: `answered` (a worker answered it below 500)."""
        if self._settled or self.plan is None:
            return
        self._settled = True
        for side, plan in (("prefill", self.plan.prefill), ("decode", self.plan.decode)):
            tried = self.tried[side]
            untried = any(c.worker not in tried for c in plan.ranked())
            charge(self._planner, self.sent[side], answered, untried)


class _PrefillRefused(Exception):
    """The prefill side refused the request (a 4xx): the client's answer, no retry."""

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.payload = payload


def _input_logprobs(answer: Any) -> list[Any] | None:
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    found = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return found if isinstance(found, list) else None


def _first_answer(payload: bytes) -> Any:
    """A prefill's answer: its JSON, or the first `data:` event of a stream."""
    text = payload.strip()
    if text.startswith(b"data:"):
        text = text[5:].split(b"\n", 1)[0].strip()
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None


class _PairHooks(AnswerHooks):
    """One attempt of a pair, as its decode side's answer sees it: both workers named; the
    prefill's fate checked before anything is committed; with `return_logprob`, the prefill's
    input logprobs merged in; a failure charged to the side to blame; the answer counted."""

    def __init__(
        self,
        prefill: Candidate,
        decode: Candidate,
        planner: Planner,
        left: dict[str, bool],
        prefilled: Callable[[], None],
        answered: Callable[[_PairHooks, web.StreamResponse], None],
    ) -> None:
        super().__init__()
        self.prefill, self.decode = prefill, decode
        self._planner = planner
        self._left = left  # per side: another worker of it is left to retry on
        self._prefilled = prefilled  # the decode answers: the prefill side's part is over
        self.answered = answered  # the bookkeeping of an answer the client got
        self.headers = {
            PREFILL_HEADER: prefill.worker,
            # the prediction that matters is the prefill side's: that is where reuse happens
            MATCHED_HEADER: str(prefill.predicted_split[0]),
            PENDING_HEADER: str(prefill.predicted_split[1]),
            RAW_MATCHED_HEADER: str(prefill.matched_tokens),
            RAW_PENDING_HEADER: str(prefill.pending_tokens),
        }
        if prefill.admission is not None and prefill.admission.cause:
            self.headers[FORECAST_HEADER] = prefill.admission.cause
        if prefill.dp_rank is not None:
            self.headers[PREFILL_RANK_HEADER] = str(prefill.dp_rank)
        self.task: asyncio.Task[bytes] | None = None  # SGLang: the prefill side, under way
        self.merge = False
        self.bootstrap_port: int | None = None  # SGLang: the one the pair was told
        # the decode said it could not reach that bootstrap server (`passes_through`)
        self.unreachable = False
        self.verdict: Candidate | None = None  # whom the decode's 5xx was blamed on
        # the worker blamed for a failure passed through (charged as the request ends), or for
        # a timeout (charged at once)
        self.charged: Candidate | None = None
        self._prefix: list[Any] = []  # per batch item: the prefill's input logprobs
        self._buffer = b""
        self.committed = False
        self.counted = False  # its answer is in the metrics (`PairDispatcher._answered`)

    def blamed(self, kv_wait: bool) -> Candidate:
        """The side a failure of the decode is charged to, as things stand now. `kv_wait`: the
        decode timed out (answered 504, or the request deadline passed) waiting for something,
        which in a pair is its KV. A prefill that failed too is blamed; so is one that has not
        answered when its decode timed out: SGLang's prefill answers only once its KV was handed
        over, so the KV did not come (SGLang's decode answers 504 `kv_transfer_timeout`). Any
        other failure of the decode is its own: a broken decode, answering 500s at once, would
        otherwise take every healthy prefill out in turn."""
        task = self.task
        if task is None:  # vLLM: the prefill answered before the decode was asked
            return self.decode
        if task.done():
            failure = None if task.cancelled() else task.exception()
            return (
                self.prefill
                if isinstance(failure, PrefillFailed | _PrefillRefused)
                else self.decode
            )
        return self.prefill if kv_wait else self.decode

    def passes_through(self, status: int, last_try: bool, payload: bytes) -> bool:
        if self.task is not None and _BOOTSTRAP_UNREACHABLE.search(payload[:4096]):
            # the prefill's failure, never passed through: its settings are read again, and the
            # pair retried where they changed (`PairDispatcher._bootstrap_moved`)
            self.unreachable = True
            self.verdict = self.prefill
            return False
        # the engine's own error is the client's answer when no retry could avoid the worker
        # to blame: a decode's timeout with no other prefill left, or its own failure with no
        # other decode left (its body lost, the client would learn less)
        blamed = self.verdict = self.blamed(status == 504)
        final = last_try or not self._left["prefill" if blamed is self.prefill else "decode"]
        if final:  # charged once the request ended (`PairDispatcher._answered`)
            self.charged = blamed
        return final

    def timed_out(self) -> None:
        blamed = self.blamed(True)
        self._planner.record_failure(blamed.worker, hard=False)
        self.charged = blamed

    async def before_commit(self, status: int) -> None:
        self._prefilled()
        task = self.task
        if status >= 400:
            # an error has no logprobs to merge: answered at once, as without return_logprob.
            # Before, it waited for the prefill, which (SGLang's) answers only once its KV was
            # fetched: a decode's 500 came after the prefill's own KV timeout, as its 504
            self.merge = False
        if task is not None and (self.merge or task.done()):
            answer = _first_answer(await task)  # a failed prefill fails the attempt here
            items = answer if isinstance(answer, list) else [answer]
            self._prefix = [_input_logprobs(item) or [] for item in items]
        self.committed = True

    def _merged(self, answer: Any) -> Any:
        items = answer if isinstance(answer, list) else [answer]
        for item, prefix in zip(items, self._prefix, strict=False):
            own = _input_logprobs(item)
            if own is not None and prefix:
                item["meta_info"]["input_token_logprobs"] = prefix + own
        return answer

    def body(self, payload: bytes) -> bytes:
        if not self.merge:
            return payload
        try:
            return _json.encode(self._merged(msgspec.json.decode(payload)))
        except msgspec.DecodeError:
            return payload

    def chunk(self, data: bytes) -> bytes:
        if not self.merge:
            return data
        self._buffer += data
        out: list[bytes] = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = event.strip()
        if not data.startswith(b"data:") or data[5:].strip() == b"[DONE]":
            return event
        try:
            answer = msgspec.json.decode(data[5:].strip())
        except msgspec.DecodeError:
            return event
        return b"data: " + _json.encode(self._merged(answer)) + b"\n\n"

    def end(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest


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
        self._rooms = random.SystemRandom()
        # per prefill worker, when its unreachable bootstrap server was last said
        self._said_unreachable: dict[str, float] = {}

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
        failures: list[str] = []
        charges = _Charges(planner)
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
                total = len(
                    plan.prefill.candidates if side == "prefill" else plan.decode.candidates
                )
                raise NoWorkerError(f"no routable {side} worker among {total}")
            prefill, decode = prefills[0], decodes[0]
            charges.tried["prefill"].add(prefill.worker)
            charges.tried["decode"].add(decode.worker)
            # which side could be retried on another worker: a 5xx of the decode is the
            # client's answer when the side it is blamed on has none left (`_PairHooks`).
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
                keyed=parsed.keyed,
                stores_prompt=parsed.stores_its_tokens,
            )
            d_ticket = pairs.commit_decode(
                ns,
                parsed.tokens,
                decode,
                first_try=first,
                output_tokens=parsed.output_tokens,
                keyed=parsed.keyed,
                stores_prompt=parsed.stores_its_tokens,
            )
            if obs is not None:
                obs.attempt(plan.prefill, prefill, attempt)
            unreachable = False
            hooks = _PairHooks(
                prefill,
                decode,
                planner,
                left,
                partial(self._prefilled, p_ticket),
                partial(self._answered, request, endpoint, parsed, ns, started, obs, charges),
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
                        prefill.matched_tokens,
                        time.perf_counter() - started,
                        ns.model,
                    )
                raise
            except PrefillFailed as exc:
                blamed, hard, reason, status = prefill, exc.hard, str(exc), exc.status
                at_once = not exc.sent or exc.timed_out
                # the decode got no KV: it stored nothing of the prompt but what its events
                # show (vLLM's was never sent the request)
                _withdraw(p_ticket, Withdraw.PENDING)
                _withdraw(d_ticket, Withdraw.ALL if hooks.task is None else Withdraw.PENDING)
                if isinstance(exc, _BootstrapUnreachable):
                    moved = await self._bootstrap_moved(prefill.worker, exc.port, deadline)
                    if moved is not None and not last_try:
                        # the router's port was stale (a restart): not the worker's failure
                        log.warning("prefill worker %s %s: retried", prefill.worker, moved)
                        continue
                    # its bootstrap server is gone (or configured wrong): charged at once, as
                    # a refused connection is; an unchanged port fails the same on a retry
                    unreachable = at_once = moved is None
            except AttemptFailed as exc:
                blamed, hard, reason, status = decode, exc.hard, str(exc), exc.status
                at_once = not exc.sent
                _withdraw(p_ticket, Withdraw.PENDING)  # cut off, unless it answered already
            except _PrefillRefused as exc:
                _withdraw(d_ticket, Withdraw.ALL)  # no KV ever came: nothing stored there
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
                    prefill.matched_tokens,
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
                _withdraw(p_ticket, Withdraw.PENDING)
                _withdraw(d_ticket, Withdraw.PENDING)
                charges.settle(False)
                raise
            finally:
                planner.finish(p_ticket)
                planner.finish(d_ticket)
            if obs is not None:
                obs.failed(reason, status)
            last_status = status
            side = "prefill" if blamed is prefill else "decode"
            failed[side].add(blamed.worker)
            if at_once:  # it never got the request, or did not answer within the deadline
                planner.record_failure(blamed.worker, hard=hard)
            else:  # the request's fault as much as the worker's, maybe: charged at its end
                charges.failed(side, blamed.worker, hard)
            if unreachable:
                self._say_unreachable(blamed.worker, reason)
            else:
                log.warning("%s worker %s failed before answering: %s", side, blamed.worker, reason)
            self._metrics.retries.labels(blamed.worker).inc()
            failures.append(f"{side} {blamed.worker}: {reason}")
        charges.settle(False)
        message = "every pair tried failed: " + "; ".join(failures)
        if last_status == 504:
            # the last failure was a timeout (a worker's own 504, or the deadline): a client
            # told 502 would take a slow fleet for a broken one
            raise UpstreamTimeoutError(message)
        raise UpstreamError(message)

    async def _bootstrap_moved(self, worker: str, told: int | None, deadline: float) -> str | None:
        """What changed of prefill `worker`'s side of the pairs since it was told to a pair as
        bootstrap port `told`, its settings read again now (`Proxy.ranks_changed`, bounded by
        the request `deadline`); None: nothing."""
        await self._proxy.ranks_changed(worker, deadline)
        entry = self._pairs.planner.pool.find(worker)
        if entry is None:
            return "left the pool"
        if entry.role != "prefill":
            return f"is a {entry.role} worker now"
        if entry.bootstrap_port != told:
            return f"has bootstrap port {entry.bootstrap_port} now, not {told}"
        return None

    def _say_unreachable(self, worker: str, reason: str) -> None:
        """Say that decodes cannot reach prefill `worker`'s bootstrap server: at most once per
        `_SAY_UNREACHABLE_S` (each failed pair says it at DEBUG): every pair through it fails
        until it is back or its circuit opens."""
        now = time.monotonic()
        said = self._said_unreachable.get(worker)
        if said is not None and now - said < _SAY_UNREACHABLE_S:
            log.debug("prefill worker %s failed before answering: %s", worker, reason)
            return
        if len(self._said_unreachable) >= 4096:
            self._said_unreachable.clear()  # bounded: workers come and go
        self._said_unreachable[worker] = now
        log.warning(
            "prefill worker %s failed before answering: %s; its settings read again give no "
            "other bootstrap port: charged to it (said at most every %g s)",
            worker,
            reason,
            _SAY_UNREACHABLE_S,
        )

    def _answered(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        ns: Namespace,
        started: float,
        obs: Observation | None,
        charges: _Charges,
        hooks: _PairHooks,
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
        charges.settle(response.status < 500)
        hooks.counted = True
        self._metrics.record(
            endpoint.value,
            prefill.worker,  # a pair's request counts where its prefix was matched
            answer_code(request, response.status),
            len(parsed.tokens),
            prefill.matched_tokens,
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
        hooks: _PairHooks,
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

    def _bootstrap_port(self, prefill: Candidate) -> int:
        """The bootstrap port the router knows for `prefill`."""
        entry = self._pairs.planner.pool.find(prefill.worker)
        port = entry.bootstrap_port if entry is not None else None
        if port is None:
            raise PrefillFailed("no bootstrap port known for it", hard=False, sent=False)
        return port

    def _bootstrap_fields(
        self, endpoint: Endpoint, parsed: ParsedRequest, prefill: Candidate, port: int
    ) -> dict[str, Any]:
        """SGLang's bootstrap fields for one request: a room per item of a batch."""
        host = urlsplit(prefill.url).hostname or "127.0.0.1"
        count = _batch_size(parsed.body) if endpoint is Endpoint.GENERATE else None
        ranks = self._pairs.planner.indexer.dp_size(prefill.worker)
        if count is None:
            return {
                "bootstrap_host": host,
                "bootstrap_port": port,
                "bootstrap_room": self._room(prefill.dp_rank, ranks),
            }
        return {
            "bootstrap_host": [host] * count,
            "bootstrap_port": [port] * count,
            "bootstrap_room": [self._room(prefill.dp_rank, ranks) for _ in range(count)],
        }

    def _room(self, rank: int | None, ranks: int) -> int:
        """A random room in [0, 2^63) that names `rank` of a prefill worker with `ranks` ranks.

        SGLang 0.5.23's prefill (`load_balance_method` auto: `follow_bootstrap_room`) runs a
        request on rank `room % dp_size`, and its KV sender fails a request told another rank
        without `disagg_prefill_dp_rank` ("follow_bootstrap_room conflict"). A fully random
        room named the rank the router scored in only 1 of `ranks` requests: the rest failed
        their handoff on SGLang."""
        if rank is None or ranks < 2 or rank >= ranks:
            return self._rooms.randrange(_ROOMS)
        return self._rooms.randrange(_ROOMS // ranks) * ranks + rank

    async def _both_at_once(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        hooks: _PairHooks,
        tickets: tuple[Ticket, Ticket],
        deadline: float,
        last_try: bool,
    ) -> web.StreamResponse:
        proxy = self._proxy
        prefill, decode = hooks.prefill, hooks.decode
        p_ticket, ticket = tickets
        hooks.bootstrap_port = port = self._bootstrap_port(prefill)
        fields = self._bootstrap_fields(endpoint, parsed, prefill, port)
        # the rank the prefill runs on, told to both legs: the router's, else the client's,
        # forwarded as it wrote it (the router does not know the prefill's ranks). With it the
        # prefill skips its room check and the decode looks there (SGLang 0.5.23,
        # `common/conn.py`, `decode.py`); before, a client's rank with a random room failed
        # the handoff ("follow_bootstrap_room conflict") on all but 1 in dp_size requests
        rank = prefill.dp_rank if prefill.dp_rank is not None else parsed.dp_rank
        told = {} if rank is None else {"disagg_prefill_dp_rank": rank}
        base = with_body_members(parsed.body, {**fields, **told})
        p_body, p_rank = proxy.tell_rank(endpoint, parsed, prefill, base)
        d_body, d_rank = proxy.tell_rank(endpoint, parsed, decode, base)
        prefill_task = hooks.task = asyncio.create_task(
            self._prefill(request, endpoint, p_body, prefill, p_rank, deadline, p_ticket)
        )
        hooks.merge = b'"return_logprob"' in parsed.body and _wants_logprobs(parsed.body)
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
                    if isinstance(failure, PrefillFailed | _PrefillRefused):
                        raise failure from exc
                if hooks.unreachable:
                    raise _BootstrapUnreachable(
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
                if hooks.charged is prefill:
                    raise UpstreamTimeoutError(
                        f"prefill {prefill.worker} sent decode {decode.worker} no KV within the "
                        "request timeout"
                    ) from exc
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
        hooks: _PairHooks,
        tickets: tuple[Ticket, Ticket],
        deadline: float,
        last_try: bool,
    ) -> web.StreamResponse:
        p_ticket, ticket = tickets
        prefill, decode = hooks.prefill, hooks.decode
        if endpoint is Endpoint.GENERATE:
            raise RequestError("vLLM prefill/decode pairs serve the OpenAI routes, not /generate")
        proxy = self._proxy
        body = msgspec.json.decode(parsed.body)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        body.pop("stream_options", None)
        body.update(stream=False, max_tokens=1, kv_transfer_params=VLLM_PREFILL_KV_TRANSFER_PARAMS)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        # vLLM pairs the two legs by their X-Request-Id: the request's own (the client's
        # well-formed one, else the router's), as the docs promise for any hop; with nothing
        # observed the client's as it is, made up only when nothing names it
        obs = observation(request)
        request_id = (
            obs.request_id
            if obs is not None
            else request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        )
        p_body, p_rank = proxy.tell_rank(endpoint, parsed, prefill, _json.encode(body))
        payload = await self._prefill(
            request, endpoint, p_body, prefill, p_rank, deadline, p_ticket, request_id=request_id
        )
        answer = _first_answer(payload)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise PrefillFailed("its answer carries no kv_transfer_params", hard=False)
        d_body = with_body_members(parsed.body, {"kv_transfer_params": params})
        d_body, d_rank = proxy.tell_rank(endpoint, parsed, decode, d_body)
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
        """The prefill side's whole answer; PrefillFailed (retry) or _PrefillRefused (4xx).

        Its answer is the end of its part (`_prefilled`).
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:  # not the worker's failure: it was never asked
            raise UpstreamTimeoutError("the request deadline passed before the prefill was asked")
        timeout = aiohttp.ClientTimeout(total=remaining, connect=self._config.timeouts.connect_s)
        headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
        auth = request.headers.get("Authorization")
        if auth is not None:
            headers["Authorization"] = auth
        if rank_header is not None:
            headers[rank_header] = str(prefill.dp_rank)
        elif (named := request.headers.get(DP_RANK_HEADER)) is not None:
            # the client's rank, forwarded as it wrote it (the decode hop copies it too);
            # before, a prefill whose ranks the router does not know never got it
            headers[DP_RANK_HEADER] = named
        # the request's id and trace context, as its decode hop gets them: the client's id
        # untouched when well formed (else the router's); the client's trace context, replaced
        # by the attempt's span when the router traces
        for name in _TRACE_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        if request_id is None:
            request_id = request.headers.get(REQUEST_ID_HEADER)
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
            raise PrefillFailed(f"connection lost: {exc}", hard=True, sent=False) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(f"connection lost: {exc}", hard=True) from exc
        except aiohttp.ClientError as exc:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(f"{type(exc).__name__}: {exc}", hard=False) from exc
        if status >= 500:
            ticket.withdraw = Withdraw.PENDING
            raise PrefillFailed(f"HTTP {status}: {payload[:200]!r}", hard=False, status=status)
        if status >= 400:
            ticket.withdraw = Withdraw.ALL
            raise _PrefillRefused(status, payload)
        self._prefilled(ticket)
        return payload

    def _prefilled(self, ticket: Ticket) -> None:
        """The prefill side's part is over (it answered, or its decode did): `ticket` stops
        counting as queued prefill and as running there (once)."""
        self._pairs.planner.first_byte(ticket)
        self._pairs.planner.finish(ticket)


def _withdraw(ticket: Ticket, least: Withdraw) -> None:
    """A failed attempt takes back at least `least` of what routing marked for `ticket`, at
    its end (`Planner.finish`); a side that already answered is ended and keeps its marks."""
    ticket.withdraw = max(ticket.withdraw, least)


def _batch_size(raw: bytes) -> int | None:
    """Items of a batched `/generate` (None: one prompt), as SGLang's router counts them."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    text = body.get("text")
    if text is not None:
        return len(text) if isinstance(text, list) else None
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _wants_logprobs(raw: bytes) -> bool:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    return isinstance(body, dict) and body.get("return_logprob") is True


def _prefill_side(plan: PdPlan) -> Plan:
    """A pair is held for its prefill side, where its prefix is reused."""
    return plan.prefill
