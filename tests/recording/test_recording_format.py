"""The recording file format: exact bytes back, appendable, crash-safe, seekable by time."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pytest

from indexer.protocol import Stored, decode_batch
from indexer.recording.format import (
    MAGIC,
    Record,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    RecordMark,
    Source,
)

# written by the version-1 writer (kvroute before 2026-12-04): six records of stream w0#dp0,
# seqs 0-5, one stored page each, seqs 2-5 replayed
VERSION_1 = Path(__file__).resolve().parent.parent / "fixtures" / "recordings" / "version1.kvrec"

SOURCES = [
    Source(stream="w0/0", endpoint="tcp://127.0.0.1:5557", topic="kv", block_size=16),
    Source(stream="w1/0", endpoint="tcp://127.0.0.1:5558", engine="vllm", dp_rank=0),
]


def _payloads(rng: random.Random, n: int) -> list[bytes]:
    # msgpack-looking and plain garbage alike: the format must not care
    return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))) for _ in range(n)]


def _write(path: Path, payloads: list[bytes], *, compress: bool, t0: float = 1000.0) -> None:
    with RecordingWriter.create(path, SOURCES, compress=compress, chunk_records=7) as writer:
        for i, payload in enumerate(payloads):
            stream = SOURCES[i % 2].stream
            writer.write(stream, b"kv", i // 2, payload, replayed=i % 5 == 0, recv_time=t0 + i)


def _read_all(path: Path) -> tuple[list[Record], RecordingReader]:
    with RecordingReader(path) as reader:
        records = [p.record for p in reader]
    return records, reader


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_keeps_exact_bytes_and_metadata(tmp_path: Path, compress: bool) -> None:
    rng = random.Random(1)
    payloads = [*_payloads(rng, 60), b"", b"\xc1", b"\x93\xcb"]
    path = tmp_path / "r.kvrec"
    _write(path, payloads, compress=compress)
    records, reader = _read_all(path)
    assert reader.damage is None
    assert reader.header.format_version == 3
    assert list(reader.sources.values()) == SOURCES
    assert [r.payload for r in records] == payloads
    assert [r.seq for r in records] == [i // 2 for i in range(len(payloads))]
    assert [r.replayed for r in records] == [i % 5 == 0 for i in range(len(payloads))]
    assert [r.stream for r in records[:2]] == ["w0/0", "w1/0"]
    assert all(r.topic == b"kv" for r in records)


def test_receive_times_never_decrease(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    with RecordingWriter.create(path) as writer:
        for t in (5.0, 3.0, 7.0, 6.0):
            writer.write("s", b"", 0, b"x", recv_time=t)
    records, _ = _read_all(path)
    assert [r.recv_time for r in records] == [5.0, 5.0, 7.0, 7.0]


def test_a_reader_sees_what_a_live_writer_wrote(tmp_path: Path) -> None:
    path = tmp_path / "live.kvrec"
    with RecordingWriter.create(path, SOURCES) as writer:
        writer.write("w0/0", b"", 0, b"a")
        writer.write("w0/0", b"", 1, b"b")
        # no flush, no close: uncompressed records reach the OS one write each
        assert [r.payload for r in _read_all(path)[0]] == [b"a", b"b"]
        writer.write("w0/0", b"", 2, b"c")
        assert len(_read_all(path)[0]) == 3


def test_compressed_chunks_are_readable_after_flush(tmp_path: Path) -> None:
    path = tmp_path / "z.kvrec"
    with RecordingWriter.create(path, compress=True, chunk_records=1000) as writer:
        for i in range(10):
            writer.write("s", b"", i, b"p%d" % i)
        assert _read_all(path)[0] == []
        writer.flush()
        assert len(_read_all(path)[0]) == 10


@pytest.mark.parametrize("compress", [False, True])
def test_truncations_read_up_to_the_damage(tmp_path: Path, compress: bool) -> None:
    rng = random.Random(2)
    payloads = _payloads(rng, 16)
    full = tmp_path / "full.kvrec"
    _write(full, payloads, compress=compress)
    data = full.read_bytes()
    with RecordingReader(full) as reader:
        positions = list(reader)
        data_start = reader._data_start
    # every frame boundary: records of complete frames survive, the cut frame is reported
    frame_ends = sorted({p.offset for p in positions} | {len(data)})
    cut = tmp_path / "cut.kvrec"
    # every cut that matters: around each frame boundary, inside headers, inside bodies
    sizes = {data_start}
    for start in frame_ends:
        sizes.update(start + d for d in (-1, 1, 4, 17, 35, 36, 37, 80))
    for size in sorted(x for x in sizes if data_start <= x < len(data)):
        cut.write_bytes(data[:size])
        with RecordingReader(cut) as reader:
            got = list(reader)
        complete = [p for p in positions if _frame_end(frame_ends, p.offset) <= size]
        assert [p.number for p in got] == [p.number for p in complete], size
        if size in frame_ends:
            assert reader.damage is None
        else:
            assert reader.damage is not None
            assert reader.damage.kind == "truncated"
            assert reader.damage.offset == max([data_start, *(e for e in frame_ends if e <= size)])
            assert reader.damage.record == len(complete)


def _frame_end(frame_starts: list[int], offset: int) -> int:
    return next(s for s in frame_starts if s > offset)


def test_corruption_stops_at_the_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "c.kvrec"
    _write(path, [b"payload-%d" % i for i in range(20)], compress=False)
    with RecordingReader(path) as reader:
        positions = list(reader)
    victim = positions[12]
    data = bytearray(path.read_bytes())
    data[victim.offset + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    with RecordingReader(path) as reader:
        got = list(reader)
    assert [p.number for p in got] == list(range(12))
    assert reader.damage is not None
    assert (reader.damage.kind, reader.damage.offset, reader.damage.record) == (
        "corrupt",
        victim.offset,
        12,
    )


def test_append_cuts_a_torn_tail_and_continues_numbering(tmp_path: Path) -> None:
    path = tmp_path / "a.kvrec"
    _write(path, [b"one", b"two", b"three"], compress=False)
    with path.open("ab") as f:
        f.write(b"KVR\xfe\x52garbage-of-a-crash")
    extra = Source(stream="w9/1", endpoint="tcp://127.0.0.1:6000", dp_rank=1)
    with RecordingWriter.append(path, [SOURCES[0], extra], compress=True) as writer:
        assert writer.records == 3
        writer.write("w9/1", b"", 0, b"four", recv_time=1.0)
    with RecordingReader(path) as reader:
        got = list(reader)
        assert reader.damage is None
        assert reader.sources["w9/1"] == extra
        assert len(reader.sources) == 3
    assert [p.record.payload for p in got] == [b"one", b"two", b"three", b"four"]
    assert [p.number for p in got] == [0, 1, 2, 3]
    # time stays monotonic across sessions even when the new clock reads earlier
    assert got[3].record.recv_time == got[2].record.recv_time


@pytest.mark.parametrize("compress", [False, True])
def test_append_refuses_damage_with_readable_frames_after_it(
    tmp_path: Path, compress: bool
) -> None:
    path = tmp_path / "a.kvrec"
    _write(path, [f"record {i}".encode() * 20 for i in range(30)], compress=compress)
    with RecordingReader(path) as reader:
        frames = list(reader._frames(reader._data_start))
    victim = frames[len(frames) // 2]
    data = bytearray(path.read_bytes())
    data[victim.offset + 40] ^= 0xFF  # a flipped bit in the middle of the file
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match=f"damaged at byte {victim.offset:,} .*readable"):
        RecordingWriter.append(path)
    assert path.read_bytes() == bytes(data)  # nothing cut, nothing written


def test_append_cuts_a_damaged_last_frame_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "a.kvrec"
    _write(path, [b"one", b"two", b"three"], compress=False)
    with RecordingReader(path) as reader:
        last = list(reader._frames(reader._data_start))[-1]
    data = bytearray(path.read_bytes())
    data[last.offset + 40] ^= 0xFF  # the last record does not read, and nothing follows it
    path.write_bytes(bytes(data))
    with RecordingWriter.append(path) as writer:
        assert writer.cut is not None and writer.cut.offset == last.offset
        assert writer.cut_bytes == len(data) - last.offset
        assert writer.records == 2
    with RecordingWriter.append(path) as writer:  # a clean file: nothing cut
        assert (writer.cut, writer.cut_bytes) == (None, 0)


def test_append_to_a_missing_file_or_a_directory_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match=r"missing\.kvrec: cannot append"):
        RecordingWriter.append(tmp_path / "missing.kvrec")
    with pytest.raises(RecordingError, match="cannot append"):
        RecordingWriter.append(tmp_path)


_FILL_TO_THE_LIMIT = """
import resource, signal, sys
from indexer.recording.format import RecordingError, RecordingWriter, Source
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit, write() fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))
writer = RecordingWriter.create(sys.argv[1], [Source(stream="w0/0")])
try:
    for seq in range(1000):
        writer.write("w0/0", b"kv", seq, bytes(range(256)) * 2)
