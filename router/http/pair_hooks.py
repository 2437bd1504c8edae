"""One attempt of a prefill/decode pair as its decode side's answer sees it (`PairHooks`).

The proxy forwards the decode leg (`Proxy.forward`) with these hooks (`AnswerHooks`), which name
both workers in the answer's headers (the prediction shown is the prefill side's, where reuse
happens), check the prefill's fate before anything is committed to the client, merge in its
input logprobs, and decide whom a failure of the decode is charged to.

Blame (`PairHooks.blamed`): a decode that times out (answers 504, SGLang's
`kv_transfer_timeout`, or outlives the request deadline) while its prefill has not answered is
the prefill's failure: SGLang's prefill answers once its KV is handed over, so the KV never
came (at the request deadline with both legs waiting, the side that failed so before with another
partner is charged instead, else neither: `router.http.pair_faults`). A prefill that
failed is blamed for its decode's failure (a prefill dying mid-transfer: its connection drops,
or its decode's transfer is cut, whichever the router hears first). So is a decode that says it
could not reach the prefill's bootstrap server (`router.http.bootstrap_unreachable`). Any other
failure of the decode is its own. A prefill that fails while its decode has not answered is
judged by what it says (`router.http.pair_handoff`): no decode came for its KV, the decode's
failure. The engine's 5xx is the client's answer when the side it is blamed on has no other
worker to retry on.

Logprobs (SGLang, `return_logprob`): the prefill's `meta_info.input_token_logprobs` are put
before the decode's, as SGLang's router merges them, in a whole answer or in each streamed
event; the decode's answer waits for the prefill's before it is committed, unless it is an
error, which has none to merge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from router.http.answer_relay import (
    FORECAST_HEADER,
    MATCHED_HEADER,
    PENDING_HEADER,
    RAW_MATCHED_HEADER,
    RAW_PENDING_HEADER,
    AnswerHooks,
)
from router.http.bootstrap_unreachable import says_unreachable
from router.http.pair_failure import PrefillFailed, PrefillRefused
from router.http.pair_faults import PairFaults
from router.routing.planner import Planner
from router.routing.policy import Candidate

__all__ = [
    "DECODE_HEADER",
    "PREFILL_HEADER",
    "PREFILL_RANK_HEADER",
    "PairHooks",
    "first_answer",
    "wants_logprobs",
]

log = logging.getLogger(__name__)

PREFILL_HEADER = "x-kvroute-prefill-worker"
PREFILL_RANK_HEADER = "x-kvroute-prefill-dp-rank"
DECODE_HEADER = "x-kvroute-decode-worker"
_json = msgspec.json.Encoder()


def _input_logprobs(answer: Any) -> list[Any] | None:
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    found = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return found if isinstance(found, list) else None


def first_answer(payload: bytes) -> Any:
    """A prefill's answer: its JSON, or the first `data:` event of a stream."""
    text = payload.strip()
    if text.startswith(b"data:"):
        text = text[5:].split(b"\n", 1)[0].strip()
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None


def wants_logprobs(raw: bytes) -> bool:
    """Whether a request body asks for `return_logprob` (the prefill's are merged in)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    return isinstance(body, dict) and body.get("return_logprob") is True


def _deadline_of(task: asyncio.Task[bytes]) -> bool:
    """Whether a prefill's task, done, ended at the request deadline (not answered)."""
    failure = None if task.cancelled() else task.exception()
    return isinstance(failure, PrefillFailed) and failure.timed_out


class PairHooks(AnswerHooks):
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
        answered: Callable[[PairHooks, web.StreamResponse], None],
        faults: PairFaults | None = None,
    ) -> None:
        super().__init__()
        self._faults = faults
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
        # the request deadline passed with neither leg answered (`timed_out`)
        self.stalled = False
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
                self.prefill if isinstance(failure, PrefillFailed | PrefillRefused) else self.decode
            )
        return self.prefill if kv_wait else self.decode

    def passes_through(self, status: int, last_try: bool, payload: bytes) -> bool:
        if self.task is not None and says_unreachable(payload):
            # the prefill's failure, never passed through: its settings are read again, and the
            # pair retried where they changed (`bootstrap_moved`)
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

    def timed_out(self, prefill_waiting: bool | None = None) -> str | None:
        """The request deadline passed before the decode answered: one ordinary failure
        charged at once; returns the worker charged (None: nobody). With the prefill not
        answered either (`prefill_waiting`; by default its task under way) the two look
        alike: the side that failed so before with another partner is charged, else neither
        (`PairFaults`; `stalled` says so)."""
        task, faults = self.task, self._faults
        if prefill_waiting is None:
            prefill_waiting = task is not None and (
                not task.done() or _deadline_of(task)  # its own deadline came at the same time
            )
        blamed: Candidate | None
        if prefill_waiting and faults is not None:
            self.stalled = True
            pool = self._planner.pool
            side, _ = faults.blame(
                self.prefill.worker, self.decode.worker, None, lambda w: pool.find(w) is not None
            )
            blamed = None if side is None else self.decode if side == "decode" else self.prefill
            spared = blamed is not None and self._last_of_its_side(blamed.worker, side or "")
            if spared:
                # the partners' word is no proof: charged, the last worker of its side takes
                # the model out for the cooldown (QA: a transient failure of the only
                # prefill, then a decode wedging, and every request a 503)
                blamed = None
            # both named: whichever leg's timer fired first, the wedged one may be either
            log.warning(
                "neither prefill worker %s nor decode worker %s answered within the request "
                "timeout (timeouts.request_s): 504, %s",
                self.prefill.worker,
                self.decode.worker,
                "nobody charged (the side it points at has no other worker)"
                if spared
                else "nobody charged"
                if blamed is None
                else f"charged to worker {blamed.worker}",
            )
        else:
            blamed = self.blamed(True)
        self.charged = blamed
        if blamed is None:
            return None
        self._planner.record_failure(blamed.worker, hard=False)
        return blamed.worker

    def _last_of_its_side(self, worker: str, role: str) -> bool:
        """Whether `worker` is the only routable worker of its `role` for its model."""
        pool = self._planner.pool
        entry = pool.find(worker)
        if entry is None:
            return False
        now = self._planner.clock()
        return not any(
            e.role == role and e.id != worker and e.routable(now)
            for e in pool.serving(entry.cache_model)
        )

    async def before_commit(self, status: int) -> None:
        self._prefilled()
        task = self.task
        if status >= 400:
            # an error has no logprobs to merge: answered at once, as without return_logprob.
            # Before, it waited for the prefill, which (SGLang's) answers only once its KV was
            # fetched: a decode's 500 came after the prefill's own KV timeout, as its 504
            self.merge = False
        if task is not None and (self.merge or task.done()):
            answer = first_answer(await task)  # a failed prefill fails the attempt here
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
