"""How old the relay follower takes a record to be, from JetStream's delivery metadata.

The messages are built as JetStream delivers them (the reply subject `$JS.ACK...` carries the
stream sequence, the server's time of the record and how many records follow it): no server is
needed to ask what age the follower gives each. The whole path runs against a real nats-server
in test_relay.py; this pins the cases a live server cannot be made to produce on demand (a
follower whose loop stalled while records queued)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.msg import Msg

from indexer.config import IndexerConfig, StreamConfig
from indexer.relay_record import RelayKind, RelayRecord, relay_encoder
from indexer.service import IndexerService
from indexer.stats import StreamState
from router.cluster.relay_follower import RelayFollower
from router.config import ClusterConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def delivered(seq: int, server_time: float, pending: int, rseq: int) -> Msg:
    """Heartbeat `rseq` of w0#dp0 as JetStream delivers it: written at `server_time` (the
    server's clock), `pending` records behind it."""
    record = RelayRecord(RelayKind.HEARTBEAT, "w0#dp0", 7, -1, StreamState.SYNCED)
    reply = f"$JS.ACK.kvroute_events.c.1.{seq}.{seq}.{int(server_time * 1e9)}.{pending}"
    return Msg(None, subject="kvroute.events.x", reply=reply, data=relay_encoder.encode(record))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def following(clock: Clock) -> AsyncIterator[tuple[IndexerService, RelayFollower]]:
    """A replica's fed index of w0 (STALE 3 s after the relay's last fresh word) and its
    follower, which has read the relay's stream to its end, with the first heartbeat (written
    at 500 on the server's clock) delivered live."""
    async with IndexerService(
        IndexerConfig(), fed=True, clock=clock, fed_silent_after_s=3.0
    ) as svc:
        await svc.add_worker("w0", [StreamConfig(endpoint="tcp://127.0.0.1:9", block_size=4)])
        follower = RelayFollower(ClusterConfig(), svc, clock=clock)
        follower._live = True  # read to the stream's end already
        await follower._on_message(delivered(1, 500.0, 0, 0))
        yield svc, follower


async def test_a_record_that_waited_in_this_hosts_buffers_is_old_not_new() -> None:
    """The follower's loop stalled: the relay's last heartbeat was delivered before it died,
    and the follower reads it 7 s later. It is 7 s old (the relay may be long dead), not new."""
    clock = Clock()
    async with following(clock) as (svc, follower):
        assert svc.streams()[0].state is StreamState.SYNCED
        clock.now += 7.0  # stalled; meanwhile the server sent the heartbeat written at 501
        await follower._on_message(delivered(2, 501.0, 0, 0))
        assert svc.streams()[0].state is StreamState.STALE  # written 6 s before now


async def test_each_heartbeat_of_a_burst_is_fresh_not_only_the_last() -> None:
    clock = Clock()
    async with following(clock) as (svc, follower):
        clock.now += 1.0
        # this stream's heartbeat first in a burst: another stream's follows it
        await follower._on_message(delivered(2, 501.0, 1, 0))
        clock.now += 2.5  # 3.5 s after the first: only the second keeps it fresh
        assert svc.streams()[0].state is StreamState.SYNCED
