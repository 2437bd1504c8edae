"""The indexer service: the router's one door to the index and the stream subscriptions.

An async context manager that owns one subscriber task per (worker, dp rank) stream over a
single pure `PrefixIndex`. Several things mutate the index (the subscriber tasks applying
events, the router's pending marks, admin evictions and snapshot loads), all on the one event
loop and none awaiting in the middle of a mutation, so it needs no lock and the router's
synchronous `query` always sees a consistent index.

    async with IndexerService(IndexerConfig()) as indexer:
        await indexer.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:5557")])
        matches = indexer.query(Namespace("model", None, salt), token_ids)

A worker with several data-parallel ranks has one stream per rank (one cache each): `query`
answers every rank apart (`WorkerMatch.ranks`), so the router can choose the rank as well, and
`add_pending` marks the prefix on the rank the request was sent to (or on every stream of the
worker when the router left the rank to the engine); `query` reports the marks as
`pending_tokens`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, TypeVar, cast

import msgspec

from indexer.config import IndexerConfig, StreamConfig
from indexer.errors import SnapshotError
from indexer.fed_stream import FedStreams
from indexer.fence import BatchFence
from indexer.health import StreamHealth
from indexer.index import PrefixIndex
from indexer.index.walk import PrefixMatch
from indexer.loop_watch import LoopWatch
from indexer.namespace import Namespace
from indexer.recent_marks import RecentMarks
from indexer.server_stream import ServerStream, server_stream
from indexer.shadowed import Shadow, ShadowedPrefixes, ShadowMark, trusted_blocks
from indexer.sink import IndexSink
from indexer.snapshot import KeptShadows, dump_index, load_snapshot
from indexer.stats import (
    UNTRUSTED,
    NamespaceStats,
    RankMatch,
    StreamState,
    StreamStats,
    WorkerMatch,
    carried_over,
)
from indexer.stream.subscriber import StreamSubscriber
from indexer.stream_tap import StreamHead, StreamTap, TappedSink
from indexer.subscriptions import Subscriptions, stream_id
from indexer.waiting_shadows import Waiting, WaitingShadows
from indexer.worker_matches import WorkerMatches

__all__ = [
    "SHADOW_HEAD_TOKENS",
    "UNTRUSTED",
    "IndexerConfig",
    "IndexerService",
    "Namespace",
    "NamespaceStats",
    "PendingMark",
    "RankMatch",
    "ShadowMark",
    "StreamConfig",
    "StreamState",
    "StreamStats",
    "WorkerMatch",
    "stream_id",
]

log = logging.getLogger(__name__)

# how long a loaded snapshot's streams wait for their workers to be subscribed (`load`)
ORPHAN_GRACE_S = 600.0
# the leading tokens kept of a prompt shadowed on a stream whose block size is not known yet
# (more than any engine's page: a longer page blankets the stream), and how many such prompts
_UNSIZED_HEAD = 256
_UNSIZED_LIMIT = 4096
# the prompt head another replica's shadow carries (`router.cluster`): its blocks are
# shadowed, and the last is its tail (what follows may be the extra_key's: fail closed)
SHADOW_HEAD_TOKENS = _UNSIZED_HEAD
# the most blocks of one prompt shadowed on a stream (the last is its tail), and how many
# shadows are kept before new prompts shadow their first block only (memory: a few dozen
# bytes a shadow; a tail that early hides more, never shows a copy that is not plain)
_SHADOW_BLOCKS = 2048
_SHADOW_LIMIT = 4_000_000
# a restart of a stream's publisher judges only the shadows marked there longer ago than this
# (`_judge_own_shadows`): a request marked since may have reached the new process before its
# stream found it, and how long that takes is not bounded by anything the stream sees (a
# forwarder in front hides the restart until the new process publishes; a stalled loop reads
# the old process's last batches after marks made for the new one). The keys marked within
# it are kept per stream, up to `_RECENT_MARK_KEYS`: past that, a restart judges nothing
RESTART_DOUBT_S = 300.0
_RECENT_MARK_KEYS = 1 << 18
# the prompt heads (`SHADOW_HEAD_TOKENS` each, 1 KiB) kept per stream for the same time, to
# shadow them again in a new page size (`_carry_recent`): past it, the oldest heads'
# namespaces are kept instead, and past as many of those the stream is hidden whole
# (`indexer.recent_marks`)
_RECENT_HEADS = 1024
_RECENT_NAMESPACES = 4096

# a pending mark made (`add_pending`): (stream, the index's generation of it)
PendingMark = tuple[str, int]


# a stream of a worker that left, for its id registered again (`_carry_recent`): the worker,
# the server's stream it followed, its recent marks, the worker's URL and the stream's block
# size then
class _Left(NamedTuple):
    worker: str
    dp_rank: int
    server: ServerStream
    recent: RecentMarks
    url: str | None
    block_size: int | None


# a request with an `extra_key` sent to a worker while it is not followed, to be followed again
# (`IndexerService.remove_worker(returning=True)`: registered anew, or put aside by the false-hit
# watch): its namespace, prompt head, dp rank and until when its shadow is kept
_Meanwhile = tuple[Namespace, Sequence[Hashable], int | None, float]
# the most of those kept for one worker (past it, its streams are hidden whole)
_MEANWHILE_LIMIT = 4096
# the most of other replicas' shadows kept for servers no worker is followed at here
# (`shadow_at`), every URL together (past it, a worker added where one was forgotten is hidden
# whole): a prompt head a shadow, 2 KiB packed
_WAITING_LIMIT = 4096

# a shadow sent to a stream whose block size was not known yet (`_shadow_unsized`): (stream,
# plain namespace, the prompt's leading tokens, its extra_key, kept until)
_Unsized = tuple[str, Namespace, Sequence[Hashable], str, float]


_K = TypeVar("_K")


def _hidden_until(
    timed: dict[_K, float], key: _K, hidden: bool, until: float | None
) -> float | None:
    """Record in `timed` that `key` (a blanket, `hidden` already or not) is hidden until
    `until` (None: for good); returns when it lapses now (None: never). One hidden for good
    stays so; two times keep the later."""
    if until is None:
        timed.pop(key, None)
        return None
    if hidden and key not in timed:
        return None
    timed[key] = max(until, timed.get(key, until))
    return timed[key]


class IndexerService:
    """Owns the index and one subscriber task per stream; see the module docstring."""

    def __init__(
        self,
        config: IndexerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        tap: StreamTap | None = None,
        fed: bool = False,
        fed_silent_after_s: float | None = None,
    ) -> None:
        self.config = config or IndexerConfig()
        self._clock = clock
        self.index = PrefixIndex(clock=clock, pending_ttl_s=self.config.pending_ttl_s)
        # other replicas' marks will come (`expect_peer_marks`): an index loaded in place of
        # this one logs its removals too
        self._peer_marks = False
        # `tap`: told everything the streams make the index do (`kvroute relay` republishes
        # it); `fed`: no subscriptions, the streams are applied from a relay's records
        self.tap = tap
        # `fed_silent_after_s`: a fed stream is STALE once its relay said nothing this long
        # (default: `stale_after_s`)
        self.fed = (
            FedStreams(
                self.config,
                on_applied=self._on_applied,
                on_restart=self._on_restart,
                clock=clock,
                silent_after_s=fed_silent_after_s,
            )
            if fed
            else None
        )
        self._subs = Subscriptions(
            self.config,
            on_applied=self._on_applied,
            on_restart=self._on_restart,
            on_state=None if tap is None else tap.state,
            clock=clock,
        )
        self._streams: Subscriptions | FedStreams = self._subs if self.fed is None else self.fed
        # worker -> its streams (the one dict). A `FedStream` answers everything this service
        # asks of a subscriber; typed as subscribers for the tests that reach into them
        self._workers = cast("dict[str, list[StreamSubscriber]]", self._streams.by_worker)
        self._health: dict[str, list[StreamHealth]] = {}  # the same streams, as queries see them
        self._stream_health: dict[str, StreamHealth] = {}  # the same, by stream
        self._waiters: list[tuple[str, int, asyncio.Future[bool]]] = []
        self._applied_seq: dict[str, int] = {}  # stream -> the last seq applied (`wait_applied`)
        self._matches = WorkerMatches(clock)
        # prefixes sent with an extra_key, which their events show as plain (`indexer.shadowed`)
        self._shadowed = ShadowedPrefixes()
        # the same, sent to streams whose block size was not known yet, made keys once it is
        self._unsized_shadows: list[_Unsized] = []
        # the seeds (parents of first blocks) that are tails of prompts with no full block,
        # and their namespace: such a tail is kept while its stream holds a page of it
        self._seeds: dict[int, Namespace] = {}
        # streams whose plain entries are all hidden: shadows that could not be kept there
        self._blanket: set[str] = set()
        # when each was last hidden so (`_cover`): a new process found on it later than
        # `RESTART_DOUBT_S` after that holds none of those copies (`_judge_adoption`)
        self._blanket_at: dict[str, float] = {}
        # of those, the ones hidden only for a time, and until when (`_cover`, `_lapse`): the
        # shadows they stand for would have lapsed by then; the soonest of those times
        self._blanket_until: dict[str, float] = {}
        self._next_lapse = math.inf
        # per stream to be judged, the time before which its blanket may be lifted then
        self._judged_from: dict[str, float] = {}
        # the unsized shadows and blankets of streams whose worker left, by the server's stream
        # (`_server_stream`), as `ShadowedPrefixes.park` keeps their shadows: for a worker
        # added on that stream again (a rename, an id swap, an admin delete and add)
        self._parked_unsized: dict[ServerStream, list[_Unsized]] = {}
        self._parked_blanket: set[ServerStream] = set()
        self._parked_blanket_at: dict[ServerStream, float] = {}
        # of those, the ones hidden only for a time, and until when (`_cover`'s `until`)
        self._parked_blanket_until: dict[ServerStream, float] = {}
        # the fences (last batch applied) of the streams parked for each server's stream, and
        # per stream that took them, until its publisher's seq shows whether it is the process
        # they were made on (`_judge_adoption`): the fences and the unsized shadows it took
        self._parked_fences: dict[ServerStream, list[BatchFence | None]] = {}
        self._adopted: dict[str, tuple[list[BatchFence | None], list[_Unsized]]] = {}
        # per stream, the keys and prompt heads shadowed there within `RESTART_DOUBT_S`
        self._recent_marks: dict[str, RecentMarks] = {}
        # per stream of a worker that left, the server's stream it followed, its recent
        # marks, its worker's URL and its block size, for the same stream id registered again
        # (`_carry_recent`)
        # (keyed by stream and URL: an id that left two URLs lately left a record at each)
        self._left: dict[tuple[str, str | None], _Left] = {}
        # workers not followed for a while (`remove_worker(returning=True)`): the `extra_key`
        # requests sent to each meanwhile, which its streams shadow once it is followed again,
        # and the (dp rank, server's stream) it followed, which keep them should it not be
        self._meanwhile: dict[str, list[_Meanwhile]] = {}
        self._meanwhile_servers: dict[str, list[tuple[int, ServerStream]]] = {}
        self._meanwhile_urls: dict[str, str | None] = {}
        # the same of workers removed meanwhile, by the URL they were sent to (when, items):
        # for a worker added there next, under any id (`_orphaned_meanwhile`)
        self._orphaned: dict[str, tuple[float, list[_Meanwhile]]] = {}
        # other replicas' `extra_key` requests sent to a URL no worker is followed at here
        # (`shadow_at`): for the worker added there next, under any id
        self._waiting = WaitingShadows(most=_WAITING_LIMIT)
        # per worker that left and its URL, the streams it had there (`_carry_recent`: a rank
        # it had at that URL is its own; QA: one it had only elsewhere since took none of its
        # records here)
        self._left_streams: dict[tuple[str, str | None], set[str]] = {}
        self._urls: dict[str, str | None] = {}  # worker -> its URL, as `add_worker` was told
        # told the stream id after each event batch applied (the router's load bookkeeping:
        # `router.routing.prefill_watch`); synchronous, so each must be quick and not raise
        self.applied_listeners: list[Callable[[str], None]] = []
        self._loaded_at: float | None = None  # when a snapshot was last loaded (`load`)
        # told the worker whose stream saw its publisher restart (the router re-reads the
        # worker's settings: `router.fleet.supervisor`); synchronous, so each must be quick
        self.restart_listeners: list[Callable[[str], None]] = []
        # per stream id, its counters from before its worker was registered anew (`add_worker`):
        # added to its subscriber's, so each (worker, dp rank) series stays monotonic while the
        # worker is subscribed
        self._carried: dict[str, StreamStats] = {}
        # per stream id, the restarts it had counted when its worker's settings were last found
        # as registered (`settled`; else when it was subscribed): a re-registration because the
        # worker is another process counts that restart unless the stream counted one since
        self._settled_restarts: dict[str, int] = {}
        # a loop that did not run (the process stopped, the loop blocked) may have left a
        # worker's restart unread on the sockets: the streams are proven again (`_stalled`).
        # A fed stream's freshness is its relay's records (`indexer.fed_stream`)
        self._watch = None if fed else LoopWatch(self._stalled)

    async def __aenter__(self) -> IndexerService:
        await self._streams.__aenter__()
        if self._watch is not None:
            self._watch.start()
        return self

    @property
    def stream_descriptors(self) -> int:
        """The file descriptors this process's streams may hold (`Subscriptions.
        descriptor_room`; none when fed: a fed stream opens no socket), known once entered."""
        return 0 if self.fed is not None else self._subs.descriptor_room

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._watch is not None:
                await self._watch.stop()
            for worker in list(self._workers):
                await self.remove_worker(worker)
        finally:  # even when cancelled meanwhile: no waiter left hanging, no socket left open
            for _, _, fut in self._waiters:
                if not fut.done():
                    fut.set_result(False)
            self._waiters.clear()
            await self._streams.__aexit__(*exc)

    # -------------------------------------------------------------- workers

    async def add_worker(
        self,
        worker: str,
        streams: Sequence[StreamConfig],
        *,
        restarted: bool = False,
        url: str | None = None,
    ) -> None:
        """Subscribe to a worker's streams (replacing any it had); its entries start empty.

        A worker subscribed already is registered anew: the stream of a dp rank it had keeps
        its counters (`streams`; the entries it held count as a clear), one of a rank it no
        longer has goes as a removed worker's does, one of a new rank starts at 0.
        `restarted`: the worker is another process now (its settings changed), a restart each
        of its streams counts unless it counted one itself since its worker's settings were
        last read (`settled`). Before, a re-registration started every counter at 0 again:
        Prometheus saw a counter reset, and no restart, for the restarts that changed a worker.
        `url`: where the worker is served, the server spelled one way (`localhost` as
        `127.0.0.1`; None: not told), which says whether a worker added again under its id is
        the same one (`_carry_recent`).
        """
        ranks = [cfg.dp_rank for cfg in streams]
        if len(set(ranks)) != len(ranks):
            # checked before anything changes: a refused worker leaves no stream behind
            rank = next(r for r in ranks if ranks.count(r) > 1)
            raise ValueError(f"worker {worker!r} lists dp rank {rank} twice")
        earlier: dict[str, StreamStats] = {}
        settled: dict[str, int] = {}
        if worker in self._workers:
            for was in self._workers[worker]:
                earlier[was.stream_id] = self._with_carried(was.stats())
                settled[was.stream_id] = self._settled_restarts.get(was.stream_id, 0)
            # requests keep being routed to it while its old streams wind down: their
            # shadows wait for the new streams (before, they were shadowed nowhere: QA)
            await self.remove_worker(worker, returning=True)

        if self.tap is not None:
            # before any subscriber starts (its first state is told at once): every record
            # of the new subscriptions names the endpoint they read, none of the old ones
            for cfg in streams:
                self.tap.follows(stream_id(worker, cfg.dp_rank), cfg.endpoint)

        def sink_for(sid: str, cfg: StreamConfig) -> IndexSink | TappedSink:
            # a loaded snapshot's stream waiting for this worker must be of its shape
            _adopt(self.index, sid, cfg, cfg.block_size)
            return self._sink(self.index, sid)

        subs = self._streams.start(worker, streams, sink_for)
        meanwhile = self._meanwhile.pop(worker, [])
        self._meanwhile_servers.pop(worker, None)
        self._meanwhile_urls.pop(worker, None)
        self._urls[worker] = url
        # the streams of the worker's last registration; a rank it did not have then may have
        # taken any of their requests (the engine picks the rank of one sent with none)
        had = self._left_streams.pop((worker, url), set())
        lefts: dict[str, _Left] = {}  # stream -> its record at this URL
        for key, left in list(self._left.items()):
            if left.worker == worker and (url is None or left.url is None or left.url == url):
                # (one left at another URL stays for the id added there: a swap's other half)
                del self._left[key]
                lefts[key[0]] = left
        mine = [left for s, left in lefts.items() if s in had]
        # the streams other ids left at this URL lately (a rename, two ids swapped): their
        # requests went to the server this worker is now (before, a worker renamed as it
        # restarted on other ports or page size took none: QA)
        moved = [
            left
            for left in self._left.values()
            if url is not None and left.url == url and left.worker != worker
        ]

        def moved_to(rank: int) -> list[_Left]:
            # each id's record of that rank, else (a rank it did not have) all of its records
            # (before, one id's record of the rank hid another's of other ranks: QA)
            taken: list[_Left] = []
            for gone in {left.worker for left in moved}:
                its = [left for left in moved if left.worker == gone]
                taken += [left for left in its if left.dp_rank == rank] or its
            return taken

        plan: list[tuple[ServerStream, str, list[_Left], list[_Left]]] = []
        for sub in subs:
            server, stream, rank = server_stream(sub.config), sub.stream_id, sub.config.dp_rank
            own = lefts.get(stream)
            carrying = ([own] if own else []) if stream in had else list(mine)
            carrying += moved_to(rank)
            plan.append(
                (
                    server,
                    stream,
                    [left for left in carrying if not server.may_be(left.server)],
                    [left for left in carrying if server.may_be(left.server)],
                )
            )
        # copies of other servers' streams' shadows first, then what each stream takes of its
        # own server's stream: a rank copying from a server's stream another rank takes would
        # find it taken (QA: rank 1 of a worker back with two ranks, renamed or not, took none)
        for server, stream, elsewhere, _ in plan:
            if elsewhere:
                self._carry_recent(server, stream, url, elsewhere)
        for server, stream, _, _ in plan:
            self._adopt_shadows(server, stream)
        for server, stream, _, here in plan:
            if here:  # (after: they spare what it took, as its own marks do)
                self._carry_recent(server, stream, url, here)
        self._shadow_meanwhile(worker, self._orphaned_meanwhile(url))
        self._take_waiting(worker, url)
        # in rank order: a query lists a worker's ranks in the order of its streams here
        self._health[worker] = sorted((sub.health for sub in subs), key=lambda h: h.dp_rank)
        for sub in subs:
            self._stream_health[sub.stream_id] = sub.health
            if (before := earlier.get(sub.stream_id)) is not None:
                missed = restarted and before.restarts <= settled[sub.stream_id]
                carried = msgspec.structs.replace(
                    before,
                    restarts=before.restarts + int(missed),
                    clears=before.clears + int(before.entries > 0),
                )
                self._carried[sub.stream_id] = carried
                self._settled_restarts[sub.stream_id] = carried.restarts
        self._matches.invalidate()
        self._shadow_meanwhile(worker, meanwhile)

    def _shadow_meanwhile(self, worker: str, meanwhile: list[_Meanwhile]) -> None:
        """Shadow on `worker`'s new streams the `extra_key` requests sent to it while it was
        registered anew (`shadow`); one of a rank it no longer has on all of them. Past
        `_MEANWHILE_LIMIT` of them, its streams' plain pages are hidden whole (fail closed)."""
        if len(meanwhile) > _MEANWHILE_LIMIT:
            for stream in self.stream_ids(worker):
                self._cover(stream)
            return
        now = self._clock()
        ranks = {sub.config.dp_rank for sub in self._workers.get(worker, [])}
        for namespace, tokens, dp_rank, until in meanwhile:
            rank = dp_rank if dp_rank in ranks else None
            self.shadow(namespace, tokens, worker, rank, max(until - now, 0.0))

    def _orphaned_meanwhile(self, url: str | None) -> list[_Meanwhile]:
        """The `extra_key` requests sent to `url` while the worker there was not followed,
        and was removed since (`_park_meanwhile`), within `RESTART_DOUBT_S`."""
        if url is None or url not in self._orphaned:
            return []
        at, items = self._orphaned.pop(url)
        return items if at >= self._clock() - RESTART_DOUBT_S else []

    def shadow_at(
        self,
        url: str,
        namespace: Namespace,
        tokens: Sequence[Hashable],
        dp_rank: int | None,
        keep_s: float,
    ) -> None:
        """Another replica sent a request with an `extra_key` (in `namespace`) to the server
        at `url` (`WorkerEntry.server`), which no worker followed here is: its registration is
        under way (an id added, renamed, deleted and added again, there or by a reload here),
        or has not begun. Kept for the worker added there next, within `RESTART_DOUBT_S`
        (`indexer.waiting_shadows`). Before, the shadow was dropped, and once the worker was
        followed here a plain request was predicted the request's pages (QA: 288 tokens
        predicted, 0 cached)."""
        if namespace.extra_key is None or keep_s <= 0:
            return
        now = self._clock()
        try:
            head: Sequence[Hashable] = array(
                "q", cast(Sequence[int], tokens[:_UNSIZED_HEAD])
            )  # 8 bytes a token
        except (TypeError, OverflowError):
            head = tuple(tokens[:_UNSIZED_HEAD])  # not plain token ids
        shadow = Waiting(namespace, head, dp_rank, now + keep_s)
        self._waiting.keep(url, shadow, now, now - RESTART_DOUBT_S)

    def _take_waiting(self, worker: str, url: str | None) -> None:
        """`worker` was added at `url`: it shadows what other replicas sent there while no
        worker was followed at it (`shadow_at`); its streams are hidden whole if some of that
        had to be forgotten (fail closed)."""
        if url is None:
            return
        taken, forgot = self._waiting.take(url, self._clock() - RESTART_DOUBT_S)
        self._shadow_meanwhile(worker, [*taken])
        if forgot is not None:
            # until the forgotten ones would have lapsed: before, for good, until a new process
            # was found on it (QA: 4,600 shadows while a replica could not register the worker)
            for stream in self.stream_ids(worker):
                self._cover(stream, until=forgot)

    def may_shadow(self, worker: str) -> bool:
        """Whether an `extra_key` request sent to `worker` is shadowed (`shadow`): it is
        subscribed, or being registered anew (O(1))."""
        return worker in self._workers or worker in self._meanwhile

    def settled(self, worker: str) -> None:
        """`worker`'s settings were read again and are the ones its streams were registered
        with: the restarts its streams counted so far were of processes like it (a later
        re-registration as another process counts its own restart, `add_worker`)."""
        for sub in self._workers.get(worker, []):
            self._settled_restarts[sub.stream_id] = self._with_carried(sub.stats()).restarts

    async def remove_worker(self, worker: str, *, returning: bool = False) -> None:
        """Stop a worker's subscriptions and drop its index entries. Its streams' shadows are
        kept for the server's streams (`_park_shadows`).

        `returning`: it is to be followed again (`add_worker`) while requests are still sent
        to it (registered anew; put aside by the false-hit watch): the `extra_key` requests
        sent meanwhile are shadowed on its streams then (before, nowhere: QA, a plain request
        predicted their pages, 288 tokens, 0 cached). Removed for good instead, it leaves them
        for the server's streams it followed, as its shadows are."""
        self._health.pop(worker, None)
        self._matches.invalidate()
        url = self._urls.pop(worker, None)
        if returning:
            self._meanwhile.setdefault(worker, [])
            self._meanwhile_urls.setdefault(worker, url)
        subs = await self._streams.stop(worker)
        if subs:
            self._left_streams[worker, url] = {sub.stream_id for sub in subs}
            if returning:
                self._meanwhile_servers[worker] = [
                    (sub.config.dp_rank, server_stream(sub.config)) for sub in subs
                ]
        for sub in subs:
            recent = self._recent_marks.get(sub.stream_id)
            if recent is not None and recent.newest is not None:
                horizon = self._clock() - RESTART_DOUBT_S
                # (those of ids not registered again go once their marks are past doubt)
                self._left = {k: v for k, v in self._left.items() if v.recent.since(horizon)}
                size = self.index.block_size(sub.stream_id)
                server = server_stream(sub.config)
                left = _Left(worker, sub.config.dp_rank, server, recent, url, size)
                self._left[sub.stream_id, url] = left
            self._park_shadows(sub.stream_id, server_stream(sub.config))
            self._blanket_at.pop(sub.stream_id, None)
            self._blanket_until.pop(sub.stream_id, None)
            self._judged_from.pop(sub.stream_id, None)
            self.index.drop_stream(sub.stream_id)
            self._applied_seq.pop(sub.stream_id, None)
            self._stream_health.pop(sub.stream_id, None)
            # its series go with it (a worker added again under its id starts them at 0)
            self._carried.pop(sub.stream_id, None)
            self._settled_restarts.pop(sub.stream_id, None)
            if self.tap is not None:
                # what follows the relay drops it too: the worker's removals while it is not
                # subscribed (or until it is again) would never reach the followers
                self.tap.cleared(sub.stream_id)
                self.tap.seq_forgotten(sub.stream_id)
        if not returning:
            self._park_meanwhile(worker)

    def _park_meanwhile(self, worker: str) -> None:
        """`worker`, not followed since it was put aside, is removed: the `extra_key` requests
        sent to it meanwhile are kept for the server's streams it followed, as shadows not
        keyed yet (`_adopt_shadows` keys them on a stream added there)."""
        meanwhile = self._meanwhile.pop(worker, [])
        servers = self._meanwhile_servers.pop(worker, [])
        url = self._meanwhile_urls.pop(worker, None)
        if meanwhile and url is not None:
            # and for the URL they were sent to: a server that moved to other event ports
            # meanwhile is followed there by whatever id is added at it (QA: none took them)
            now = self._clock()
            self._orphaned = {
                u: v for u, v in self._orphaned.items() if v[0] >= now - RESTART_DOUBT_S
            }
            self._orphaned.setdefault(url, (now, []))[1].extend(meanwhile)
        ranks = {rank for rank, _ in servers}
        for rank, server in servers:
            if len(meanwhile) > _MEANWHILE_LIMIT:
                self._cover_parked(server)
                continue
            parked = self._parked_unsized.setdefault(server, [])
            for namespace, head, dp_rank, until in meanwhile:
                if dp_rank in (None, rank) or dp_rank not in ranks:
                    plain = msgspec.structs.replace(namespace, extra_key=None)
                    parked.append(("", plain, head, cast(str, namespace.extra_key), until))

    def suspect_restart(self, worker: str, why: str, *, down_age_s: float | None = None) -> None:
        """A sign the worker may have restarted (its health came back): prove its streams.

        Until the replay proves each stream's last batch unchanged (`indexer.fence`), the
        stream is UNVERIFIED and its entries predict no hit; an unproven stream is rebuilt.
        `down_age_s`: how long ago a health check last found it down (a fed stream the relay
        made anew since needs no proof: `FedStream.suspect_restart`).
        """
        if self.fed is not None:
            down_at = None if down_age_s is None else self._clock() - down_age_s
            for fed in self.fed.by_worker.get(worker, []):
                fed.suspect_restart(why, down_at=down_at)
        else:
            for sub in self._workers.get(worker, []):
                sub.suspect_restart(why)
        self._matches.invalidate()

    def _park_shadows(self, stream: str, server: ServerStream) -> None:
        """`stream` is no longer followed: its shadows (`indexer.shadowed`) are kept for the
        server's stream it followed, which another worker id may follow next and replay the
        server's history into: the pages an `extra_key` request stored there come back as
        plain ones (before, the shadows stayed with the stream id, and a rename, an id swap or
        an admin delete and add predicted plain requests those pages)."""
        now = self._clock()
        self._adopted.pop(stream, None)
        self._recent_marks.pop(stream, None)
        fence = self.index.fence(stream) if self.index.has_stream(stream) else None
        self._shadowed.park(stream, server, now)
        unsized = [item for item in self._unsized_shadows if item[0] == stream]
        if unsized:
            self._unsized_shadows = [i for i in self._unsized_shadows if i[0] != stream]
            kept = [i for i in self._parked_unsized.get(server, []) if i[4] >= now]
            self._parked_unsized[server] = kept + unsized
        if stream in self._blanket:
            # for the worker added there next, for as long as it had left (QA: a second rename
            # within the hour hid the next worker for good)
            self._blanket.discard(stream)
            self._cover_parked(
                server, self._blanket_at.pop(stream, None), self._blanket_until.pop(stream, None)
            )
        parked = set(cast("list[ServerStream]", self._shadowed.parked()))
        parked |= self._parked_unsized.keys() | self._parked_blanket
        if server in parked:
            self._park_fences(server, [fence])
        # the fences of servers' streams whose shadows lapsed since
        self._parked_fences = {s: f for s, f in self._parked_fences.items() if s in parked}

    def _carry_recent(
        self, server: ServerStream, stream: str, url: str | None, lefts: Sequence[_Left]
    ) -> None:
        """`stream` is registered again (its worker's settings changed, or an admin deleted
        and added it): the shadows marked on it within `RESTART_DOUBT_S` go on standing there,
        whatever the judgment of the process it follows now (`_judge_adoption`). Their
        requests were sent to the worker's URL while the router still followed the stream it
        had, and may have reached the process this one follows: a worker restarted on other
        KV-event ports between two health checks served them, and its replay brought their
        pages as plain ones (QA: plain requests predicted 288-304 tokens, 0 cached; so did a
        Service's URL moved to another pod). When the server's stream is another one, it takes
        a copy of the old one's shadows (`adopt(take=False)`: the old server may come back),
        judged by the old stream's fences like a renamed worker's. An id added again at another
        URL (a swap of two workers' ids, an id moved to another server) is another worker: its
        requests went to the old URL, whose server keeps their shadows, and carried here they
        hid the new server's own plain pages (QA: 8 of 16 plain candidates, for 90 s and more).

        `lefts`: the stream's own record when it had one, else (a rank the worker did not
        have) those of every stream the worker had: the engine may have placed a request sent
        to any of them on this rank (QA: a worker restarted with two ranks in place of one
        took an `extra_key` request on its new rank, and a plain request was predicted its
        pages there, 288 tokens, 0 cached).

        A worker restarted with another page size stored those requests' pages in blocks the
        shadows' keys never match: their prompt heads are shadowed again in the new size
        (`_shadow_heads_again`)."""
        lefts = [left for left in lefts if url is None or left.url is None or left.url == url]
        if not lefts:
            return
        now = self._clock()
        horizon = now - RESTART_DOUBT_S
        size = self.index.block_size(stream)
        recent = self._new_recent()  # (a copy: new ranks take the same records)
        if (carried_before := self._recent_marks.get(stream)) is not None:
            recent.absorb(carried_before)
        for left in lefts:
            recent.absorb(left.recent)
        carried = [
            (left.server, left.recent.keys_since(horizon), left.recent.forgot_keys_since(horizon))
            for left in lefts
        ]
        # (a size not known yet may turn out the old one: the heads hide more than needed)
        resized = any(left.block_size is None or left.block_size != size for left in lefts)
        if not any(keys or doubtful for _, keys, doubtful in carried) and not (
            resized and recent.since(horizon)
        ):
            return
        self._recent_marks[stream] = recent  # `_judge_own_shadows` spares them too
        for old, keys, doubtful in carried:
            # a copy of another server's stream's shadows, judged by its fences; one that
            # marked more lately than it keeps is not: none can be told old (fail closed)
            if (
                (keys or doubtful)
                and not server.may_be(old)
                and self._shadowed.adopt(old, stream, now, take=False)
                and not doubtful
            ):
                fences = list(self._parked_fences.get(old, []))
                self._adopt_loaded(stream, fences, [], sorted(keys))
        if stream in self._adopted:
            # (taken before, by `_adopt_shadows`, it was watched with none of its own)
            if any(doubtful for _, _, doubtful in carried):
                self._shadowed.settle(stream)
            else:
                # (every key carried here so far: a stream carried twice keeps the first's)
                self._shadowed.watch(stream, recent.keys_since(horizon))
        if resized:
            # after the judgment is set up: the keys it makes are the stream's own marks
            self._shadow_heads_again(stream, recent, horizon)

    def _shadow_heads_again(self, stream: str, recent: RecentMarks, horizon: float) -> None:
        """Shadow on `stream` the heads of the prompts shadowed on it since `horizon`, in its
        block size (once it is known): a namespace whose heads were forgotten is shadowed
        from its seed, and a stream that forgot namespaces too is hidden whole (fail closed).
        The head's last block is its tail, as another replica's shadow's is."""
        if recent.forgot_heads_since(horizon):
            self._cover(stream)
            log.info(
                "stream %s: more extra_key requests were sent here lately than it keeps a "
                "record of, and its block size changed: its plain pages predict no hit",
                stream,
            )
            return
        for plain, extra_key, head, until in list(recent.heads_since(horizon)):
            self._shadow_on(stream, plain, head, extra_key, until, _SHADOW_BLOCKS)

    def _doubt_from(self, stream: str) -> None:
        """`stream`'s next judgment (`_judge_adoption`) lifts a blanket set before now less
        `RESTART_DOUBT_S` only: one set since may be of requests the new process served (the
        earliest such time asked, where asked twice)."""
        horizon = self._clock() - RESTART_DOUBT_S
        self._judged_from[stream] = min(horizon, self._judged_from.get(stream, horizon))

    def _cover(self, stream: str, at: float | None = None, until: float | None = None) -> None:
        """Hide every plain entry of `stream` (`_blanket`), as of `at` (None: now), until
        `until` (None: until a new process is found on it, `_judge_adoption`; a stream hidden
        so stays so)."""
        at = self._clock() if at is None else at
        lapses = _hidden_until(self._blanket_until, stream, stream in self._blanket, until)
        if lapses is not None:
            self._next_lapse = min(self._next_lapse, lapses)
        self._blanket.add(stream)
        self._blanket_at[stream] = max(at, self._blanket_at.get(stream, at))

    def _lapse(self) -> None:
        """Lift the blankets whose time is up (`_cover(until=...)`)."""
        now = self._clock()
        if now < self._next_lapse:
            return
        timed = self._blanket_until
        for stream, until in list(timed.items()):
            if until <= now:
                del timed[stream]
                self._blanket.discard(stream)
                self._blanket_at.pop(stream, None)
                log.info(
                    "stream %s: its plain pages predict hits again: the extra_key shadows it "
                    "was hidden for would have lapsed by now",
                    stream,
                )
        self._next_lapse = min(timed.values(), default=math.inf)

    def _cover_parked(
        self, server: ServerStream, at: float | None = None, until: float | None = None
    ) -> None:
        """`_cover` for the stream added on `server`'s stream next (`_adopt_shadows`)."""
        at = self._clock() if at is None else at
        hidden = server in self._parked_blanket
        _hidden_until(self._parked_blanket_until, server, hidden, until)
        self._parked_blanket.add(server)
        self._parked_blanket_at[server] = max(at, self._parked_blanket_at.get(server, at))

    def _park_fences(self, server: ServerStream, fences: Sequence[BatchFence | None]) -> None:
        """Keep `fences` for the shadows parked for `server` (`_add_fences`)."""
        _add_fences(self._parked_fences.setdefault(server, []), fences)

    def _adopt_shadows(self, server: ServerStream, stream: str) -> None:
        """`stream` follows `server`'s stream: it takes the shadows left there
        (`_park_shadows`), and a copy of those left on every stream it may be (the same port,
        topic and rank on a host it may be: `indexer.server_stream`). Before, the endpoint was
        compared as spelled: a worker renamed from `127.0.0.1` to `localhost` (or whose engine
        advertised the other spelling) took none, and its replay's pages were trusted as plain
        ones (a false hit). Until its publisher's seq shows it is the process they were made
        on, or a new one (`_judge_adoption`), the shadows it took are told apart."""
        now = self._clock()
        mine = list(self._shadowed.shadows(stream) or ())  # (a stream just added has none)
        # the shadows are parked by `ServerStream` alone (`_park_shadows`)
        candidates = set(cast("list[ServerStream]", self._shadowed.parked()))
        candidates |= self._parked_unsized.keys()
        candidates |= self._parked_blanket
        fences: list[BatchFence | None] = []
        unsized: list[_Unsized] = []
        for parked in candidates:
            if not server.may_be(parked):
                continue
            take = server.same(parked)
            self._shadowed.adopt(parked, stream, now, take=take)
            items = (
                self._parked_unsized.pop(parked, [])
                if take
                else self._parked_unsized.get(parked, [])
            )
            for _, plain, head, extra_key, until in items:
                unsized.append((stream, plain, head, extra_key, until))
            if parked in self._parked_blanket:
                at = self._parked_blanket_at.get(parked)
                lapses = self._parked_blanket_until.get(parked)
                if take:
                    self._parked_blanket.discard(parked)
                    self._parked_blanket_at.pop(parked, None)
                    self._parked_blanket_until.pop(parked, None)
                self._cover(stream, at, lapses)
                self._doubt_from(stream)
            fences += (
                self._parked_fences.pop(parked, []) if take else self._parked_fences.get(parked, [])
            )
        self._unsized_shadows += unsized
        if fences:
            self._adopt_loaded(stream, fences, unsized, mine)

    def _adopt_loaded(
        self,
        stream: str,
        fences: list[BatchFence | None],
        unsized: list[_Unsized],
        mine: Sequence[int],
    ) -> None:
        """`stream` took shadows made on the process(es) of `fences`: until its publisher
        shows whether it is one of them (`_judge_adoption`), they are told apart from `mine`
        (its own). A stream that took some before and is not judged yet adds these to those
        (before, the later ones replaced the earlier fences)."""
        adopted = self._adopted.get(stream)
        if adopted is None:
            self._adopted[stream] = (fences, unsized)
            self._shadowed.watch(stream, mine)
            return
        _add_fences(adopted[0], fences)
        adopted[1].extend(unsized)

    def _settled_at(self, stream: str) -> bool:
        """Whether a batch `stream` applied now is its publisher's present (the stream
        `synced`), which `_judge_adoption` may judge by. A batch applied while it syncs,
        rebuilds or is unproven may be its past read back: a replay buffer's oldest, or a new
        relay process's catch-up of the worker's buffer from seq 0 (QA: a relay restart took
        the worker, which had not restarted, for a new process, and the shadows a replica had
        loaded from the cluster's snapshot were dropped: 320 tokens predicted, 0 cached). Until
        a batch comes synced, the shadows it took stay (fail closed)."""
        health = self._stream_health.get(stream)
        return health is not None and health.state is StreamState.SYNCED

    def _judge_adoption(self, stream: str, seq: int) -> None:
        """`stream`'s first batch applied since it took parked shadows (`_adopt_shadows`): a
        publisher whose seq `seq` is behind the last one applied on every stream they were
        parked from (or at it, with another batch there) is another process, whose cache
        holds none of what they covered: they go (before, a server started on a removed
        worker's events port kept them, and its own plain pages were predicted nothing for
        an hour). Anything else may be the same process: they stay (fail closed).

        A relay follower's (`self.fed`) batch behind a fence proves nothing: a new relay
        process's records read the worker's buffer back from its oldest batch, seq 0 for a
        worker that never restarted (QA: the shadows a replica loaded from the cluster's
        snapshot were dropped at a relay restart: 320 tokens predicted, 0 cached). There the
        batch at the fence's seq tells, by its digest; the judgment waits for it, the shadows
        kept meanwhile, and one past it unseen may be the same process."""
        fences, unsized = self._adopted[stream]
        mine = self.index.fence(stream) if self.index.has_stream(stream) else None
        relayed = self.fed is not None

        def other(fence: BatchFence | None) -> bool | None:
            """Whether the publisher is another process than `fence`'s (None: not known yet)."""
            if fence is None:
                return False  # nothing to tell it by
            if seq != fence.seq:
                if seq > fence.seq or not relayed:
                    return seq < fence.seq
                return None
            return mine is not None and mine.seq == seq and mine.digest() != fence.digest()

        verdicts = [other(fence) for fence in fences]
        if False in verdicts:
            del self._adopted[stream]
            self._judged_from.pop(stream, None)
            self._shadowed.settle(stream)
            return
        if None in verdicts:
            return  # (a relay's past read back: the next batches tell)
        del self._adopted[stream]
        dropped = self._shadowed.disown(stream)
        if unsized:
            gone = {id(item) for item in unsized}
            self._unsized_shadows = [i for i in self._unsized_shadows if id(i) not in gone]
        covered = self._blanket_at.get(stream)
        doubted = self._judged_from.pop(stream, None)
        if covered is not None and doubted is not None and covered < doubted:
            # hidden whole for copies of the process that ended (before, for good: QA)
            self._blanket.discard(stream)
            del self._blanket_at[stream]
            self._blanket_until.pop(stream, None)
            log.info(
                "stream %s: its plain pages predict hits again: the process whose extra_key "
                "copies could not all be told apart has ended",
                stream,
            )
        log.info(
            "stream %s: its publisher is a new process (seq %d, behind the last batch of "
            "the %s they were made on): the %d extra_key shadows made before it are dropped",
            stream,
            seq,
            "process" if len(fences) == 1 else f"{len(fences)} processes",
            dropped + len(unsized),
        )

    def workers(self) -> list[str]:
        """Names of the subscribed workers."""
        return list(self._workers)

    def has_worker(self, worker: str) -> bool:
        """Whether `worker` is subscribed (O(1): the router asks on every request)."""
        return worker in self._workers

    def block_size(self, worker: str) -> int | None:
        """Tokens per block of `worker`'s first stream, once configured or learned (O(1))."""
        subs = self._workers.get(worker)
        return subs[0].sink.block_size() if subs else None

    def worker_count(self) -> int:
        """How many workers are subscribed."""
        return len(self._workers)

    # -------------------------------------------------------------- queries

    def query(
        self, namespace: Namespace, tokens: Sequence[Hashable], limit: int | None = None
    ) -> dict[str, WorkerMatch]:
        """For EVERY known worker, the leading blocks of `tokens` it holds in `namespace`.

        Each answer is the worker's best rank, with every rank apart in `ranks` (rank order).
        Only the first `limit` tokens count (None: all). The per-worker part costs a dict copy
        plus one object per worker that matched something: states and "holds nothing" answers
        are cached (`indexer.worker_matches`).
        """
        if self._watch is not None:
            self._watch.check()  # (a stall not told yet: before anything is answered)
        found = self.index.match(namespace, tokens, limit)
        if self._blanket_until:
            self._lapse()
        if (self._shadowed or self._blanket) and namespace.extra_key is None and found.blocks:
            self._hide_shadowed(found, namespace, tokens)
        return self._matches.answer(self._health, found, self.index.default_medium)

    def _stalled(self, seconds: float) -> None:
        """The event loop did not run for `seconds` (`indexer.loop_watch`): a worker may have
        restarted meanwhile, its dropped connection or new batches still queued unread. Every
        stream with a replay socket is suspected (UNVERIFIED) and proven through it at once,
        as after a dropped connection: a round trip for a worker that did not restart. Streams
        without one are left as they are: a suspicion clears those, and an idle worker's
        would start cold after every stall. Before, the first requests after the process was
        resumed were routed on a restarted worker's dead cache (QA: 288 tokens, 0 cached)."""
        why = (
            f"this process's event loop did not run for {seconds:.1f} s (stopped, or blocked): "
            "what its sockets queued meanwhile is not read yet"
        )
        log.warning("%s: every stream with a replay socket is proven again", why)
        for sub in self._subs.all():
            if sub.proves_restarts:
                sub.suspect_restart(why)

    def _hide_shadowed(
        self, found: PrefixMatch, namespace: Namespace, tokens: Sequence[Hashable]
    ) -> None:
        """Cut each stream's match to the blocks the plain tree surely holds there: an entry
        may be an `extra_key`'s copy (`indexer.shadowed`). The common stream (no shadow on its
        first block or its seed) costs one block key and two lookups."""
        index = self.index
        for stream, held in list(found.blocks.items()):
            shadows = self._shadowed.shadows(stream)
            trusted = 0
            if stream not in self._blanket:
                if not shadows:
                    continue
                made = index.chain_keys(stream, namespace, tokens, 1)
                if made is None or not made[1]:
                    continue
                seed, (first,) = made
                if seed not in shadows and (not first or first[0] not in shadows):
                    continue  # no extra_key copy can be on this prompt's chain there
                made = index.chain_keys(stream, namespace, tokens, held)
                assert made is not None
                keys = made[1][0][:held]
                trusted = trusted_blocks(shadows, seed, keys, index.extra_copies(stream))
                if trusted == held:
                    continue
            found.pending_blocks.pop(stream, None)
            if trusted:
                index.cut(found, stream, trusted)
            else:
                del found.blocks[stream]
                found.by_medium.pop(stream, None)

    def shadow(
        self,
        namespace: Namespace,
        tokens: Sequence[Hashable],
        worker: str,
        dp_rank: int | None,
        keep_s: float,
    ) -> list[ShadowMark]:
        """A request with an `extra_key` (in `namespace`) was sent to `worker` (rank
        `dp_rank`; None: every rank): the pages it stores will be shown by events as plain
        ones, so plain queries stop trusting its blocks there that may be its copies, for at
        least `keep_s`, and for as long as the stream holds them after that
        (`indexer.shadowed`). `tokens` may be the prompt's head only (another replica's
        shadow): what follows it counts as the extra_key's. Returns the shadows made, for
        `unshadow` should the request store nothing."""
        made: list[ShadowMark] = []
        extra_key = namespace.extra_key
        if extra_key is None:
            return made
        plain = msgspec.structs.replace(namespace, extra_key=None)
        now = self._clock()
        until = now + keep_s
        meanwhile = self._meanwhile.get(worker)
        if meanwhile is not None and worker not in self._workers:
            if len(meanwhile) <= _MEANWHILE_LIMIT:  # (one more: the bound was passed)
                meanwhile.append((namespace, tokens[:_UNSIZED_HEAD], dp_rank, until))
            return made
        blocks = 1 if len(self._shadowed) >= _SHADOW_LIMIT else _SHADOW_BLOCKS
        for stream in self.stream_ids(worker, dp_rank):
            # kept a while, to shadow it again should the worker restart with another page
            # size (`_carry_recent`)
            self._recent(stream).remember_head(
                now, plain, tokens, extra_key, until, now - RESTART_DOUBT_S
            )
            made.extend(self._shadow_on(stream, plain, tokens, extra_key, until, blocks))
        if self._shadowed.due():
            self._shadowed.sweep(self._clock(), self._holds_shadowed)
            self._seeds = {s: ns for s, ns in self._seeds.items() if self._has_seed(s)}
        return made

    def _shadow_on(
        self,
        stream: str,
        plain: Namespace,
        tokens: Sequence[Hashable],
        extra_key: str,
        until: float,
        blocks: int,
    ) -> list[ShadowMark]:
        """Shadow a prompt's first `blocks` blocks on `stream`; one whose block size is not
        known yet is kept as its head, keyed by its first events (`_on_applied`), and never
        withdrawn (fail closed)."""
        chains = self.index.chain_keys(stream, plain, tokens, blocks)
        if chains is not None:
            return self._mark(stream, plain, chains, extra_key, until)
        if self.index.has_stream(stream):
            self._shadow_unsized(stream, plain, tokens, extra_key, until)
        return []

    def _mark(
        self,
        stream: str,
        plain: Namespace,
        chains: tuple[int, list[list[int]]],
        extra_key: str,
        until: float,
    ) -> list[ShadowMark]:
        """Shadow a prompt's chains of block keys on `stream` (its seed the tail of a prompt
        with no full block)."""
        seed, keys = chains
        self._remember_marks(stream, seed, keys)
        marks = [
            self._shadowed.mark(stream, chain, chain[-1], extra_key, until)
            for chain in keys
            if chain
        ]
        if not all(keys):
            self._seeds[seed] = plain
            marks.append(self._shadowed.mark(stream, (), seed, extra_key, until))
        return marks

    def _remember_marks(self, stream: str, seed: int, chains: list[list[int]]) -> None:
        """Keep what `_mark` shadows on `stream` for `RESTART_DOUBT_S` (`_judge_own_shadows`)."""
        now = self._clock()
        marked = [seed, *(key for chain in chains for key in chain)]
        self._recent(stream).remember_keys(now, marked, now - RESTART_DOUBT_S)

    def _recent(self, stream: str) -> RecentMarks:
        recent = self._recent_marks.get(stream)
        if recent is None:
            recent = self._recent_marks[stream] = self._new_recent()
        return recent

    @staticmethod
    def _new_recent() -> RecentMarks:
        return RecentMarks(
            most_keys=_RECENT_MARK_KEYS,
            most_heads=_RECENT_HEADS,
            most_namespaces=_RECENT_NAMESPACES,
            head_tokens=_UNSIZED_HEAD,
        )

    def _has_seed(self, seed: int) -> bool:
        # a parked stream's seed too: the stream that adopts its shadows needs its namespace
        return self._shadowed.has_key(seed)

    def _holds_shadowed(self, stream: str, keys: Sequence[int]) -> list[bool]:
        """For the sweep: whether `stream` still holds each shadowed key (a seed: a page of
        its namespace), so a copy stored for an extra_key may still be there."""
        held = self.index.holds(stream, keys)
        seeds = self._seeds
        if seeds:
            for i, key in enumerate(keys):
                ns = seeds.get(key)
                if ns is not None:
                    held[i] = self.index.holds_namespace(stream, ns)
        return held

    def unshadow(self, marks: Sequence[ShadowMark]) -> None:
        """The request of these shadows (`shadow`'s) stored nothing (the worker refused it, or
        it never reached the worker): they are taken back, unless a later shadow of the same
        prefix there extended them."""
        for mark in marks:
            self._shadowed.withdraw(mark)

    def _shadow_unsized(
        self,
        stream: str,
        plain: Namespace,
        tokens: Sequence[Hashable],
        extra_key: str,
        until: float,
    ) -> None:
        """Keep a prompt's head until `stream`'s block size is known (`_size_shadows`), within
        bounds: beyond `_UNSIZED_LIMIT` of them, the stream's plain entries are all hidden
        (`_blanket`: fail closed) rather than memory growing with every request. The head's
        last block is its tail: what follows counts as the extra_key's."""
        if stream in self._blanket:
            # not kept: the blanket stands for it, from now on (`_judge_adoption` lifts it
            # only for a new process found `RESTART_DOUBT_S` after its last such request)
            self._cover(stream)
            return
        waiting = self._unsized_shadows
        if len(waiting) >= _UNSIZED_LIMIT:
            # a stream that published nothing since: nothing was stored for those
            now = self._clock()
            waiting = self._unsized_shadows = [i for i in waiting if i[4] >= now]
        try:
            head: Sequence[Hashable] | None = array(
                "q", cast(Sequence[int], tokens[:_UNSIZED_HEAD])
            )  # 8 bytes a token
        except (TypeError, OverflowError):
            head = None  # not plain token ids: nothing to key them by later
        if head is None or len(waiting) >= _UNSIZED_LIMIT:
            self._cover(stream)
            return
        waiting.append((stream, plain, head, extra_key, until))

    def _size_shadows(self, stream: str) -> None:
        """Make the keys of the shadows sent to `stream` before its block size was known."""
        index = self.index
        if index.block_size(stream) is None:
            return
        waiting = []
        for item in self._unsized_shadows:
            if item[0] != stream:
                waiting.append(item)
                continue
            _, plain, head, extra_key, until = item
            chains = index.chain_keys(stream, plain, head, _SHADOW_BLOCKS)
            if chains is not None:
                self._mark(stream, plain, chains, extra_key, until)
        self._unsized_shadows = waiting

    def add_pending(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        worker: str,
        dp_rank: int | None = None,
        *,
        keys_of: Callable[[str], Sequence[int]] | None = None,
        age_s: float = 0.0,
    ) -> list[PendingMark]:
        """Mark a just-routed request's prefix as pending on `worker` for pending_ttl_s (less
        `age_s`: another replica routed it that long ago, and NATS may have held it up; one
        the TTL old marks nothing); returns the marks made, for `withdraw_pending` should
        the request fail.

        With `dp_rank`, only that rank's stream is marked: the request was sent there, and its
        other ranks are other caches. None (the engine picks the rank): every stream of it.
        `keys_of(stream)` may give the prompt's block keys there (`block_keys`), when the
        caller has made them already; empty: the index makes them.
        """
        made: list[PendingMark] = []
        index = self.index
        for sub in self._workers.get(worker, []):
            if dp_rank is None or sub.config.dp_rank == dp_rank:
                keys = keys_of(sub.stream_id) if keys_of is not None else None
                if index.add_pending(sub.stream_id, namespace, tokens, keys or None, age_s=age_s):
                    made.append((sub.stream_id, index.pending.generation))
        return made

    def expect_peer_marks(self) -> None:
        """Other replicas' decisions will mark pending here (`add_pending` with `age_s`): the
        index keeps the keys of its removals from now on to judge them (`log_removals`),
        a loaded one too, so the first of them is judged like the rest."""
        self._peer_marks = True
        self.index.log_removals()

    def withdraw_pending(self, marks: Sequence[PendingMark]) -> None:
        """The request of these marks (`add_pending`'s) failed: the worker stores nothing for
        it, so its prefix is no longer on its way there (a sibling's marks stand)."""
        for stream, generation in marks:
            self.index.withdraw_pending(stream, generation)

    def sharing(self, worker: str, endpoint: str, topic: str) -> str | None:
        """Another worker subscribed to `endpoint` with a topic that overlaps `topic` (either a
        prefix of the other: a SUB matches by prefix, so one of them would take the other's
        batches as its own), or None."""
        for other, subs in self._workers.items():
            if other == worker:
                continue
            for sub in subs:
                theirs = sub.config.topic
                if sub.config.endpoint == endpoint and (
                    theirs.startswith(topic) or topic.startswith(theirs)
                ):
                    return other
        return None

    def stream_ids(self, worker: str, dp_rank: int | None = None) -> list[str]:
        """The index's stream ids of `worker`: the rank's one, or every rank's for None."""
        return [
            sub.stream_id
            for sub in self._workers.get(worker, [])
            if dp_rank is None or sub.config.dp_rank == dp_rank
        ]

    def dp_size(self, worker: str) -> int:
        """How many DP ranks `worker` publishes from (its highest rank + 1; 0: none known)."""
        subs = self._workers.get(worker)
        return 1 + max(sub.config.dp_rank for sub in subs) if subs else 0

    def held_tokens(self, stream: str, *, every_tier: bool = False) -> int:
        """Tokens `stream` holds on the GPU per its events (blocks times block size; 0:
        unknown); with `every_tier`, in any tier (offloaded blocks too)."""
        index = self.index
        if not index.has_stream(stream):
            return 0
        blocks = index.entries(stream) if every_tier else index.default_medium_entries(stream)
        return blocks * (index.block_size(stream) or 0)

    def block_keys(
        self,
        stream: str,
        namespace: Namespace,
        tokens: Sequence[Hashable],
        limit: int | None = None,
    ) -> list[int]:
        """The index's keys of the full blocks of `tokens` on `stream` (`PrefixIndex`)."""
        return self.index.block_keys(stream, namespace, tokens, limit)

    def holder_counts(self, keys: Sequence[int]) -> list[int]:
        """For each key, how many streams (worker ranks) hold it per their events."""
        return self.index.holder_counts(keys)

    def holds(self, stream: str, keys: Sequence[int]) -> list[bool]:
        """For each key, whether `stream` holds it per its events."""
        return self.index.holds(stream, keys)

    def shadow_hidden(
        self, namespace: Namespace, tokens: Sequence[Hashable], limit: int | None = None
    ) -> dict[str, int]:
        """The streams whose entries for `tokens` (a plain prompt) `query` cuts or hides
        because an `extra_key` request's shadow covers them there (`indexer.shadowed`), each
        with how many tokens of the prompt (held or pending) its answer leaves out. For
        explaining a decision (`/admin/route`), not for routing: it matches the prompt again.
        Whatever `query` hides by, this says."""
        if not (self._shadowed or self._blanket) or namespace.extra_key is not None:
            return {}
        found = self.index.match(namespace, tokens, limit)
        before = {s: n + found.pending_blocks.get(s, 0) for s, n in found.blocks.items()}
        if before:
            self._hide_shadowed(found, namespace, tokens)
        hidden: dict[str, int] = {}
        for stream, blocks in before.items():
            left = found.blocks.get(stream, 0) + found.pending_blocks.get(stream, 0)
            if left < blocks:
                hidden[stream] = (blocks - left) * (self.index.block_size(stream) or 0)
        return hidden

    def streams(self) -> list[StreamStats]:
        """State and counters of every stream (each counter over every registration of its
        worker since it was added: `add_worker`)."""
        return [self._with_carried(sub.stats()) for subs in self._workers.values() for sub in subs]

    def _with_carried(self, stats: StreamStats) -> StreamStats:
        return carried_over(stats, self._carried.get(stats.stream))

    def stale_streams(self, worker: str) -> int:
        """How many of `worker`'s streams are STALE now: nothing heard from them (no batch
        applied, no replay answered) for `stale_after_s`."""
        now = self._clock()
        health = self._health.get(worker, [])
        return sum(h.current_state(now) is StreamState.STALE for h in health)

    def stream_configs(self, worker: str) -> list[StreamConfig]:
        """The configs `worker`'s streams were subscribed with, in the order given."""
        return [sub.config for sub in self._workers.get(worker, [])]

    def health_of(self, stream: str) -> StreamHealth | None:
        """The state and times of one stream (None: not subscribed)."""
        return self._stream_health.get(stream)

    def stream_heads(self) -> list[StreamHead]:
        """Where each subscribed stream stands (a relay's heartbeats: `indexer.stream_tap`)."""
        now = self._clock()
        # a stream not heard from for longer than its probes would take is not known to be
        # as it stands: a relay whose loop stalled (stopped, swapped out) must not say so
        # until it has taken what queued meanwhile (its followers trust a fresh heartbeat)
        cfg = self.config
        probed = 2 * cfg.probe_interval_s + cfg.replay_timeout_s
        bound = min(cfg.stale_after_s, probed) if cfg.probe_interval_s > 0 else cfg.stale_after_s
        heads = []
        for subs in self._workers.values():
            for sub in subs:
                fence = sub.sink.fence()
                carried = self._carried.get(sub.stream_id)
                heard_age = now - sub.health.heard_at()
                state = sub.health.current_state(now)
                heads.append(
                    StreamHead(
                        sub.stream_id,
                        StreamState.STALE if heard_age > bound else state,
                        heard_age,
                        None if fence is None else fence.seq,
                        b"" if fence is None else fence.digest(),
                        sub.verifications + sub.restarts,
                        sub.restarts + (0 if carried is None else carried.restarts),
                    )
                )
        return heads

    def namespaces(self) -> list[NamespaceStats]:
        """Every namespace with blocks: sizes and blocks per holding worker."""
        self._drop_orphans()
        owner = {sub.stream_id: w for w, subs in self._workers.items() for sub in subs}
        out = []
        for size in self.index.namespaces():
            holders: dict[str, int] = {}
            for stream, blocks in size.holders.items():
                worker = owner.get(stream)
                if worker is not None:
                    holders[worker] = max(holders.get(worker, 0), blocks)
            out.append(NamespaceStats(size.namespace, size.blocks, size.tokens, holders))
        return out

    def evict_namespace(self, namespace: Namespace) -> int:
        """Drop a namespace from the index (not from the workers); returns entries dropped."""
        return self.index.evict_namespace(namespace)

    def held_namespaces(self) -> list[Namespace]:
        """Every namespace the index has an entry of, pending marks included (`namespaces`
        lists only those with blocks): what an eviction must reach."""
        self._drop_orphans()
        return self.index.held_namespaces()

    def evict_salt(self, cache_salt: str | None) -> tuple[list[Namespace], int]:
        """Drop every namespace of one salt (None: the unsalted ones), whatever its model,
        adapter or extra_key, blocks and pending marks alike; returns them and the entries
        dropped (pending marks are not entries: a namespace of marks alone drops 0)."""
        targets = [ns for ns in self.held_namespaces() if ns.cache_salt == cache_salt]
        return targets, sum(self.index.evict_namespace(ns) for ns in targets)

    # ------------------------------------------------------------ snapshots

    def dump(self) -> bytes:
        """A versioned msgpack snapshot of the whole index and of the `extra_key` shadows."""
        self._drop_orphans()
        parked = cast("dict[ServerStream, dict[int, Shadow]]", self._shadowed.by_server())
        kept = KeptShadows(
            at=self._clock(),
            streams=self._shadowed.by_stream(),
            seeds=dict(self._seeds),
            blanket=set(self._blanket),
            unsized=list(self._unsized_shadows),
            servers={
                sub.stream_id: server_stream(sub.config)
                for subs in self._workers.values()
                for sub in subs
            },
            parked={
                server: (parked.get(server, {}), list(self._parked_fences.get(server, [])))
                for server in parked.keys() | self._parked_unsized.keys() | self._parked_blanket
            },
            parked_unsized=[
                (server, plain, head, extra_key, until)
                for server, items in self._parked_unsized.items()
                for _, plain, head, extra_key, until in items
            ],
            parked_blanket=set(self._parked_blanket),
        )
        return dump_index(self.index, kept)

    def _drop_orphans(self) -> None:
        """Drop the streams a loaded snapshot brought that no worker took up within
        `ORPHAN_GRACE_S` of the load: nothing updates or proves them, yet they would be counted
        in the namespaces and written into every later dump."""
        loaded_at = self._loaded_at
        if loaded_at is None or self._clock() - loaded_at < ORPHAN_GRACE_S:
            return
        self._loaded_at = None
        ours = {sub.stream_id for subs in self._workers.values() for sub in subs}
        for stream in self.index.streams():
            if stream not in ours:
                self.index.drop_stream(stream)

    def load(self, data: bytes) -> None:
        """Replace the index with a snapshot; raises SnapshotError and keeps the old one.

        The snapshot's streams of workers not subscribed yet are kept for them (a worker
        still being discovered at a warm start, or added later), for `ORPHAN_GRACE_S`. A
        subscribed stream keeps this process's counters (metrics never go back), not the
        snapshot's. The live stream's model, engine and block size (configured, or learned
        from its events) win: a snapshot stream that says others is dropped (`_adopt`). Each
        load is logged: why it was refused, or what it brought (each subscribed stream then
        logs whether its fence was proven: `indexer.stream`)."""
        try:
            index, shadows = load_snapshot(
                data, clock=self._clock, pending_ttl_s=self.config.pending_ttl_s
            )
        except SnapshotError as exc:
            log.warning("snapshot load refused (the index is unchanged): %s", exc)
            raise
        brought = {sid: index.entries(sid) for sid in index.streams()}
        subscribed = dropped = 0
        for subs in self._workers.values():
            for sub in subs:
                cfg = sub.config
                subscribed += sub.stream_id in brought
                dropped += not _adopt(index, sub.stream_id, cfg, sub.block_size)
                if self.index.has_stream(sub.stream_id):
                    index.set_counters(sub.stream_id, self.index.counters(sub.stream_id))
                # continue from the snapshot's seq (once its fence is proven): live messages
                # then apply, or show a gap that the replay fills; streams the snapshot does
                # not know rebuild from 0
                sub.rebind(self._sink(index, sub.stream_id))
        self.index = index
        if self._peer_marks:
            index.log_removals()
        if self.fed is not None and (rebound := self.fed.on_rebound) is not None:
            for fed in self.fed.all():
                rebound(fed)
        if self.tap is not None:
            # what follows the relay held the index this one replaces: they start afresh
            self.tap.new_epoch()
        taken = 0 if shadows is None else self._take_loaded_shadows(shadows)
        self._loaded_at = self._clock()
        self._matches.invalidate()
        waiting = len(brought) - subscribed
        log.info(
            "snapshot loaded: %d streams, %d entries; %d of subscribed workers (%d dropped: "
            "another shape), each predicting nothing until its fence is proven (one line per "
            "stream says which, or why it was cleared); %d kept "
            "for workers not subscribed yet; %s",
            len(brought),
            sum(brought.values()),
            subscribed,
            dropped,
            waiting,
            "no extra_key shadows in it (a version 5 snapshot)"
            if shadows is None
            else f"{taken} extra_key shadows added",
        )

    def _take_loaded_shadows(self, kept: KeptShadows) -> int:
        """Add the `extra_key` shadows a loaded snapshot kept to this process's; returns how
        many it had. They only hide: a key shadowed twice is shadowed by the extra_keys of
        both. Before, a snapshot carried none, and a router that loaded one (or a replica that
        started from the cluster's) trusted the pages an `extra_key` request had stored, which
        events show as plain, for a plain request of its salt: a false hit until evicted.

        A shadow is of the server's cache: each stream's go to the server's stream it followed
        in the snapshot, parked there as a leaving worker's are (`_park_shadows`, with the
        snapshot's fence of the stream), and every stream here that follows (or may follow)
        that server takes them (`_adopt_shadows`), under whatever worker id; one added later
        takes them then. A stream that took them keeps them while its publisher may be the
        process the snapshot followed (`_judge_adoption`): a new process's cache holds none of
        those pages. The snapshot's parked shadows are parked here too. A stream whose server
        the snapshot does not name keeps its shadows under its id."""
        now = self._clock()
        index = self.index
        taken = 0
        servers = kept.servers
        parked: dict[str, ServerStream] = {}  # stream -> the server its shadows were parked for
        own: dict[str, list[int]] = {}  # streams kept by id: this process's shadows there
        by_id: dict[str, list[_Unsized]] = {}
        for stream, shadows in kept.streams.items():
            taken += len(shadows)
            server = servers.get(stream)
            if server is not None:
                self._shadowed.park_loaded(server, shadows, now)
                parked[stream] = server
                continue
            own.setdefault(stream, list(self._shadowed.shadows(stream) or ()))
            self._shadowed.include(stream, shadows)
            by_id.setdefault(stream, [])
        for seed, plain in kept.seeds.items():
            self._seeds.setdefault(seed, plain)
        room = _UNSIZED_LIMIT - len(self._unsized_shadows)
        for stream, plain, head, extra_key, until in kept.unsized:
            taken += 1
            server = servers.get(stream)
            item = (stream, plain, array("q", cast(Sequence[int], head)), extra_key, until)
            if server is not None:
                if room <= 0:
                    self._cover_parked(server)  # beyond the bound: hidden whole
                else:
                    self._parked_unsized.setdefault(server, []).append(item)
                    room -= 1
                parked[stream] = server
                continue
            own.setdefault(stream, list(self._shadowed.shadows(stream) or ()))
            if room <= 0:
                self._cover(stream)
                continue
            self._unsized_shadows.append(item)
            by_id.setdefault(stream, []).append(item)
            room -= 1
        for stream in kept.blanket:
            server = servers.get(stream)
            if server is not None:
                self._cover_parked(server)
                parked[stream] = server
            else:
                self._cover(stream)
        for stream, server in parked.items():
            self._park_fences(server, [index.fence(stream) if index.has_stream(stream) else None])
        for server, (shadows, fences) in kept.parked.items():
            taken += len(shadows)
            self._shadowed.park_loaded(server, shadows, now)
            self._park_fences(server, fences)
        for server, plain, head, extra_key, until in kept.parked_unsized:
            taken += 1
            item = ("", plain, array("q", cast(Sequence[int], head)), extra_key, until)
            self._parked_unsized.setdefault(server, []).append(item)
        for server in kept.parked_blanket:
            self._cover_parked(server)
        for subs in self._workers.values():
            for sub in subs:
                self._adopt_shadows(server_stream(sub.config), sub.stream_id)
        for stream, unsized in by_id.items():
            if unsized and index.has_stream(stream):
                # keyed at once where the page size is known (else at its first batch): an
                # unsized shadow hides nothing
                self._size_shadows(stream)
            fence = index.fence(stream) if index.has_stream(stream) else None
            self._adopt_loaded(stream, [fence], unsized, own[stream])
        return taken

    def _sink(self, index: PrefixIndex, stream: str) -> IndexSink | TappedSink:
        sink = IndexSink(index, stream)
        return sink if self.tap is None else TappedSink(sink, self.tap)

    # -------------------------------------------------------------- waiting

    def _on_restart(self, worker: str, stream: str) -> None:
        for listener in self.restart_listeners:
            listener(worker)
        self._judge_own_shadows(stream)

    def _judge_own_shadows(self, stream: str) -> None:
        """`stream`'s publisher restarted, or may have (its stream says so before it clears):
        the `extra_key` shadows marked there longer than `RESTART_DOUBT_S` ago are judged as a
        renamed worker's are, by its last batch (`_judge_adoption`). A new process's cache
        holds none of those pages; kept, a prompt first sent with an `extra_key` and then
        stored plain by the new process was predicted nothing there for as long as it stayed
        hot (the shadow lives while its stream holds the key). A sign that was no restart (a
        garbage live frame, a relay's block-size warning) changes nothing: the same process's
        seq goes on past the fence.

        The shadows marked within `RESTART_DOUBT_S` stay whatever the judgment says: their
        requests may have reached the new process before its stream found it. QA found two
        such false hits in earlier versions of this rule, each a plain request predicted the
        new process's extra_key pages (320 tokens, 0 cached): an extra_key request 80-150 ms
        after a restart, judged with the old shadows; and one marked while the old process's
        last batches waited unread behind a stalled loop, taken as older than them when they
        were applied. So do the shadows still waiting for a page size (fail closed)."""
        if not (self._shadowed.shadows(stream) or stream in self._blanket):
            return
        if not self.index.has_stream(stream):
            return  # (no batch to tell the next process by: kept)
        fence = self.index.fence(stream)
        if fence is None:
            return
        recent = self._recent_marks.get(stream)
        mine: set[int] = set()
        if recent is not None:
            horizon = self._clock() - RESTART_DOUBT_S
            if recent.forgot_keys_since(horizon):
                return  # more marked lately than it keeps: no shadow can be told old
            mine = recent.keys_since(horizon)
        if stream in self._adopted:
            # the shadows it took, and its own marked before the doubt, are judged alike, by
            # the fences it took them with: the stream's fence now may be a batch of the new
            # process already (a loaded snapshot's failed proof says so after its rebuild
            # began), and judged by it, the shadows stayed (a missed hit the loaded-dump test
            # showed on a loaded machine)
            self._shadowed.watch(stream, mine)
            return
        self._doubt_from(stream)
        self._adopt_loaded(stream, [fence], [], sorted(mine))

    def _on_applied(self, stream: str, seq: int) -> None:
        self._applied_seq[stream] = seq
        self._matches.on_applied(stream)
        if self._adopted and stream in self._adopted and self._settled_at(stream):
            self._judge_adoption(stream, seq)  # before its adopted unsized shadows get keys
        if self._unsized_shadows:
            self._size_shadows(stream)
        for listener in self.applied_listeners:
            listener(stream)
        if not self._waiters:
            return
        still = []
        for worker, want, fut in self._waiters:
            if fut.done():
                continue
            if self._worker_reached(worker, want):
                fut.set_result(True)
            else:
                still.append((worker, want, fut))
        self._waiters = still

    def _worker_reached(self, worker: str, seq: int) -> bool:
        # applied, not only accepted: a live batch's seq is taken (`tracker.last`) before a
        # live check asks the replay socket for it, and it is applied only after the answer
        # (CI: a test read the index while its batch waited on that round trip)
        applied = self._applied_seq
        seen = [
            applied.get(s.stream_id, -1)
            for s in self._workers.get(worker, [])
            if s.tracker.last is not None
        ]
        return bool(seen) and all(last >= seq for last in seen)

    async def wait_applied(self, worker: str, seq: int, timeout_s: float = 5.0) -> bool:
        """True once every stream of `worker` that has received anything applied seq >= `seq`."""
        if self._worker_reached(worker, seq):
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiter = (worker, seq, fut)
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            return False
        finally:
            # a waiter that timed out on an idle stream must not stay listed forever
            if waiter in self._waiters:
                self._waiters.remove(waiter)


def _add_fences(kept: list[BatchFence | None], fences: Sequence[BatchFence | None]) -> None:
    """Add to `kept` each of `fences` it does not have: a fence kept twice judges nothing more
    (QA: a router loading its own dump again and again doubled them each time, 32,768 after 16
    loads, each written into every later dump)."""
    seen = {None if f is None else (f.seq, f.digest()) for f in kept}
    for fence in fences:
        mark = None if fence is None else (fence.seq, fence.digest())
        if mark not in seen:
            seen.add(mark)
            kept.append(fence)


def _adopt(index: PrefixIndex, stream: str, cfg: StreamConfig, block_size: int | None) -> bool:
    """Register `stream` in `index` as the live stream is (its model, engine and block size,
    configured or learned); False when the index held it in another shape (a snapshot of
    another model, or made with another block size) and it was dropped whole.

    Kept, such a stream would keep the snapshot's block size and refuse every later event of
    the worker as a mismatch, or hold its entries in another model's namespace (misses)."""
    known = index.has_stream(stream)
    differ = []
    if known:
        have = index.block_size(stream)
        if have is not None and block_size is not None and have != block_size:
            differ.append(f"block size {have} in the snapshot, {block_size} live")
        model, engine = index.stream_model(stream)
        if model != cfg.model:
            differ.append(f"model {model!r} in the snapshot, {cfg.model!r} live")
        if engine != cfg.engine:
            differ.append(f"engine {engine} in the snapshot, {cfg.engine} live")
    if differ:
        dropped = index.drop_stream(stream)
        log.warning(
            "stream %s: the snapshot's state is dropped (%d entries), it is not this stream's: "
            "%s; the stream starts empty",
            stream,
            dropped,
            "; ".join(differ),
        )
    index.add_stream(stream, model=cfg.model, engine=cfg.engine, block_size=block_size)
    return not differ
