"""The running subscriptions of a process: one task per stream, grouped by worker.

`Subscriptions` owns the zmq context and one `StreamSubscriber` task per (worker, dp rank)
stream, whatever their sinks are: the indexer service (`indexer.service`, sinks into the index)
and a capture (`indexer.recording.capture`, sinks into a recording file) both run on it.
It is an async context manager: leaving it stops every task and closes every socket.

Sockets: a stream holds three zmq sockets (its SUB, the monitor PAIR it reads and the PAIR
libzmq opens for the monitor) and three more with a replay endpoint (the DEALER, connected at
all times so that its monitor sees the publisher's process go, and that monitor's pair), about
eight file descriptors with their mailboxes and TCP connections. The context may open as many
sockets as the process may open descriptors (`RLIMIT_NOFILE`'s soft limit, within libzmq's own
ceiling): libzmq's default of 1023 sockets stopped the router at about 255 streams whatever the
limit, and a worker of 300 ranks made ~400 subscriber tracebacks in 8 s (`ZMQError: Too many
open files`, each rank restarting in a loop). The streams together are given half of that
(`socket_budget`), so they take at most about three quarters of the descriptors and the HTTP
side keeps the rest. A stream that does not fit waits, subscribed to nothing (it predicts no
hit: fail closed), until a worker's removal frees sockets, first come first served; that is
said in one WARNING line per `log_interval_s` naming the limit to raise (`ulimit -n`), not a
traceback per retry. The soft limit is not raised here: as for `limits.max_connections`
(`router.http.listener.connection_cap`), the operator's limit stands and is named. The
descriptors the streams may hold (`descriptor_room`) are kept out of the listener's connection
budget, so client connections never take the ones a stream admitted later would need.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from indexer.config import IndexerConfig, StreamConfig
from indexer.log_throttle import LogThrottle
from indexer.sink import StreamSink
from indexer.stats import StreamState
from indexer.stream.subscriber import StreamSubscriber

__all__ = ["Subscriptions", "socket_budget", "stream_id", "stream_worker"]

log = logging.getLogger(__name__)

# the descriptors of a stream's sockets, three for two: its SUB and its DEALER a mailbox and a
# TCP connection each, its two monitor PAIRs a mailbox each (six for four sockets, four for
# three; a router following one worker of 100 ranks with replay holds 622 descriptors)
_DESCRIPTORS_PER_TWO_SOCKETS = 3


def socket_budget(socket_limit: int) -> tuple[int, int | None]:
    """(the zmq sockets this process's context may open, its descriptor limit: None when
    unlimited): as many as descriptors (each socket holds at least one, its mailbox), within
    libzmq's `socket_limit`. The streams are given half of it (module docstring)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return socket_limit, None
    return max(1, min(socket_limit, soft)), soft


def _sockets_of(config: StreamConfig) -> int:
    """The zmq sockets one stream's session holds (module docstring): its SUB and the SUB's
    monitor (a pair of sockets), and with a replay socket its DEALER and the DEALER's."""
    return 3 if config.replay_endpoint is None else 6


def stream_id(worker: str, dp_rank: int) -> str:
    """The id of one (worker, dp rank) stream, as used in stats and the index."""
    return f"{worker}#dp{dp_rank}"


def stream_worker(stream: str) -> str | None:
    """The worker of a stream id (`stream_id`'s inverse); None when it is not one."""
    worker, sep, rank = stream.rpartition("#dp")
    return worker if sep and worker and rank.isdigit() else None


