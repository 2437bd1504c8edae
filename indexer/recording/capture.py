"""Capturing KV-event streams to a recording: what `kvroute record` runs.

A capture subscribes exactly like the router's indexer (the same `StreamSubscriber`, so gaps
are repaired through replay, epochs proven and restarts detected the same way) but sinks each
accepted message into a `RecordingWriter` instead of an index (`RecordingSink`): in the order
it was accepted, replayed batches flagged, malformed payloads kept byte for byte, and each clear
of the stream the subscriber decides as a mark in between (`RecordMark`: not every clear shows
in the seqs, and an offline replay must drop what the live index dropped). Payloads are
decoded only to tell the subscriber whether they decode (a batch that does not is fetched
again, as the router would), so the file holds what the live router would have applied.

Each record reaches the OS as it arrives, so a stop by duration, size, a signal or a crash never
loses what was written. A write error (disk full, file gone) stops the capture and is
reported, never raised into the subscriber.

A capture appending to a file continues each stream from its last record there (its seq and
fence, as a router continues from a snapshot): the subscriber proves the worker unchanged
through the replay socket and records only what is new, instead of joining at seq 0 again and
writing the worker's whole buffer a second time (which replays as a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import msgspec

from indexer.config import IndexerConfig, StreamConfig
from indexer.engines import engine_spec
from indexer.fence import BatchFence
from indexer.index import StreamCounters
from indexer.protocol.decode import decode_batch
from indexer.protocol.events import Stored
from indexer.recording.format import (
    Record,
    RecordingError,
    RecordingWriter,
    RecordMark,
    Source,
)
from indexer.sink import Applied
from indexer.stats import StreamStats
from indexer.subscriptions import Subscriptions

__all__ = ["Capture", "CaptureStats", "RecordingSink", "capture"]


class RecordingSink:
    """Writes one stream's accepted messages to a shared `RecordingWriter`.

    `write` says whether the message was written (False once the capture stops): `batches`
    and `decode_errors` count what was, so the capture's summary says what the file
    holds even though its subscriber goes on accepting until it is stopped. `mark` writes
    the subscriber's clears (`RecordMark`). `resume` is the stream's last record in the file
    being appended to: the subscriber continues from it.
    """

    keeps_entries = False  # the file keeps the decisions, not a cache's state

    def __init__(
        self,
        stream_id: str,
        write: Callable[[str, bytes, int, bytes, bool, bool], bool],
        block_size: int | None,
        resume: Record | None = None,
        mark: Callable[[str, RecordMark, int | None], bool] | None = None,
    ) -> None:
        self.stream_id = stream_id
        self._write = write
        self._mark = mark
        self._fence = None if resume is None else BatchFence.of(resume.seq, resume.payload)
        self._block_size = block_size
        self.batches = 0
        self.decode_errors = 0

    def apply(
        self, topic: bytes, seq: int, payload: bytes, *, replayed: bool, run_start: bool = False
    ) -> Applied | None:
        """Record the message; None when its payload does not decode (it is recorded too)."""
        written = self._write(self.stream_id, topic, seq, payload, replayed, run_start)
        self._fence = BatchFence.of(seq, payload)
        try:
            batch = decode_batch(payload)
        except Exception:  # ProtocolError; the bytes are in the file whatever they are
            self._count(int(written), decoded=False)
            return None
        self._count(int(written), decoded=True)
        if self._block_size is None:
            self._block_size = next(
                (ev.block_size for ev in batch.events if type(ev) is Stored and ev.block_size > 0),
                None,
            )
        return Applied(len(batch.events), dp_rank=batch.dp_rank)

    def _count(self, written: int, *, decoded: bool) -> None:
        """Count `written` records (-1: one written, then lost with its chunk)."""
        if decoded:
            self.batches += written
        else:
            self.decode_errors += written

    def uncount(self, record: Record) -> None:
        """`record` was counted, then lost with a compressed chunk whose write failed."""
        if record.mark:
            return  # a decision, not a batch: never counted
        try:
            decode_batch(record.payload)
        except Exception:  # ProtocolError
            self._count(-1, decoded=False)
            return
        self._count(-1, decoded=True)

    def clear(self) -> int:
        """Mark the clear in the file (a replay drops the stream's entries there); nothing
        is held here to drop."""
        if self._mark is not None:
            self._mark(self.stream_id, RecordMark.CLEAR, self.last_seq())
        return 0

    def forget_seq(self) -> None:
        """No fence any more; marked in the file (a replay forgets the seq there too)."""
        if self._mark is not None:
            self._mark(self.stream_id, RecordMark.FORGET_SEQ, self.last_seq())
        self._fence = None

    def fence(self) -> BatchFence | None:
        """The last message recorded."""
        return self._fence

    def last_seq(self) -> int | None:
        """The last message recorded (by an earlier session when appending); None: it joins."""
        return self._fence.seq if self._fence is not None else None

    def entries(self) -> int:
        """A capture keeps no state of the cache."""
        return 0

    def held_events(self) -> int:
        """A capture holds nothing back."""
        return 0

    def block_size(self) -> int | None:
        """Configured, or the first store's page size."""
        return self._block_size

    def counters(self) -> StreamCounters | None:
        """A capture counts no index operations."""
        return None


class CaptureStats(msgspec.Struct, kw_only=True):
    """What one capture did, per stream and in total."""

    seconds: float = 0.0
    records: int = 0  # messages written (what `kvroute record inspect` and `replay` count)
    # the subscriber's decisions written beside them (`RecordMark`: a clear, a forgotten seq);
    # before, `records` counted them too, and said 2 more than inspect did after a restart
    marks: int = 0
    streams: dict[str, dict[str, int]] = {}
    stopped_by: str = ""  # duration, max-bytes, ctrl-c, sigterm, write-error, stop (the caller's)
    error: str = ""  # why writing failed, empty when it did not


class Capture:
    """Subscriptions whose sinks write one recording (an async context manager).

    `stop` is set when a limit is reached or writing fails; the caller waits on it. From then
    on nothing more is written (the subscribers run until the context exits: the batches they
    accept meanwhile are not in the file, nor counted as its batches in `stats`).
    """

    def __init__(
        self,
        writer: RecordingWriter,
        sources: Sequence[Source],
        *,
        max_bytes: int | None = None,
        settings: IndexerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.writer = writer
        self.sources = list(sources)
        self.stats = CaptureStats()
        self.stop = asyncio.Event()
        self._max_bytes = max_bytes
        self._subs = Subscriptions(settings or IndexerConfig(), clock=clock)
        self._sinks: dict[str, RecordingSink] = {}
        # a writer used before this capture: only what this one wrote (or lost) is its own
        self._written_before = writer.records_written
        self._marks_before = writer.marks_written
        self._lost_before = len(writer.lost_records)

    def _sink(self, stream: str, config: StreamConfig) -> RecordingSink:
        sink = RecordingSink(
            stream,
            self._write,
            config.block_size,
            self.writer.last_records.get(stream),
            self._write_mark,
        )
        self._sinks[stream] = sink
        return sink

    async def __aenter__(self) -> Capture:
        await self._subs.__aenter__()
        by_worker: dict[str, list[StreamConfig]] = {}
        for s in self.sources:
            by_worker.setdefault(s.worker or s.stream, []).append(_stream_config(s))
        try:
            for worker, configs in by_worker.items():
                self._subs.start(worker, configs, self._sink)
        except BaseException:
            await self._subs.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        streams: list[StreamStats] = []
        try:
            streams = self.streams()
            await self._subs.__aexit__(*exc)
        finally:
            try:
                self.writer.close()
            except RecordingError as error:
                self.fail(error)
            # what reached the file: records of a chunk whose write failed are not counted
            self._count_written()
            for lost in self.writer.lost_records[self._lost_before :]:
                if (sink := self._sinks.get(lost.stream)) is not None:
                    sink.uncount(lost)
            self.stats.streams = {
                st.stream: {
                    # the sink's: its subscriber also counts the batches refused after the stop
                    "batches": sink.batches if sink is not None else st.batches,
                    "gaps": st.gaps,
                    "replays": st.replays,
                    "restarts": st.restarts,
                    "clears": st.clears,
                    "decode_errors": sink.decode_errors if sink is not None else st.decode_errors,
                }
                for st in streams
                for sink in [self._sinks.get(st.stream)]
            }

    def streams(self) -> list[StreamStats]:
        """State and counters of every captured stream."""
        return [sub.stats() for sub in self._subs.all()]

    def stop_by(self, reason: str) -> None:
        """Stop, naming why (the first reason given wins)."""
        self.stats.stopped_by = self.stats.stopped_by or reason
        self.stop.set()

    def fail(self, error: RecordingError) -> None:
        """Writing failed: stop, keep what was written, say why."""
        self.stats.error = self.stats.error or str(error)
        self.stop_by("write-error")

    def flush(self) -> None:
        """Close an open compressed chunk (uncompressed records are out already)."""
        try:
            self.writer.flush()
        except RecordingError as error:
            self.fail(error)

    def _write(
        self, stream: str, topic: bytes, seq: int, payload: bytes, replayed: bool, run_start: bool
    ) -> bool:
        """Write one message; False when it was not (stopping, or the write failed)."""
        if self.stop.is_set():
            return False  # stopping: the file ends at the record that reached the limit
        try:
            self.writer.write(stream, topic, seq, payload, replayed=replayed, run_start=run_start)
        except RecordingError as error:  # disk full, file gone: stop, keep what was written
            self.fail(error)
            return False
        self._count_written()
        if self._max_bytes is not None and self.writer.bytes_written >= self._max_bytes:
            self.stop_by("max-bytes")
        return True

    def _write_mark(self, stream: str, mark: RecordMark, seq: int | None) -> bool:
        """Write one decision of a subscriber; False when it was not (as `_write`)."""
        if self.stop.is_set():
            return False
        try:
            written = self.writer.write_mark(stream, mark, seq)
        except RecordingError as error:
            self.fail(error)
            return False
        self._count_written()
        return written is not None

    def _count_written(self) -> None:
        """What this capture wrote that reached the file (or is on its way), messages and
        marks apart."""
        marks = self.writer.marks_written - self._marks_before
        self.stats.records = self.writer.records_written - self._written_before - marks
        self.stats.marks = marks


def _stream_config(source: Source) -> StreamConfig:
    return StreamConfig(
        endpoint=source.endpoint,
        replay_endpoint=source.replay_endpoint,
        topic=source.topic,
        block_size=source.block_size,
        engine=engine_spec(source.engine).name,
        dp_rank=source.dp_rank,
        model=source.model,
    )


async def capture(
    writer: RecordingWriter,
    sources: Sequence[Source],
    *,
    duration_s: float | None = None,
    max_bytes: int | None = None,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[Capture], None] | None = None,
    on_tick: Callable[[Capture], None] | None = None,
    tick_s: float = 0.5,
) -> CaptureStats:
    """Record `sources` until `duration_s`, `max_bytes`, `stop` or a write error.

    Flushes every `tick_s` (and calls `on_tick`, e.g. a progress display). The writer is
    closed on return, whatever happened, so the file ends at a complete record.
    """
    started = time.monotonic()
    async with Capture(writer, sources, max_bytes=max_bytes) as running:
        if on_ready is not None:
            on_ready(running)
        while not running.stop.is_set():
            if stop is not None and stop.is_set():
                running.stop_by("stop")
                break
            remaining = None if duration_s is None else started + duration_s - time.monotonic()
            if remaining is not None and remaining <= 0:
                running.stop_by("duration")
                break
            tick = tick_s if remaining is None else min(tick_s, remaining)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await (stop or running.stop).wait()
            running.flush()
            if on_tick is not None:
                on_tick(running)
    running.stats.seconds = time.monotonic() - started
    return running.stats
