"""A worker's config against what the worker advertises (`/server_info`): the checks that
refuse a registration which would predict another process's or another worker's cache.

Pure: the registration (`router.fleet.registration`, `router.fleet.rereads`) reads the server
info and acts on what these say.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec

from indexer.config import StreamConfig
from indexer.engines import engine_spec
from router.config import WorkerConfig
from router.errors import RequestError
from router.fleet.discovery import streams_for

__all__ = ["block_size_note", "check_ranks", "check_topic", "replay_proof", "sockets"]


def replay_proof(
    config: WorkerConfig, info: dict[str, Any] | None, streams: list[StreamConfig]
) -> tuple[list[StreamConfig], str | None]:
    """`streams` marked with whether their replay sockets are known to be their publishers':
    the worker advertises exactly these event and replay sockets. A configured pair that
    cannot be compared (no server info, event sockets mapped on the way) is not. With them,
    what to tell the operator when the worker advertises other event sockets than its config
    gives (None: nothing): mapped ports, or another worker's sockets by a typo.

    RequestError when a configured replay socket is not the one the worker advertises while
    its event sockets are: another worker's would rebuild this worker's streams from that
    worker's cache (false hits)."""
    advertised: list[StreamConfig] = []
    if info is not None:
        bare = msgspec.structs.replace(config, events=None, replay=None)
        with contextlib.suppress(RequestError):  # it advertises nothing usable
            advertised = streams_for(bare, info)
    note = None
    told_events = [s.endpoint for s in advertised]
    given_events = [s.endpoint for s in streams]
    streams = _with_advertised(streams, advertised)
    if advertised and told_events == given_events:
        told = [s.replay_endpoint for s in advertised]
        given = [s.replay_endpoint for s in streams]
        if told == given:
            return streams, None
        if config.replay is not None and all(t is not None for t in told):
            raise RequestError(
                f"worker {config.worker_id}: replay {given} is not the replay socket it "
                f"advertises ({told}) for these event sockets: another worker's would rebuild "
                "its streams from that worker's cache; fix `replay` in its config (not "
                "subscribed until then)"
            )
    elif advertised:
        # not refused (ports may be mapped on the way), but said: before, the stream stayed
        # `unverified` and nothing said why
        note = (
            f"it advertises event sockets {told_events}, its config gives {given_events}: "
            "what its streams' replay brings predicts no hit until a live batch agrees with "
            "it; unless the ports are mapped on the way, fix `events` (and `replay`) in its "
            "config (another worker's sockets would predict that worker's cache)"
        )
    return [msgspec.structs.replace(s, replay_proven=False) for s in streams], note


def _with_advertised(
    streams: list[StreamConfig], advertised: list[StreamConfig]
) -> list[StreamConfig]:
    """`streams` with the sockets the worker advertises for their ranks: a stream whose
    event and replay sockets disagree about the publisher says by them which one is likely
    wrong."""
    by_rank = {s.dp_rank: s for s in advertised}
    return [
        msgspec.structs.replace(
            s, advertised_endpoint=told.endpoint, advertised_replay=told.replay_endpoint
        )
        if (told := by_rank.get(s.dp_rank)) is not None
        else s
        for s in streams
    ]


def sockets(streams: list[StreamConfig]) -> list[tuple[int, str, str | None, str]]:
    """What of a worker's streams says which sockets they are: another process may publish
    on others (a rank, events, replay or topic that differs is a stream to subscribe anew)."""
    return sorted((s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in streams)


def check_ranks(config: WorkerConfig, info: dict[str, Any], streams: list[StreamConfig]) -> None:
    """RequestError when the streams a config spells out cover other dp ranks than the worker
    says it runs: a rank left out is one the engine places requests on while the router
    predicts them from another rank's pages (the check on discovered streams is
    `streams_for`'s)."""
    advertised = engine_spec(config.engine).advertised_events(info).get("dp_size")
    if not isinstance(advertised, int) or isinstance(advertised, bool) or advertised < 1:
        return
    ranks = len({s.dp_rank for s in streams})
    if streams and ranks != advertised:
        raise RequestError(
            f"worker {config.worker_id}: its config gives events for {ranks} dp rank(s), the "
            f"worker advertises dp_size {advertised}: give dp_size = {advertised} (or one "
            "endpoint per rank)"
        )


def block_size_note(config: WorkerConfig, info: dict[str, Any] | None) -> str | None:
    """What to tell the operator when the configured `block_size` contradicts the page size
    the worker advertises (None: nothing, or nothing to compare). Registered all the same (the
    config's is used, as it is meant to override), but every batch of its events then has
    pages that do not fit its streams' block size: none is indexed, no hit is predicted for it.
    Before, only the indexer said so, at the first event (BLOCK SIZE MISMATCH), and the reload
    that set it answered with no warning."""
    if config.block_size is None or info is None or not config.kv_events:
        return None
    advertised = engine_spec(config.engine).advertised_events(info).get("block_size")
    if not isinstance(advertised, int) or isinstance(advertised, bool) or advertised < 1:
        return None
    if advertised == config.block_size:
        return None
    return (
        f"the config says block_size {config.block_size}, the worker advertises page size "
        f"{advertised}: none of its KV events' pages fit, so none is indexed and no hit is "
        "predicted for it; fix `block_size` in its config, or leave it out to take the worker's"
    )


def check_topic(config: WorkerConfig, info: dict[str, Any]) -> None:
    """RequestError when the configured topic is not a prefix of the one the worker says it
    publishes under: its SUB (which matches by prefix) would receive nothing, and the stream
    would look healthy while no hit is ever predicted for the worker."""
    if config.topic is None:
        return
    advertised = engine_spec(config.engine).advertised_events(info).get("topic")
    if isinstance(advertised, str) and not advertised.startswith(config.topic):
        raise RequestError(
            f"worker {config.worker_id}: topic {config.topic!r} is not the topic it publishes "
            f"under ({advertised!r}), so nothing it publishes would arrive; fix `topic` in its "
            "config, or leave it out to take the advertised one (not subscribed until then)"
        )