class Subscriptions:
    """Subscriber tasks by worker, over one zmq context (see the module docstring)."""

    def __init__(
        self,
        settings: IndexerConfig,
        *,
        on_applied: Callable[[str, int], None] | None = None,
        on_restart: Callable[[str, str], None] | None = None,
        on_state: Callable[[str, StreamState], None] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self._on_applied = on_applied
        self._on_restart = on_restart
        self._on_state = on_state
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self.by_worker: dict[str, list[StreamSubscriber]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # zmq sockets: what the context may open, the descriptor limit it was sized from
        self.max_sockets = 0
        self._descriptors: int | None = None
        # the running streams' sockets, by stream id; the streams waiting for theirs, in the
        # order they came, each with its need and what admits it
        self._held: dict[str, int] = {}
        self._waiting: OrderedDict[str, tuple[int, asyncio.Future[None]]] = OrderedDict()
        self._said = LogThrottle(settings.log_interval_s)

    async def __aenter__(self) -> Subscriptions:
        ctx = zmq.asyncio.Context()
        # before the first socket: libzmq sizes its table of sockets then
        self.max_sockets, self._descriptors = socket_budget(ctx.get(zmq.SOCKET_LIMIT))
        ctx.set(zmq.MAX_SOCKETS, self.max_sockets)
        self._ctx = ctx
        return self

    @property
    def socket_room(self) -> int:
        """The sockets the streams may hold together: half of `max_sockets` (the rest leaves
        room for sockets closed but not yet reaped by libzmq, and descriptors for the rest)."""
        return self.max_sockets // 2

    @property
    def descriptor_room(self) -> int:
        """The file descriptors the streams may hold together: `socket_room`'s sockets, three
        descriptors for two (0 before the context is entered, or for a process that never
        enters it)."""
        return -(-self.socket_room * _DESCRIPTORS_PER_TWO_SOCKETS // 2)

    def waiting(self) -> list[str]:
        """The streams waiting for zmq sockets (subscribed to nothing yet), in order."""
        return list(self._waiting)

    async def __aexit__(self, *exc: object) -> None:
        self._waiting.clear()  # none is admitted by the stops below: every task ends
        try:
            for worker in list(self.by_worker):
                await self.stop(worker)
        finally:  # even when cancelled meanwhile: no socket left open
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
                self._ctx = None

    def start(
        self,
        worker: str,
        streams: Sequence[StreamConfig],
        sink_for: Callable[[str, StreamConfig], StreamSink],
    ) -> list[StreamSubscriber]:
        """Subscribe to a worker's streams, each into `sink_for(stream id, config)`.

        The worker must not be subscribed already (`stop` it first); ranks must be distinct.
        """
        if self._ctx is None:
            raise RuntimeError("subscriptions are not entered (use `async with`)")
        if worker in self.by_worker:
            raise ValueError(f"worker {worker!r} is subscribed already")
        ranks = [cfg.dp_rank for cfg in streams]
        for rank in ranks:
            # checked before anything changes: a refused worker leaves no stream behind
            if ranks.count(rank) > 1:
                raise ValueError(f"worker {worker!r} lists dp rank {rank} twice")
        subs = []
        for cfg in streams:
            sid = stream_id(worker, cfg.dp_rank)
            subs.append(
                StreamSubscriber(
                    sid,
                    worker,
                    cfg,
                    sink_for(sid, cfg),
                    self._ctx,
                    self.settings,
                    on_applied=self._on_applied,
                    on_restart=self._on_restart,
                    on_state=self._on_state,
                    on_siblings=self._suspect_siblings,
                    clock=self._clock,
                )
            )
        self.by_worker[worker] = subs
        waits = 0
        for sub in subs:
            need = _sockets_of(sub.config)
            if not self._waiting and sum(self._held.values()) + need <= self.socket_room:
                self._held[sub.stream_id] = need
                run = sub.run()
            else:
                # first come first served: none overtakes a stream waiting already
                admitted = asyncio.get_running_loop().create_future()
                self._waiting[sub.stream_id] = (need, admitted)
                run = self._run_when_admitted(sub, admitted)
                waits += 1
            # in a context of their own: a registration started on a request's path (a worker
            # refusing a rank, read again) would give them that request's, its id on every line
            # they log for as long as they run, and its observation kept alive with them
            self._tasks[sub.stream_id] = asyncio.create_task(
                run, name=f"kv-events {sub.stream_id}", context=contextvars.Context()
            )
        if waits:
            self._say_waiting(worker, waits, len(subs))
        return subs

    def _suspect_siblings(self, sub: StreamSubscriber, sign: str) -> None:
        """`sub` found its publisher restarted, or its event connection dropped (`sign` says
        which): the worker's other ranks are the same server's processes, which restart
        together, so each is suspected at once (UNVERIFIED, proven or rebuilt through its own
        replay socket; without one, cleared). Before, a rank whose event connection did not
        drop (a forwarder between) and that stayed quiet predicted the dead process's pages
        until its own idle probe found the restart; and a drop told them nothing until its
        proof ran after the reconnect (never, if the dropping rank held nothing), the new
        process serving meanwhile."""
        subs = self.by_worker.get(sub.worker, [])
        if sub not in subs:
            return  # a worker registered anew since: its streams are new subscribers
        for other in subs:
            if other is not sub:
                other.suspect_restart(
                    f"dp rank {sub.config.dp_rank} of its worker {sign} (the ranks of one "
                    "server restart together)",
                    sibling=True,
                )

    @staticmethod
    async def _run_when_admitted(sub: StreamSubscriber, admitted: asyncio.Future[None]) -> None:
        await admitted
        await sub.run()

    def _admit(self) -> None:
        """Start the waiting streams that fit now, in order."""
        held = sum(self._held.values())
        while self._waiting:
            sid, (need, admitted) = next(iter(self._waiting.items()))
            if held + need > self.socket_room:
                return
            del self._waiting[sid]
            self._held[sid] = need
            held += need
            admitted.set_result(None)
        log.info("every KV-event stream waiting for zmq sockets has them now")

    def _say_waiting(self, worker: str, waits: int, streams: int) -> None:
        held_back = self._said.allow("sockets")
        if held_back is None:
            return
        limit = (
            f"RLIMIT_NOFILE {self._descriptors}"
            if self._descriptors is not None
            else "libzmq's ceiling"
        )
        log.warning(
            "worker %s: %d of its %d KV-event stream(s) wait for zmq sockets, %d in all: "
            "the streams of this process may hold %d (half of the %d it may open, from %s), "
            "and hold %d; a waiting stream is subscribed to nothing and predicts no hit until "
            "a worker's removal frees sockets; raise the descriptor limit (ulimit -n) to "
            "follow them all%s",
            worker,
            waits,
            streams,
            len(self._waiting),
            self.socket_room,
            self.max_sockets,
            limit,
            sum(self._held.values()),
            f" ({held_back} such lines held back)" if held_back else "",
        )

    async def stop(self, worker: str) -> list[StreamSubscriber]:
        """Stop a worker's subscriber tasks; returns its subscribers (none if unknown)."""
        subs = self.by_worker.pop(worker, [])
        tasks = [self._tasks.pop(s.stream_id) for s in subs if s.stream_id in self._tasks]
        waited = False
        for sub in subs:
            waited |= self._waiting.pop(sub.stream_id, None) is not None
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                # asyncio.wait, not `suppress(CancelledError): await task`: that would also
                # swallow a cancellation of the caller arriving while the subscribers wind down
                await asyncio.wait(tasks)
        finally:
            # freed once the sessions closed their sockets (or are closing them, when the
            # caller was cancelled meanwhile)
            freed = [self._held.pop(sub.stream_id, None) for sub in subs]
            if self._waiting and (waited or any(freed)):
                self._admit()
        return subs

    def task(self, stream: str) -> asyncio.Task[None] | None:
        """The running task of one stream (tests watch it survive hostile input)."""
        return self._tasks.get(stream)

    def all(self) -> list[StreamSubscriber]:
        """Every subscriber, in worker order."""
        return [sub for subs in self.by_worker.values() for sub in subs]
