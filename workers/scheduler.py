"""The scheduler and latency model of one DP rank: a waiting queue, a bounded running batch.

It follows SGLang's scheduler where routing can see it:
- admission is FIFO; a request is admitted when the running batch has room and the KV pool
  can reserve its uncached prompt plus its output (evicting LRU leaves if needed);
- at admission the prompt (minus its last token, which must be computed) is matched against
  the radix cache: that match is `cached_tokens`, and its nodes are locked;
- a prefill step runs the newly admitted requests and costs `prefill_ms_per_token` per
  uncached token; when it completes the prompt's pages are inserted (SGLang's BlockStored
  moment) and every request gets its first token;
- a decode step gives every running request one more token and costs `decode_ms_per_token`;
- a finished request inserts prompt + output (as `cache_finished_req` does) and unlocks.
Every step's KV events go out as one batch. All durations are multiplied by `time_scale`.

Prefill/decode (`workers.disagg`): a prefill job (`hold_kv`) keeps its prompt's pages locked
after it finishes, until `release_hold` (the decode side has them, or gave up); a decode job
whose KV came by transfer (`kv_transferred`) costs nothing in its prefill step (the transfer
was paid before it was queued) but still caches its prompt, so a decode worker's events show
what it holds.

Output is deterministic: a fixed text, entered at an offset that depends on the prompt.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator

from indexer.protocol.tokens import ByteTokenizer
from workers.cache import Namespace, PagedRadixCache, RadixNode
from workers.config import WorkerConfig
from workers.errors import CacheBusyError, RequestError, WorkerError
from workers.io_struct import Generation
from workers.publisher import EventPublisher

__all__ = ["Job", "QueueFullError", "RankScheduler", "deterministic_output"]

_log = logging.getLogger(__name__)

_OUTPUT_TEXT = (
    "The reference worker answers every prompt with this same text, entered at an offset "
    "that depends on the prompt, so outputs are deterministic and cost one token per byte. "
)
_OUTPUT_IDS = ByteTokenizer().encode(_OUTPUT_TEXT)


class QueueFullError(WorkerError):
    """The waiting queue is at `max_queued_requests`; the HTTP layer answers 503."""


def deterministic_output(prompt: list[int], count: int) -> list[int]:
    """The `count` output token ids of `prompt`: the same prompt always gets the same text."""
    offset = (sum(prompt) * 31 + len(prompt)) % len(_OUTPUT_IDS)
    return [_OUTPUT_IDS[(offset + i) % len(_OUTPUT_IDS)] for i in range(count)]


class Job:
    """One request on one rank: its progress, and the stream of token ids it produces."""

    def __init__(self, generation: Generation, rank: int) -> None:
        self.generation = generation
        self.rank = rank
        self.prompt = generation.input_ids
        self.planned = deterministic_output(self.prompt, generation.max_new_tokens)
        self.output: list[int] = []
        self.cached_tokens = 0
        self.loaded_tokens = 0  # of cached_tokens, those loaded back from the host tier
        self.node: RadixNode | None = None
        self.held: RadixNode | None = None  # a finished prefill's pages, locked for a decode
        self.reserved_pages = 0
        self.cancelled = False
        self.finished = False
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # Bounded by construction: one slot per planned token plus the end marker.
        self._tokens: asyncio.Queue[int | None] = asyncio.Queue(maxsize=len(self.planned) + 1)

    @property
    def namespace(self) -> Namespace:
        """The cache namespace of this request."""
        return self.generation.namespace

    @property
    def reported_cached_tokens(self) -> int:
        """The cache hit it reports: a transferred decode's is the prefill side's."""
        remote = self.generation.remote_cached_tokens
        return self.cached_tokens if remote is None else remote

    def emit_next(self) -> None:
        """Produce the next planned token (called by the scheduler)."""
        token = self.planned[len(self.output)]
        self.output.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._tokens.put_nowait(token)

    def mark_finished(self) -> None:
        """End the token stream (called by the scheduler)."""
        self.finished = True
        self.finished_at = time.monotonic()
        self._tokens.put_nowait(None)

    async def tokens(self) -> AsyncIterator[int]:
        """Each output token id as it is produced; ends when the request finishes."""
        while True:
            token = await self._tokens.get()
            if token is None:
                return
            yield token

    async def wait(self) -> list[int]:
        """Wait for the whole output."""
        async for _ in self.tokens():
            pass
        return self.output


class RankScheduler:
    """Scheduling, latency and KV cache of one DP rank; publishes that rank's event stream."""

    def __init__(
        self, config: WorkerConfig, rank: int, cache: PagedRadixCache, publisher: EventPublisher
    ) -> None:
        self.config = config
        self.rank = rank
        self.cache = cache
        self.publisher = publisher
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._wake = asyncio.Event()
        self._held: set[Job] = set()  # finished prefills whose pages wait for a decode
        self.completed = 0

    @property
    def idle(self) -> bool:
        """No request waiting or running."""
        return not self._waiting and not self._running

    @property
    def holding(self) -> int:
        """Finished prefills whose pages wait for their decode."""
        return len(self._held)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self._running), len(self._waiting)

    def submit(self, generation: Generation) -> Job:
        """Queue a request; raises RequestError if it can never fit, QueueFullError if full."""
        total = len(generation.input_ids) + generation.max_new_tokens
        if total > self.config.context_length:
            raise RequestError(
                f"prompt plus max_new_tokens is {total} tokens, over the context length "
                f"{self.config.context_length}"
            )
        if self._pages_for(total) > self.cache.total_pages:
            raise RequestError(f"{total} tokens do not fit in this worker's KV pool")
        if len(self._waiting) >= self.config.max_queued_requests:
            raise QueueFullError("the waiting queue is full")
        job = Job(generation, self.rank)
        self._waiting.append(job)
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it at the next step if it runs."""
        job.cancelled = True
        if job in self._waiting:
            self._waiting.remove(job)
            job.mark_finished()

    def flush(self) -> int:
        """Flush the whole cache (refused while requests run, as SGLang does); returns the
        pages it held."""
        if not self.idle or self._held:
            raise CacheBusyError("cache not flushed: requests are running or waiting")
        removed = self.cache.flush()
        self._publish()
        return removed

    def flush_namespace(self, cache_salt: str | None) -> int:
        """Evict one salt's unreferenced pages (None: the unsalted ones); returns pages removed."""
        removed = self.cache.flush_namespace(cache_salt)
        self._publish()
        return removed

    def release_hold(self, job: Job) -> None:
        """The decode side has a prefill's pages (or gave up): they may be evicted again."""
        if job.held is not None:
            self.cache.unlock(job.held)
            job.held = None
            self._held.discard(job)
            self._wake.set()  # a waiting request may fit now

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.cache.page_size)

    def _publish(self) -> None:
        self.publisher.publish(self.cache.take_events())

    async def _sleep_ms(self, ms: float) -> None:
        # Zero still yields, so HTTP handlers and replays run between steps.
        await asyncio.sleep(ms * self.config.time_scale / 1000.0)

    async def run(self) -> None:
        """The scheduler loop; runs until cancelled, or until a bug stops it (logged).

        A crash must not leave clients waiting forever on jobs nobody will run: every queued
        and running job is ended, and the task returns, so the worker reports itself dead.
        """
        try:
            await self._loop()
        except Exception:
            _log.exception(
                "the scheduler of DP rank %d crashed; its requests are aborted", self.rank
            )
            for job in [*self._waiting, *self._running]:
                job.cancelled = True
                if not job.finished:
                    job.mark_finished()
            self._waiting.clear()
            self._running = []

    async def _loop(self) -> None:
        self._publish()  # the cache's startup AllBlocksCleared: seq 0, like SGLang
        while True:
            if self.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            admitted = self._admit()
            if admitted:
                await self._prefill(admitted)
            elif self._running:
                await self._decode()
            else:
                # Nothing fits although no request runs: the pool is held by finished
                # prefills whose decode has not fetched their pages yet (submit rejects what
                # can never fit); wait for a change (release_hold wakes us) rather than spin.
                self._wake.clear()
                await self._wake.wait()

    def _admit(self) -> list[Job]:
        admitted: list[Job] = []
        while self._waiting and len(self._running) < self.config.max_running_requests:
            job = self._waiting[0]
            reusable = job.generation.reusable_tokens
            found = self.cache.match(job.namespace, job.prompt[:reusable])
            # the deepest node of the prefix, on the GPU or (a host-tier hit) on the host
            held = found.host_node or found.node
            self.cache.lock(held)
            need = self._pages_for(len(job.prompt) + len(job.planned))
            need -= found.length // self.cache.page_size  # host pages need GPU pages too
            if not self.cache.reserve(need):
                self.cache.unlock(held)
                break
            self._waiting.popleft()
            cached = found.length
            if found.host_node is not None:
                # the host part of the prefix comes back to the GPU (paid in the prefill step);
                # what the GPU could not take back is computed like any uncached token
                need -= self.cache.load_back(found.host_node, reserved_pages=need)
                cached = self.cache.peek_gpu(job.namespace, job.prompt[:-1])
            job.node, job.reserved_pages = held, need
            job.cached_tokens, job.loaded_tokens = cached, cached - found.length
            # Running from admission on (SGLang counts the prefill batch as running), so a
            # crash mid-prefill still finds it.
            self._running.append(job)
            admitted.append(job)
        if admitted:
            self._publish()  # evictions made to reserve room
        return admitted

    async def _prefill(self, jobs: list[Job]) -> None:
        while jobs:
            uncached = sum(
                len(job.prompt) - job.cached_tokens
                for job in jobs
                if not job.generation.kv_transferred
            )
            loaded = sum(job.loaded_tokens for job in jobs)
            await self._sleep_ms(
                self.config.prefill_ms_per_token * uncached
                + self.config.host_load_ms_per_token * loaded
            )
            # SGLang's overlap scheduler forms the next batch while this one runs, so that
            # batch is matched against the cache before these prompts are in it (0.5.23's
            # `event_loop_overlap`: `get_next_batch_to_run` before `process_batch_result`)
            following = self._admit() if self.config.overlap_schedule else []
            for job in jobs:
                self._cache_tokens(job, job.prompt)
                if job.planned and not job.cancelled:
                    job.emit_next()
            self._retire(following)
            self._publish()
            jobs = following

    async def _decode(self) -> None:
        await self._sleep_ms(self.config.decode_ms_per_token)
        for job in self._running:
            if not job.cancelled and len(job.output) < len(job.planned):
                job.emit_next()
        self._retire()
        self._publish()

    def _retire(self, starting: list[Job] | None = None) -> None:
        """Retire the finished jobs; `starting`: jobs admitted whose prefill has not run."""
        still: list[Job] = []
        for job in self._running:
            if starting and job in starting:
                still.append(job)
            elif job.cancelled or len(job.output) >= len(job.planned):
                # SGLang caches prompt + output except the last token (its KV is never made).
                self._cache_tokens(job, job.prompt + job.output[:-1])
                assert job.node is not None
                if job.generation.hold_kv and not job.cancelled:
                    self.cache.lock(job.node)  # until the decode side has the pages
                    job.held = job.node
                    self._held.add(job)
                self.cache.unlock(job.node)
                self.cache.release(job.reserved_pages)
                job.node, job.reserved_pages = None, 0
                self.completed += 1
                job.mark_finished()
            else:
                still.append(job)
        self._running = still

    def _cache_tokens(self, job: Job, tokens: list[int]) -> None:
        """Insert `tokens` from the job's reservation and move its lock to the new path end."""
        found, used = self.cache.insert(job.namespace, tokens, reserved_pages=job.reserved_pages)
        job.reserved_pages -= used
        assert job.node is not None
        self.cache.lock(found.node)
        self.cache.unlock(job.node)
        job.node = found.node
