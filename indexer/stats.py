"""What the indexer service reports: stream states and counters, matches, namespace sizes."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

from indexer.namespace import Namespace

if TYPE_CHECKING:
    from indexer.config import StreamConfig
    from indexer.index import StreamCounters

__all__ = [
    "STATE_RANK",
    "UNTRUSTED",
    "NamespaceStats",
    "RankMatch",
    "StreamState",
    "StreamStats",
    "WorkerMatch",
    "carried_over",
    "stream_stats",
]


class StreamState(enum.StrEnum):
    """Health of one stream's picture in the index."""

    # being rebuilt from the publisher's replay buffer (a join, a restart's rebuild, a clear
    # or a proof whose replay brings it forward): what it holds is the worker's past until the
    # answer ended and the live batches queued meanwhile are applied
    SYNCING = "syncing"
    # every message up to last_seq applied in order, nothing known missing (also a stream that
    # has heard nothing yet and has no replay buffer to read first: it holds nothing)
    SYNCED = "synced"
    # batches are known missing (a gap, or one that did not decode) and are being fetched again
    DEGRADED = "degraded"
    # the publisher may have restarted (the event connection dropped, or the worker's health
    # check came back from down) and the replay has not proven it is the same process yet;
    # also a stream whose tail is not known whole: its probe went unanswered, or a probe found
    # batches the connected SUB never delivered (the live path may be deaf: until a live batch)
    UNVERIFIED = "unverified"
    STALE = "stale"  # no message for stale_after_s (idle or dead worker)


# best first: a worker's state is the best among its streams (a trusted one before every
# UNTRUSTED one, so a worker is untrusted only when all its streams are)
STATE_RANK = {
    StreamState.SYNCED: 0,
    StreamState.SYNCING: 1,
    StreamState.DEGRADED: 2,
    StreamState.UNVERIFIED: 3,
    StreamState.STALE: 4,
}

# States in which a stream's entries predict nothing: kvroute cannot know that the worker
# still holds them, so they earn no affinity (fail closed). DEGRADED too: a batch the stream
# misses may have removed blocks it holds (the prefix the worker evicted was predicted for as
# long as the repair took, up to `replay_timeout_s`); the repair's end gives them back at once.
# SYNCING too: a stream read from the replay buffer holds the worker's past, pages stored early
# in it and evicted later included, until it is caught up (before, they were predicted while
# the buffer was read: a false hit at every join and rebuild of a busy worker)
UNTRUSTED = frozenset(
    {StreamState.SYNCING, StreamState.DEGRADED, StreamState.UNVERIFIED, StreamState.STALE}
)


class StreamStats(msgspec.Struct):
    """Counters and state of one (worker, dp rank) stream."""

    stream: str
    worker: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    state: StreamState
    last_seq: int | None
    block_size: int | None
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    gaps: int  # missing seqs noticed once joined (by a live message or the idle probe)
    replays: int  # replay runs: gap repairs, and probes that brought batches
    restarts: int
    clears: int  # entries dropped wholesale: AllBlocksCleared, restart, unrepairable gap
    decode_errors: int
    unknown_parents: int
    block_size_mismatches: int
    skipped_events: int
    last_event_age_s: float | None
    entries: int  # blocks held now
    probes: int = 0  # catch-up replay requests made while the stream was quiet
    # replays (idle probes, restart proofs, rebuilds) that brought batches the connected SUB
    # never delivered (the event path may be deaf): the stream predicts nothing until a live
    # batch follows on
    undelivered_tails: int = 0
    # batches that failed to decode and were fetched again through the replay socket
    refetches: int = 0
    # batches that could not be decoded even from the replay: the stream was cleared for them
    lost_batches: int = 0
    # replay requests whose answer never came to its end marker: timed out, or not this
    # stream's buffer (cut short at its deadline, frames that do not parse, ...)
    unanswered_replays: int = 0
    # restart candidates (reconnects, health transitions) checked against the epoch fence
    verifications: int = 0
    # blocks of KV-cache groups that make no reusable prefix (sliding window, Mamba): not kept
    skipped_group_blocks: int = 0
    dp_rank: int = 0  # the worker's data-parallel rank this stream is (a metric label)
    # removals of blocks the stream does not hold (in the tier they name): changed nothing
    unknown_removes: int = 0
    # blocks keyed by images or prompt embeddings their tokens do not show (vLLM): not kept
    unindexable_blocks: int = 0
    # batches that said another dp rank than the stream's (its ports mapped wrong): warned of
    rank_mismatches: int = 0
    # events of SGLang EAGLE (prev, next) pairs on a stream of int pages, or the reverse, while
    # it held entries: not kept (a request is keyed one way per stream)
    token_kind_mismatches: int = 0
    # live batches of a restarted worker's dead process, still queued on the socket when the
    # restart was found: skipped
    dead_batches: int = 0
    # live batches asked of the replay socket, whose bytes must be the live stream's (the
    # live stream may be another publisher's, its seqs following on): about one a second
    live_checks: int = 0
    # times a gap its replay left unrepaired cleared the stream and it was rebuilt from the
    # replay buffer afterwards (the pages the worker held from before the gap)
    rebuilds: int = 0


