"""The recording file format: raw KV-event messages with receive times, appendable and crash-safe.

A recording is what `kvroute record` captured: every message a subscriber accepted, live or
replayed, with its exact payload bytes (malformed ones included), so an offline replay sees
precisely what the live router saw. Pure file I/O: no zmq, no asyncio.

Layout (all integers little-endian; `docs/recording.md` has the full description)::

    magic  b"\\x89KVREC\\r\\n"                                  8 bytes, once
    frame  sync b"KVR\\xfe" | kind u8 | flags u8 | reserved u16 |
           length u32 | count u32 | first_record u64 | time f64 | crc32 u32   36 bytes
           body (length bytes)

The first frame is the header (`H`); then `R` (one record), `Z` (a zlib chunk of records) and
`S` (sources added when a later session appends) frames. The CRC covers the frame header after
the sync word and the body, so a torn or damaged frame is detected and reading stops right before
it. Every frame says its receive time and absolute record number, and receive times never
decrease inside a file, so a reader bisects by time over file offsets (re-synchronising on the
sync word) without an index. Each uncompressed record is written with one `write` call, so a
crash of the recorder loses at most the record being written.

Longer than the house's ~500 lines on purpose: the frame codec, the reader and the writer are
one file format, each side written against the other.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import struct
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Annotated, BinaryIO, Literal, Self

import msgspec

from indexer.errors import IndexerError
from indexer.protocol.wire import MAX_BLOCK_SIZE

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Damage",
    "Positioned",
    "Record",
    "RecordMark",
    "RecordingError",
    "RecordingHeader",
    "RecordingReader",
    "RecordingWriter",
    "Source",
]

FORMAT_VERSION = 3
# version 1 had no `Record.run_start`: its replay runs that follow each other read as one;
# version 2 had no `Record.mark`: the clears its subscriber decided are not in the file
_READABLE_VERSIONS = (1, 2, 3)
# the first version whose records carry the subscriber's clears (`RecordMark`)
MARKS_VERSION = 3
MAGIC = b"\x89KVREC\r\n"
_SYNC = b"KVR\xfe"
# sync, kind, flags, reserved, length, count, first_record, time, crc
_FRAME = struct.Struct("<4sBBHIIQdI")
_CRC_SPAN = slice(4, _FRAME.size - 4)
_KIND_HEADER = ord("H")
_KIND_SOURCES = ord("S")
_KIND_RECORD = ord("R")
_KIND_CHUNK = ord("Z")
_KINDS = {_KIND_HEADER, _KIND_SOURCES, _KIND_RECORD, _KIND_CHUNK}
_FLAG_ZLIB = 1
# A frame longer than this is damage, not data: ZMQ payloads of KV events are kilobytes.
_MAX_FRAME = 64 * 1024 * 1024
_RESYNC_WINDOW = 64 * 1024


class RecordingError(IndexerError):
    """A file that is not a kvroute recording, has an unsupported version, or cannot be written."""


class Source(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded stream: a (worker, dp rank) publisher."""

    stream: str
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    engine: str = "sglang"
    # bounded as a worker's config is (a replay indexes by it: `indexer.namespace`)
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)] | None = None
    dp_rank: int = 0
    model: str = ""
    worker: str = ""


class RecordingHeader(msgspec.Struct, frozen=True, kw_only=True):
    """The first frame of every recording."""

    format_version: int = FORMAT_VERSION
    created_unix_s: float
    sources: list[Source] = []
    tool: str = "kvroute"


class RecordMark(enum.IntEnum):
    """What a record is: a message, or a decision the recorder's subscriber made (version 3).

    A subscriber clears a stream for reasons the messages alone do not always show (a new
    session's replay that starts right after the file's last seq yet proves nothing, a
    replay socket found to be another publisher's): without the mark, an offline replay
    would take the seqs as continuous and keep what the live index dropped."""

    MESSAGE = 0  # an accepted message: `seq`, `payload`, `replayed`, `run_start`
    CLEAR = 1  # the stream's entries were dropped (`StreamSink.clear`)
    FORGET_SEQ = 2  # no seq and no fence are known any more: rebuilt from 0 (a restart)