except RecordingError as exc:
    print(writer.records, writer.bytes_written, exc)
"""


def test_a_write_that_fails_part_way_leaves_whole_frames(tmp_path: Path) -> None:
    # a real file size limit: the kernel writes part of the frame, then refuses the rest
    path = tmp_path / "limited.kvrec"
    done = subprocess.run(
        [sys.executable, "-c", _FILL_TO_THE_LIMIT, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent.parent,
    )
    records, written, error = done.stdout.split(maxsplit=2)
    assert "write failed" in error and int(records) > 0
    assert path.stat().st_size == int(written) < 1500
    got, reader = _read_all(path)
    assert reader.damage is None
    assert len(got) == int(records)


@pytest.mark.parametrize("compress", [False, True])
def test_run_starts_are_kept_on_replayed_records_only(tmp_path: Path, compress: bool) -> None:
    path = tmp_path / "r.kvrec"
    # (replayed, run_start) as written; a live record cannot start a replay run
    rows = [(False, False), (True, True), (True, False), (True, True), (False, True)]
    with RecordingWriter.create(path, SOURCES, compress=compress) as writer:
        for seq, (replayed, run_start) in enumerate(rows):
            writer.write("w0/0", b"kv", seq, b"p", replayed=replayed, run_start=run_start)
    records, reader = _read_all(path)
    assert reader.damage is None
    assert [(r.replayed, r.run_start) for r in records] == [
        (False, False),
        (True, True),
        (True, False),
        (True, True),
        (False, False),
    ]


def test_a_version_1_file_is_read_and_appended_to_as_version_1(tmp_path: Path) -> None:
    path = tmp_path / "v1.kvrec"
    shutil.copyfile(VERSION_1, path)
    records, reader = _read_all(path)
    assert reader.damage is None and reader.header.format_version == 1
    assert [(r.seq, r.replayed, r.run_start) for r in records] == [
        (seq, seq >= 2, False) for seq in range(6)
    ]
    stored = [decode_batch(r.payload).events[0] for r in records]
    assert [e.block_hashes for e in stored if isinstance(e, Stored)] == [
        [1000 + seq] for seq in range(6)
    ]
    with RecordingWriter.append(path) as writer:
        # a version-1 reader could not read the mark: the file stays what it was
        writer.write("w0#dp0", b"kv", 6, b"p", replayed=True, run_start=True)
        # nor a clear: written as a record, it would read as a message
        assert writer.write_mark("w0#dp0", RecordMark.CLEAR, 6) is None
    records, reader = _read_all(path)
    assert reader.damage is None and reader.header.format_version == 1
    assert (records[-1].seq, records[-1].replayed, records[-1].run_start) == (6, True, False)


def _set_version(path: Path, version: int) -> None:
    """Rewrite the header's `format_version` (a one-byte msgpack int), its CRC recomputed."""
    data = path.read_bytes()
    start = len(MAGIC)
    header = bytearray(data[start : start + 36])
    length = int.from_bytes(header[8:12], "little")
    body = bytearray(data[start + 36 : start + 36 + length])
    at = body.index(b"format_version") + len(b"format_version")
    body[at] = version
    crc = zlib.crc32(bytes(header[4:32]) + bytes(body))
    header[32:36] = crc.to_bytes(4, "little")
    path.write_bytes(MAGIC + bytes(header) + bytes(body) + data[start + 36 + length :])