class RankMatch(msgspec.Struct):
    """How much of a request one data-parallel rank of a worker holds (its one stream)."""

    dp_rank: int
    matched_blocks: int  # leading blocks held, from real events (0 while the stream is untrusted)
    matched_tokens: int  # matched_blocks * block_size
    pending_tokens: int  # extra leading tokens covered only by pending (routing-time) entries
    block_size: int | None
    by_medium: dict[str, int]  # leading blocks per tier
    state: StreamState  # this rank's stream's own state


class WorkerMatch(msgspec.Struct):
    """How much of a request one worker holds: its best dp rank, and every rank apart."""

    worker: str
    matched_blocks: int  # leading blocks held, from real events
    matched_tokens: int  # matched_blocks * block_size
    pending_tokens: int  # extra leading tokens covered only by pending (routing-time) entries
    block_size: int | None
    by_medium: dict[str, int]  # leading blocks per tier, e.g. {"GPU": 10, "CPU": 2}
    state: StreamState  # best state among the worker's streams
    # one entry per stream of the worker, in dp-rank order (empty for a worker without
    # streams): what the router needs to choose a rank, not just a worker
    ranks: tuple[RankMatch, ...] = ()


class NamespaceStats(msgspec.Struct):
    """One namespace: unique blocks, their tokens, blocks per holding worker."""

    namespace: Namespace
    blocks: int
    tokens: int
    holders: dict[str, int]  # worker -> blocks


# the cumulative fields of `StreamStats` (Prometheus counters): what a (worker, dp rank) series
# carries over when its worker is registered anew (`carried_over`)
_COUNTERS = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "gaps",
    "replays",
    "restarts",
    "clears",
    "decode_errors",
    "unknown_parents",
    "block_size_mismatches",
    "skipped_events",
    "probes",
    "undelivered_tails",
    "refetches",
    "lost_batches",
    "unanswered_replays",
    "verifications",
    "skipped_group_blocks",
    "unknown_removes",
    "unindexable_blocks",
    "rank_mismatches",
    "token_kind_mismatches",
    "dead_batches",
    "live_checks",
    "rebuilds",
)


def carried_over(stats: StreamStats, earlier: StreamStats | None) -> StreamStats:
    """`stats` with the counters of `earlier` (the same stream's before its worker was
    registered anew; None: nothing) added: a series that went back to 0 would read as a counter
    reset, and `increase()` would show nothing for the restart that caused it."""
    if earlier is None:
        return stats
    return msgspec.structs.replace(
        stats, **{name: getattr(stats, name) + getattr(earlier, name) for name in _COUNTERS}
    )


def stream_stats(
    stream: str,
    worker: str,
    config: StreamConfig,
    counters: StreamCounters | None,
    *,
    state: StreamState,
    last_seq: int | None,
    block_size: int | None,
    entries: int,
    last_event_age_s: float | None,
    batches: int,
    events: int,
    gaps: int,
    restarts: int,
    decode_errors: int,
    verifications: int,
    rank_mismatches: int,
    clears: int = 0,
    replays: int = 0,
    probes: int = 0,
    undelivered_tails: int = 0,
    refetches: int = 0,
    lost_batches: int = 0,
    unanswered_replays: int = 0,
    dead_batches: int = 0,
    live_checks: int = 0,
    rebuilds: int = 0,
) -> StreamStats:
    """A stream's `StreamStats` (a subscriber's and a relay-fed stream's alike): its socket
    fields from `config`, what its index did from `counters` (None: a sink that keeps none,
    zeros, and `clears` its own count), the rest as given."""
    done = counters
    return StreamStats(
        stream=stream,
        worker=worker,
        endpoint=config.endpoint,
        replay_endpoint=config.replay_endpoint,
        topic=config.topic,
        state=state,
        last_seq=last_seq,
        block_size=block_size,
        batches=batches,
        events=events,
        blocks_stored=done.blocks_stored if done else 0,
        blocks_removed=done.blocks_removed if done else 0,
        gaps=gaps,
        replays=replays,
        restarts=restarts,
        clears=done.clears if done else clears,
        decode_errors=decode_errors,
        unknown_parents=done.unknown_parents if done else 0,
        block_size_mismatches=done.block_size_mismatches if done else 0,
        skipped_events=done.skipped_events if done else 0,
        last_event_age_s=last_event_age_s,
        entries=entries,
        probes=probes,
        undelivered_tails=undelivered_tails,
        refetches=refetches,
        lost_batches=lost_batches,
        unanswered_replays=unanswered_replays,
        verifications=verifications,
        skipped_group_blocks=done.skipped_group_blocks if done else 0,
        dp_rank=config.dp_rank,
        unknown_removes=done.unknown_removes if done else 0,
        unindexable_blocks=done.unindexable_blocks if done else 0,
        rank_mismatches=rank_mismatches,
        token_kind_mismatches=done.token_kind_mismatches if done else 0,
        dead_batches=dead_batches,
        live_checks=live_checks,
        rebuilds=rebuilds,
    )