class Record(msgspec.Struct, frozen=True, array_like=True, gc=False, omit_defaults=True):
    """One accepted message exactly as it arrived; `replayed` marks gap-repair replies.

    `run_start` marks the first record of a replay run that the subscriber counted (a gap
    repair, or an idle probe that found batches): two runs can follow each other with no live
    record between them (the live copies were duplicates of what the first run brought), and
    only this flag tells them apart. Trailing defaults are not written, so a record without the
    flag is laid out as in version 1.
    """

    recv_time: float
    stream: str
    topic: bytes
    seq: int
    payload: bytes
    replayed: bool = False
    run_start: bool = False
    # not a message but a subscriber's decision (version 3): `seq` is the stream's last
    # recorded seq then (0: none), `topic` and `payload` are empty
    mark: RecordMark = RecordMark.MESSAGE


class Positioned(msgspec.Struct, frozen=True, gc=False):
    """A record with its absolute number in the file and the offset of the frame holding it."""

    number: int
    offset: int
    record: Record


class Damage(msgspec.Struct, frozen=True):
    """Where and why reading stopped before the end of the file.

    `offset` is the byte offset of the bad frame; `record` the number of the first record not
    read (every record before it was read), -1 when unknown (reading started at a seek).
    """

    offset: int
    record: int
    kind: Literal["truncated", "corrupt"]
    reason: str


class _Frame(msgspec.Struct, frozen=True, gc=False):
    offset: int
    kind: int
    flags: int
    count: int
    first_record: int
    time: float
    body: bytes

    @property
    def end(self) -> int:
        return self.offset + _FRAME.size + len(self.body)


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(RecordingHeader)
_sources_decoder = msgspec.msgpack.Decoder(list[Source])
_record_decoder = msgspec.msgpack.Decoder(Record)
_chunk_decoder = msgspec.msgpack.Decoder(list[Record])


def _pack_frame(
    kind: int, body: bytes, *, flags: int = 0, count: int = 0, first: int = 0, at: float = 0.0
) -> bytes:
    head = _FRAME.pack(_SYNC, kind, flags, 0, len(body), count, first, at, 0)
    crc = zlib.crc32(body, zlib.crc32(head[_CRC_SPAN]))
    return head[:-4] + crc.to_bytes(4, "little") + body


class _FrameError(Exception):
    def __init__(self, kind: Literal["truncated", "corrupt"], reason: str) -> None:
        super().__init__(reason)
        self.kind: Literal["truncated", "corrupt"] = kind
        self.reason = reason


def _read_frame(f: BinaryIO, offset: int) -> _Frame | None:
    """The frame at `offset`; None at a clean end of file; _FrameError on damage."""
    head = f.read(_FRAME.size)
    if not head:
        return None
    if len(head) < _FRAME.size:
        raise _FrameError("truncated", f"frame header cut after {len(head)} bytes")
    sync, kind, flags, _, length, count, first, at, crc = _FRAME.unpack(head)
    if sync != _SYNC:
        raise _FrameError("corrupt", "no frame sync word")
    if kind not in _KINDS or length > _MAX_FRAME:
        raise _FrameError("corrupt", f"bad frame kind {kind} or length {length}")
    body = f.read(length)
    if len(body) < length:
        raise _FrameError("truncated", f"frame body cut at {len(body)} of {length} bytes")
    if zlib.crc32(body, zlib.crc32(head[_CRC_SPAN])) != crc:
        raise _FrameError("corrupt", "frame checksum mismatch")
    return _Frame(offset, kind, flags, count, first, at, body)


def _decode_records(frame: _Frame) -> list[Record]:
    """The records a R or Z frame holds; _FrameError when the body does not decode."""
    try:
        if frame.kind == _KIND_RECORD:
            return [_record_decoder.decode(frame.body)]
        body = zlib.decompress(frame.body) if frame.flags & _FLAG_ZLIB else frame.body
        records = _chunk_decoder.decode(body)
    except (msgspec.DecodeError, zlib.error) as exc:
        raise _FrameError("corrupt", f"record body does not decode: {exc}") from exc
    if len(records) != frame.count:
        raise _FrameError("corrupt", f"chunk holds {len(records)} records, says {frame.count}")
    return records