def test_clear_marks_are_records_that_only_their_readers_see(tmp_path: Path) -> None:
    path = tmp_path / "marks.kvrec"
    with RecordingWriter.create(path, SOURCES[:1]) as writer:
        writer.write("w0/0", b"kv", 0, b"a", recv_time=1.0)
        assert writer.write_mark("w0/0", RecordMark.CLEAR, 0, recv_time=2.0) == 1
        writer.write("w0/0", b"kv", 1, b"b", recv_time=3.0)
        writer.write_mark("w0/0", RecordMark.FORGET_SEQ, 1, recv_time=4.0)
    records, _ = _read_all(path)
    assert [(r.seq, r.payload) for r in records] == [(0, b"a"), (1, b"b")]
    with RecordingReader(path) as reader:
        marked = [(p.number, p.record.mark) for p in reader.records(marks=True)]
    assert marked == [
        (0, RecordMark.MESSAGE),
        (1, RecordMark.CLEAR),
        (2, RecordMark.MESSAGE),
        (3, RecordMark.FORGET_SEQ),
    ]
    # the stream was rebuilt from 0 at its end: an append has nothing to continue from
    with RecordingWriter.append(path) as writer:
        assert writer.last_records == {}


def test_a_version_2_file_appended_to_becomes_version_3(tmp_path: Path) -> None:
    # version 3 only adds marks: the version-2 records read alike, and the sessions appended
    # record their subscriber's clears (an append is where a restart is found at the seam)
    path = tmp_path / "v2.kvrec"
    with RecordingWriter.create(path, SOURCES[:1]) as writer:
        writer.write("w0/0", b"kv", 0, b"a", recv_time=1.0)
    _set_version(path, 2)
    with RecordingReader(path) as reader:
        assert reader.header.format_version == 2
    with RecordingWriter.append(path) as writer:
        assert writer.last_records["w0/0"].seq == 0
        writer.write_mark("w0/0", RecordMark.CLEAR, 0)
    with RecordingReader(path) as reader:
        assert reader.header.format_version == 3
        marked = [p.record.mark for p in reader.records(marks=True)]
        assert reader.damage is None
    assert marked == [RecordMark.MESSAGE, RecordMark.CLEAR]


def test_an_unknown_version_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "v9.kvrec"
    data = VERSION_1.read_bytes()
    # the header's msgpack `format_version: 1` becomes 9, its frame CRC recomputed
    start = len(MAGIC)
    header = bytearray(data[start : start + 36])
    length = int.from_bytes(header[8:12], "little")
    body = bytearray(data[start + 36 : start + 36 + length])
    at = body.index(b"format_version") + len(b"format_version")
    assert body[at] == 1
    body[at] = 9
    crc = zlib.crc32(bytes(header[4:32]) + bytes(body))
    header[32:36] = crc.to_bytes(4, "little")
    path.write_bytes(MAGIC + bytes(header) + bytes(body) + data[start + 36 + length :])
    with pytest.raises(RecordingError, match="format version 9 is not supported"):
        RecordingReader(path)


@pytest.mark.parametrize("compress", [False, True])
def test_seek_by_time_finds_exactly_the_later_records(tmp_path: Path, compress: bool) -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    path = tmp_path / "t.kvrec"
    times: list[float] = []
    t = 100.0
    with RecordingWriter.create(path, compress=compress, chunk_records=50) as writer:
        for i in range(3000):
            t += rng.choice([0.0, 0.001, 0.5])
            times.append(t)
            writer.write("s", b"", i, bytes(rng.getrandbits(8) for _ in range(40)), recv_time=t)
    with RecordingReader(path) as reader:
        for _ in range(20):
            at = rng.uniform(99.0, t + 1.0)
            got = [p.number for p in reader.records(from_time=at)]
            assert got == [i for i, ti in enumerate(times) if ti >= at], at
            assert reader.damage is None


def test_not_a_recording_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"hello world, definitely not a recording")
    with pytest.raises(RecordingError, match="not a kvroute recording"):
        RecordingReader(path)
    path.write_bytes(MAGIC + b"\x00" * 10)
    with pytest.raises(RecordingError, match="header"):
        RecordingReader(path)


def test_a_page_size_no_worker_may_have_is_refused_by_name(tmp_path: Path) -> None:
    """A replay indexes a source's stream by its page size (packed into each namespace seed,
    a tuple of that many tokens a block: `indexer.namespace`): one no worker may have is
    refused when the file is opened, as a worker's config and the wire refuse it (2**16 the
    most). Before, it was taken as it was."""
    path = tmp_path / "big.kvrec"
    with RecordingWriter.create(path, [Source(stream="w0#dp0", block_size=2**40)]):
        pass  # a writer that did not check: the constructor does not
    with pytest.raises(RecordingError, match=r"<= 65536 - at `\$\.sources\[0\]\.block_size`"):
        RecordingReader(path)