class RecordingReader:
    """Reads a recording front to back (or from a time), stopping cleanly at the first damage.

    A file that is still being written reads up to its last complete frame; a torn last frame
    is reported in `damage` like any other, so callers decide whether it matters.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: BinaryIO = self.path.open("rb", buffering=1024 * 1024)
        try:
            self.header, self._data_start = self._read_header()
        except Exception:
            self._file.close()
            raise
        self.sources: dict[str, Source] = {s.stream: s for s in self.header.sources}
        self.damage: Damage | None = None
        self.end_offset = self._data_start
        self.records_read = 0

    def _read_header(self) -> tuple[RecordingHeader, int]:
        if self._file.read(len(MAGIC)) != MAGIC:
            raise RecordingError(f"{self.path}: not a kvroute recording (bad magic)")
        try:
            frame = _read_frame(self._file, len(MAGIC))
        except _FrameError as exc:
            raise RecordingError(f"{self.path}: damaged header: {exc.reason}") from exc
        if frame is None or frame.kind != _KIND_HEADER:
            raise RecordingError(f"{self.path}: the header frame is missing")
        try:
            header = _header_decoder.decode(frame.body)
        except msgspec.DecodeError as exc:
            raise RecordingError(f"{self.path}: header does not decode: {exc}") from exc
        if header.format_version not in _READABLE_VERSIONS:
            readable = " and ".join(str(v) for v in _READABLE_VERSIONS)
            raise RecordingError(
                f"{self.path}: format version {header.format_version} is not supported "
                f"(this kvroute reads versions {readable})"
            )
        return header, frame.end

    def close(self) -> None:
        """Release the file."""
        self._file.close()

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _frames(self, offset: int) -> Iterator[_Frame]:
        """Frames from `offset` on; records damage and stops at the first bad one."""
        self.damage = None
        self._file.seek(offset)
        # -1: unknown, when reading started at a bisected offset and no record frame came yet
        next_record = 0 if offset == self._data_start else -1
        while True:
            try:
                frame = _read_frame(self._file, offset)
            except _FrameError as exc:
                self.damage = Damage(offset, next_record, exc.kind, exc.reason)
                return
            if frame is None:
                return
            if frame.kind == _KIND_HEADER:
                self.damage = Damage(offset, next_record, "corrupt", "a second header")
                return
            if frame.kind in (_KIND_RECORD, _KIND_CHUNK):
                next_record = frame.first_record + frame.count
            offset = frame.end
            self.end_offset = offset
            yield frame

    def records(
        self, *, from_time: float | None = None, marks: bool = False
    ) -> Iterator[Positioned]:
        """Every record in file order, from the first with recv_time >= from_time when given.

        Only messages unless `marks`: the subscriber's decisions (`RecordMark`) are for the
        readers that rebuild its state (an offline replay, a republisher); a mark keeps its
        record number, so message numbers skip it."""
        start = self._data_start if from_time is None else self.offset_for_time(from_time)
        in_window = from_time is None
        while True:
            for frame in self._frames(start):
                if frame.kind == _KIND_SOURCES:
                    self._add_sources(frame)
                    continue
                try:
                    records = _decode_records(frame)
                except _FrameError as exc:
                    self.damage = Damage(frame.offset, frame.first_record, exc.kind, exc.reason)
                    self.end_offset = frame.offset
                    break
                for i, record in enumerate(records):
                    if from_time is not None and record.recv_time < from_time:
                        continue
                    in_window = True
                    if record.mark and not marks:
                        continue
                    self.records_read += 1
                    yield Positioned(frame.first_record + i, frame.offset, record)
            resumed = None if in_window else self._past_damage(from_time)
            if resumed is None:
                return
            start = resumed

    def _past_damage(self, from_time: float | None) -> int | None:
        """Where a time window's read goes on after damage met before its first record: the
        next good frame, if its records are still before the window (receive times never
        decrease, so the damaged frame held none of the window's); None: stop there. The seek
        lands up to 64 KiB before the window, so damage in that stretch stopped the read with
        nothing of the window read (and said it was the window's). The caller learns of the
        damage from its scan of what lies before the window (`replay.before_window`)."""
        damage = self.damage
        if from_time is None or damage is None:
            return None
        frame = self._frame_near(damage.offset + 1)
        if frame is None or frame.time >= from_time:
            return None
        return frame.offset

    def __iter__(self) -> Iterator[Positioned]:
        return self.records()

    def _add_sources(self, frame: _Frame) -> None:
        try:
            added = _sources_decoder.decode(frame.body)
        except msgspec.DecodeError:
            return  # sources are metadata; records stay readable without them
        for source in added:
            self.sources.setdefault(source.stream, source)

    def _frame_near(self, offset: int) -> _Frame | None:
        """The first valid record frame at or after `offset` (sync word + checksum agree)."""
        self._file.seek(offset)
        window = self._file.read(_RESYNC_WINDOW + _FRAME.size)
        pos = 0
        while True:
            at = window.find(_SYNC, pos)
            if at < 0 or at > _RESYNC_WINDOW:
                return None
            self._file.seek(offset + at)
            try:
                frame = _read_frame(self._file, offset + at)
            except _FrameError:
                frame = None
            if frame is not None and frame.kind in (_KIND_RECORD, _KIND_CHUNK):
                return frame
            pos = at + 1

    def offset_for_time(self, at: float) -> int:
        """A frame offset from which reading finds every record with recv_time >= `at`.

        Bisects over file offsets, re-synchronising on the sync word; receive times never
        decrease inside a file, so O(log size) small reads replace a scan.
        """
        lo = self._data_start
        hi = self.path.stat().st_size
        while hi - lo > _RESYNC_WINDOW:
            mid = (lo + hi) // 2
            frame = self._frame_near(mid)
            if frame is None or frame.time >= at:
                hi = mid
            else:
                lo = frame.offset
        return lo


class RecordingWriter:
    """Appends records to a recording; use `create` or `append`, then `write`, `flush`, `close`.

    Uncompressed records go to the OS with one `write` each (nothing buffered in the process)
    unless `buffer_bytes` asks for batching (bulk generation). With `compress`, records are
    gathered into zlib chunks of up to `chunk_records` or `chunk_interval_s`; an open chunk is
    what a crash can lose, so `flush` regularly. A write that fails loses the records it
    carried (the open chunk, the buffer) and they are not counted: `records` and
    `records_written` always say what the file holds.

    A writer holds an exclusive advisory lock (`flock`) on its file until `close`: a second
    writer, in this process or another, is refused instead of interleaving its frames with
    the first one's (which corrupts the file for every reader).
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        *,
        next_record: int,
        last_time: float,
        known: Iterable[Source],
        compress: bool,
        chunk_records: int,
        chunk_interval_s: float,
        buffer_bytes: int,
        version: int = FORMAT_VERSION,
    ) -> None:
        self.path = path
        self._fd = fd
        # a version-1 file appended to stays version 1: its records carry no run starts
        self._run_starts = version >= 2
        self._marks = version >= MARKS_VERSION  # nor clears (a version-2 file is upgraded)
        self.version = version
        self._next = next_record
        self._last_time = last_time
        self._known = {s.stream: s for s in known}
        self._compress = compress
        self._chunk_records = max(1, chunk_records)
        self._chunk_interval_s = chunk_interval_s
        self._chunk: list[Record] = []
        self._chunk_started = 0.0
        self._buffer = bytearray()
        self._buffered_records = 0  # records in `_buffer`, lost with it if its write fails
        self._buffered_marks = 0  # of which the subscriber's marks
        self._buffer_bytes = buffer_bytes
        self.bytes_written = os.lseek(fd, 0, os.SEEK_END)
        self.records_written = 0
        # of `records_written`, the subscriber's marks (`write_mark`): decisions, not messages
        self.marks_written = 0
        self._earlier_marks = 0  # `append`: the marks earlier sessions wrote
        # `append`: the damaged tail it cut before writing, and how many bytes it was
        self.cut: Damage | None = None
        self.cut_bytes = 0
        # `append`: each stream's last record in the file, so a capture continues from it
        self.last_records: dict[str, Record] = {}
        # the records of compressed chunks whose write failed (not counted in `records`): who
        # counted them per stream (a capture's summary) counts them out
        self.lost_records: list[Record] = []

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        sources: Iterable[Source] = (),
        *,
        overwrite: bool = False,
        compress: bool = False,
        chunk_records: int = 256,
        chunk_interval_s: float = 1.0,
        buffer_bytes: int = 0,
    ) -> Self:
        """Start a new recording at `path` (refuses to replace a file unless `overwrite`)."""
        path = Path(path)
        # no O_TRUNC: an overwrite truncates only once the lock is ours (not a live writer's file)
        flags = os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_EXCL)
        try:
            # owner only: the events carry the tenants' salts in clear (secrets)
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            why = "it is a directory" if path.is_dir() else exc.strerror
            if isinstance(exc, FileExistsError) and not path.is_dir():
                why = "it exists (append to it, or choose another name)"
            raise RecordingError(f"{path}: cannot create: {why}") from exc
        try:
            _lock(fd, path)
            source_list = list(sources)
            if (conflict := _conflicts({}, source_list)) is not None:
                raise RecordingError(f"{path}: {conflict}")
            if overwrite:
                os.ftruncate(fd, 0)
                os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
            header = RecordingHeader(created_unix_s=time.time(), sources=source_list)
            head = MAGIC + _pack_frame(
                _KIND_HEADER, _encoder.encode(header), at=header.created_unix_s
            )
            _write_all(fd, head)
        except BaseException:
            os.close(fd)
            if not overwrite:
                with contextlib.suppress(OSError):
                    path.unlink()  # ours, made above: no half-made file stays
            raise
        return cls(
            path,
            fd,
            next_record=0,
            last_time=0.0,
            known=source_list,
            compress=compress,
            chunk_records=chunk_records,
            chunk_interval_s=chunk_interval_s,
            buffer_bytes=buffer_bytes,
        )

    @classmethod
    def append(
        cls,
        path: str | os.PathLike[str],
        sources: Iterable[Source] = (),
        *,
        compress: bool = False,
        chunk_records: int = 256,
        chunk_interval_s: float = 1.0,
        buffer_bytes: int = 0,
    ) -> Self:
        """Continue an existing recording, new sources added. A damaged tail (the last frame
        cut short by a crash or a failed write, or unreadable) is cut off first (`cut` says
        where and why); damage with readable frames after it is refused (RecordingError):
        frames appended after it would be unreachable to every reader, and cutting it would
        throw away what follows it. So is a source whose stream the file already records from
        another publisher (its events would continue another worker's stream), and a file
        another writer has open. `last_records` says where each stream of the file ends."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as exc:  # missing, a directory, not writable
            raise RecordingError(f"{path}: cannot append: {exc.strerror or exc}") from exc
        try:
            # locked before it is read: a live writer's frames would be cut as a "damaged tail"
            _lock(fd, path)
            scan = _scan_for_append(path)
            sources = list(sources)
            if (conflict := _conflicts(scan.known, sources)) is not None:
                raise RecordingError(f"{path}: cannot append: {conflict}")
            cut_bytes = os.fstat(fd).st_size - scan.valid_end
            os.ftruncate(fd, scan.valid_end)  # the damaged tail, if any
        except BaseException:
            os.close(fd)
            raise
        writer = cls(
            path,
            fd,
            next_record=scan.next_record,
            last_time=scan.last_time,
            known=scan.known.values(),
            compress=compress,
            chunk_records=chunk_records,
            chunk_interval_s=chunk_interval_s,
            buffer_bytes=buffer_bytes,
            version=_upgrade(path, scan.version),
        )
        if scan.damage is not None and cut_bytes > 0:
            writer.cut, writer.cut_bytes = scan.damage, cut_bytes
        writer.last_records = scan.last_records
        writer._earlier_marks = scan.marks
        try:
            writer.add_sources(sources)
        except BaseException:
            writer.close()
            raise
        return writer

    @property
    def records(self) -> int:
        """Records in the file so far, counting earlier sessions (marks included: they take
        record numbers too)."""
        return self._next

    @property
    def messages(self) -> int:
        """Messages in the file so far, counting earlier sessions: its records less the
        subscriber's marks, what `kvroute record inspect` and `kvroute replay` count."""
        return self._next - self._earlier_marks - self.marks_written

    def add_sources(self, sources: Iterable[Source]) -> None:
        """Declare streams not yet in the file (an `S` frame; known streams are skipped).

        RecordingError, and nothing written, when one of them is a stream the file records
        from another publisher (`_conflicts`)."""
        sources = list(sources)
        if (conflict := _conflicts(self._known, sources)) is not None:
            raise RecordingError(f"{self.path}: {conflict}")
        new = [s for s in sources if s.stream not in self._known]
        if not new:
            return
        self._emit(_pack_frame(_KIND_SOURCES, _encoder.encode(new), at=self._last_time))
        self._known.update((s.stream, s) for s in new)

    def write(
        self,
        stream: str,
        topic: bytes,
        seq: int,
        payload: bytes,
        *,
        replayed: bool = False,
        run_start: bool = False,
        recv_time: float | None = None,
    ) -> int:
        """Record one message; returns its record number. Receive times are kept monotonic."""
        now = time.time() if recv_time is None else recv_time
        self._last_time = max(self._last_time, now)
        record = Record(
            self._last_time,
            stream,
            bytes(topic),
            seq,
            bytes(payload),
            replayed,
            run_start and replayed and self._run_starts,
        )
        return self._put(record)

    def write_mark(
        self, stream: str, mark: RecordMark, seq: int | None, *, recv_time: float | None = None
    ) -> int | None:
        """Record a decision of the subscriber on `stream` (its last seq then: `seq`); returns
        its record number, None in a file of a version without marks (nothing written)."""
        if not self._marks:
            return None
        now = time.time() if recv_time is None else recv_time
        self._last_time = max(self._last_time, now)
        return self._put(Record(self._last_time, stream, b"", seq or 0, b"", mark=mark))

    def _put(self, record: Record) -> int:
        number = self._next
        mark = int(bool(record.mark))
        if not self._compress:
            body = _encoder.encode(record)
            frame = _pack_frame(_KIND_RECORD, body, count=1, first=number, at=record.recv_time)
            self._next += 1
            self.records_written += 1
            self.marks_written += mark
            self._emit(frame, records=1, marks=mark)
            return number
        self._next += 1
        self.records_written += 1
        self.marks_written += mark
        if not self._chunk:
            self._chunk_started = time.monotonic()
        self._chunk.append(record)
        if (
            len(self._chunk) >= self._chunk_records
            or time.monotonic() - self._chunk_started >= self._chunk_interval_s
        ):
            try:
                self._close_chunk()
            except RecordingError:
                # this one's write raises: no caller counted it, none is to count it out
                self.lost_records.pop()
                raise
        return number

    def _close_chunk(self) -> None:
        if not self._chunk:
            return
        chunk, self._chunk = self._chunk, []
        body = zlib.compress(_encoder.encode(chunk), 6)
        first = self._next - len(chunk)
        frame = _pack_frame(
            _KIND_CHUNK,
            body,
            flags=_FLAG_ZLIB,
            count=len(chunk),
            first=first,
            at=chunk[0].recv_time,
        )
        try:
            self._emit(frame, records=len(chunk), marks=sum(1 for r in chunk if r.mark))
        except RecordingError:
            self.lost_records.extend(chunk)
            raise

    def _emit(self, frame: bytes, *, records: int = 0, marks: int = 0) -> None:
        """Write `frame` (holding `records` records, `marks` of them marks, already counted;
        uncounted if it fails)."""
        if len(frame) - _FRAME.size > _MAX_FRAME:
            # readers treat longer frames as damage; refuse rather than write an unreadable tail
            self._lost(records, marks)
            raise RecordingError(f"a frame of {len(frame)} bytes exceeds the format's limit")
        if self._buffer_bytes <= 0:
            try:
                _write_all(self._fd, frame)
            except RecordingError:
                self._lost(records, marks)
                raise
            self.bytes_written += len(frame)
            return
        self._buffer += frame
        self._buffered_records += records
        self._buffered_marks += marks
        if len(self._buffer) >= self._buffer_bytes:
            self._drain()

    def _drain(self) -> None:
        if not self._buffer:
            return
        data, records, marks = bytes(self._buffer), self._buffered_records, self._buffered_marks
        # gone whatever happens: written, or lost with the failed write (never written twice
        # under record numbers a later write reuses)
        self._buffer.clear()
        self._buffered_records = self._buffered_marks = 0
        try:
            _write_all(self._fd, data)
        except RecordingError:
            self._lost(records, marks)
            raise
        self.bytes_written += len(data)

    def _lost(self, records: int, marks: int) -> None:
        """`records` counted records (the last ones numbered), `marks` of them marks, did not
        reach the file."""
        self._next -= records
        self.records_written -= records
        self.marks_written -= marks

    def flush(self) -> None:
        """Hand everything written so far to the OS (closes an open compressed chunk)."""
        self._close_chunk()
        self._drain()

    def sync(self) -> None:
        """`flush`, then ask the OS to put the file on disk."""
        self.flush()
        os.fsync(self._fd)

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _upgrade(path: Path, version: int) -> int:
    """The version an appended file is written in: a version-2 file becomes version 3 (its
    header rewritten in place, same length), so the sessions appended to it record the
    subscriber's clears; its records read alike in both (they carry no marks). A header that
    would not keep its length (written by a build with other header fields) stays as it was."""
    if version != 2:
        return version
    with path.open("r+b") as f:
        f.seek(len(MAGIC))
        try:
            frame = _read_frame(f, len(MAGIC))
        except _FrameError:
            return version
        if frame is None or frame.kind != _KIND_HEADER:
            return version
        header = msgspec.structs.replace(
            _header_decoder.decode(frame.body), format_version=MARKS_VERSION
        )
        body = _encoder.encode(header)
        if len(body) != len(frame.body):
            return version
        f.seek(len(MAGIC))
        f.write(_pack_frame(_KIND_HEADER, body, at=frame.time))
    return MARKS_VERSION