def test_create_refuses_to_replace_a_file(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    RecordingWriter.create(path).close()
    with pytest.raises(RecordingError, match="cannot create: it exists"):
        RecordingWriter.create(path)
    RecordingWriter.create(path, overwrite=True).close()
    assert os.path.getsize(path) > len(MAGIC)
    with pytest.raises(RecordingError, match="cannot create: it is a directory"):
        RecordingWriter.create(tmp_path)


def test_append_cuts_a_chunk_whose_body_does_not_decode(tmp_path: Path) -> None:
    from indexer.recording.format import _KIND_CHUNK, _pack_frame

    path = tmp_path / "a.kvrec"
    _write(path, [b"one", b"two"], compress=False)
    # a frame intact on disk (checksum fine) but holding no records: readers stop before it
    with path.open("ab") as f:
        f.write(_pack_frame(_KIND_CHUNK, b"\xc1 not msgpack", count=1, first=2, at=2000.0))
    with RecordingWriter.append(path) as writer:
        assert writer.records == 2
        writer.write("w0/0", b"", 1, b"three", recv_time=1.0)
    with RecordingReader(path) as reader:
        got = [p.record.payload for p in reader]
        assert reader.damage is None
    assert got == [b"one", b"two", b"three"]


def test_a_recording_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """Its events carry the tenants' salts in clear: whatever the umask lets through."""
    path = tmp_path / "secret.kvrec"
    old = os.umask(0o022)
    try:
        with RecordingWriter.create(path, SOURCES):
            pass
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_file_has_one_writer_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "locked.kvrec"
    first = RecordingWriter.create(path, SOURCES)
    first.write("w0/0", b"kv", 0, b"first's")
    refused = "another writer has it open"
    with pytest.raises(RecordingError, match=refused):
        RecordingWriter.append(path, SOURCES)
    with pytest.raises(RecordingError, match=refused):
        RecordingWriter.create(path, SOURCES, overwrite=True)  # not truncated under it
    # another process, as a second `kvroute record --append` is
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from indexer.recording.format import RecordingWriter as W\n"
            "W.append(sys.argv[1])",
            str(path),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent.parent,
    )
    assert other.returncode != 0 and refused in other.stderr
    first.write("w0/0", b"kv", 1, b"first's again")
    first.close()
    with RecordingWriter.append(path, SOURCES) as second:  # free once closed
        second.write("w0/0", b"kv", 2, b"second's")
    records, reader = _read_all(path)
    assert reader.damage is None
    assert [r.payload for r in records] == [b"first's", b"first's again", b"second's"]


def test_a_recorded_stream_id_stays_one_publisher(tmp_path: Path) -> None:
    path = tmp_path / "one.kvrec"
    _write(path, [b"a", b"b"], compress=False)
    before = path.read_bytes()
    elsewhere = msgspec.structs.replace(SOURCES[0], endpoint="tcp://127.0.0.1:6000", topic="")
    with pytest.raises(RecordingError, match="stream w0/0 is recorded from another source") as e:
        RecordingWriter.append(path, [elsewhere])
    said = str(e.value)
    assert "endpoint 'tcp://127.0.0.1:5557', topic 'kv'" in said
    assert "endpoint 'tcp://127.0.0.1:6000', topic ''" in said
    assert path.read_bytes() == before  # refused before anything was cut or written
    # a block size one side does not know is no other publisher: it is learned from events
    unsized = msgspec.structs.replace(SOURCES[0], block_size=None)
    with (
        RecordingWriter.append(path, [unsized, *SOURCES]) as writer,
        pytest.raises(RecordingError, match="stream w1/0"),
    ):
        writer.add_sources([msgspec.structs.replace(SOURCES[1], engine="sglang")])
    _, reader = _read_all(path)
    assert list(reader.sources.values()) == SOURCES


def test_an_append_knows_where_each_stream_ends(tmp_path: Path) -> None:
    path = tmp_path / "ends.kvrec"
    _write(path, _payloads(random.Random(2), 9), compress=True)
    with RecordingWriter.append(path) as writer:
        last = writer.last_records
    records, _ = _read_all(path)
    assert last == {"w0/0": records[8], "w1/0": records[7]}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("buffer_bytes", [0, 1 << 20])
def test_records_a_failed_write_lost_are_not_counted(tmp_path: Path, buffer_bytes: int) -> None:
    path = tmp_path / "lost.kvrec"
    writer = RecordingWriter.create(
        path, SOURCES, compress=True, chunk_records=3, buffer_bytes=buffer_bytes
    )
    for seq in range(3):
        writer.write("w0/0", b"kv", seq, b"kept")
    writer.flush()
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, writer._fd)  # every later write fails with ENOSPC, as on a full disk
    os.close(full)
    writer.write("w0/0", b"kv", 3, b"lost")
    writer.write("w1/0", b"kv", 0, b"lost")
    with pytest.raises(RecordingError, match="write failed"):
        if buffer_bytes:
            writer.write("w0/0", b"kv", 4, b"lost")  # the chunk closes into the buffer
            writer.flush()
        else:
            writer.write("w0/0", b"kv", 4, b"lost")  # the chunk closes, and is refused
    assert (writer.records, writer.records_written) == (3, 3)
    if not buffer_bytes:
        # the records counted before the one whose write raised
        assert [(r.stream, r.seq) for r in writer.lost_records] == [("w0/0", 3), ("w1/0", 0)]
    writer.close()  # nothing left to write: the lost records are gone, not retried
    records, reader = _read_all(path)
    assert reader.damage is None and [r.payload for r in records] == [b"kept"] * 3