def _lock(fd: int, path: Path) -> None:
    """Take the writer's exclusive lock on `fd`, or RecordingError when another writer holds
    it. A filesystem without locks (some network mounts) writes unlocked, as before locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RecordingError(
            f"{path}: another writer has it open (a recorder still running?): two writers "
            "would interleave their frames and corrupt it; stop that one, or record to "
            "another file"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise RecordingError(f"{path}: cannot lock: {exc.strerror}") from exc


def _conflicts(known: dict[str, Source], sources: Iterable[Source]) -> str | None:
    """Why `sources` cannot be recorded into a file declaring `known` (None: they can).

    A stream id stands for one publisher: events of another endpoint (another worker, left
    at the default `--worker`) under it would read as that stream's restarts and gaps, and
    the other worker's blocks would be indexed as this one's. An unknown block size (None)
    on either side is no difference: it is learned from the events."""
    seen = dict(known)
    for source in sources:
        before = seen.setdefault(source.stream, source)
        differ = [
            (name, getattr(before, name), getattr(source, name))
            for name in before.__struct_fields__
            if getattr(before, name) != getattr(source, name)
            and not (name == "block_size" and None in (before.block_size, source.block_size))
        ]
        if differ:
            return (
                f"stream {source.stream} is recorded from another source: the file has "
                + ", ".join(f"{name} {was!r}" for name, was, _ in differ)
                + "; this session has "
                + ", ".join(f"{name} {now!r}" for name, _, now in differ)
                + " (give this worker its own id, --worker, or record to another file)"
            )
    return None


class _AppendScan(msgspec.Struct, kw_only=True):
    """What `append` needs to know of a file before continuing it."""

    version: int
    known: dict[str, Source]
    next_record: int = 0
    marks: int = 0  # the subscriber's marks among the records
    last_time: float = 0.0
    valid_end: int = 0
    damage: Damage | None = None
    last_records: dict[str, Record] = {}


def _scan_for_append(path: Path) -> _AppendScan:
    """Read the whole of `path`: its streams, record count, last time, each stream's last
    record, and where its valid frames end (RecordingError on damage it must not cut)."""
    try:
        opened = RecordingReader(path)
    except OSError as exc:
        raise RecordingError(f"{path}: cannot append: {exc.strerror or exc}") from exc
    with opened as reader:
        scan = _AppendScan(
            version=reader.header.format_version, known={}, valid_end=reader._data_start
        )
        for frame in reader._frames(reader._data_start):
            if frame.kind == _KIND_SOURCES:
                reader._add_sources(frame)
            elif frame.count:
                try:
                    records = _decode_records(frame)
                except _FrameError as exc:
                    scan.damage = Damage(frame.offset, frame.first_record, exc.kind, exc.reason)
                    break
                for record in records:
                    scan.marks += bool(record.mark)
                    if not record.mark:
                        scan.last_records[record.stream] = record
                    elif record.mark is RecordMark.FORGET_SEQ:
                        # rebuilt from 0: the next session joins, nothing to continue from
                        scan.last_records.pop(record.stream, None)
                scan.last_time = max(scan.last_time, frame.time, records[-1].recv_time)
                scan.next_record = frame.first_record + frame.count
            scan.valid_end = frame.end
        scan.damage = scan.damage or reader.damage
        if scan.damage is not None:
            _refuse_to_cut(path, reader._file, scan.damage)
        scan.known = dict(reader.sources)
    return scan


def _refuse_to_cut(path: Path, f: BinaryIO, damage: Damage) -> None:
    """RecordingError when a whole frame follows `damage` somewhere in the file: cutting
    the damage off would throw that away too. Otherwise the damage is the file's tail (a
    frame cut short by a crash or a failed write, or a last frame that does not read) and
    may go."""
    size = os.fstat(f.fileno()).st_size
    if _next_whole_frame(f, damage.offset + 1, size) is None:
        return
    raise RecordingError(
        f"{path}: damaged at byte {damage.offset:,} ({damage.reason}), with readable frames "
        f"after it: appending would cut the {size - damage.offset:,} bytes from there on; "
        "record to a new file instead (readers read everything before the damage)"
    )


def _next_whole_frame(f: BinaryIO, start: int, size: int) -> int | None:
    """The offset of the first frame at or after `start` whose checksum holds, if any."""
    step = 1 << 20
    offset = start
    while offset < size:
        f.seek(offset)
        block = f.read(step + len(_SYNC) - 1)
        at = block.find(_SYNC)
        while at >= 0:
            f.seek(offset + at)
            with contextlib.suppress(_FrameError):
                if _read_frame(f, offset + at) is not None:
                    return offset + at
            at = block.find(_SYNC, at + 1)
        offset += step
    return None


def _write_all(fd: int, data: bytes) -> None:
    """Write `data` whole, or leave the file as it was: a write that fails part way (a full
    disk, a file size limit) is cut back, so the file still ends on a whole frame."""
    view = memoryview(data)
    start = -1
    try:
        start = os.lseek(fd, 0, os.SEEK_CUR)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        if start >= 0 and len(view) < len(data):
            with contextlib.suppress(OSError):  # best effort: readers stop at a torn tail
                os.ftruncate(fd, start)
                os.lseek(fd, start, os.SEEK_SET)
        raise RecordingError(f"write failed: {exc.strerror}") from exc
