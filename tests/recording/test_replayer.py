"""Offline replay into an index: same index as applying directly, same sequence decisions."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from indexer.fingerprint import salt_fingerprint
from indexer.index import PrefixIndex
from indexer.protocol import EventBatch, Stored, decode_batch, encode_batch
from indexer.recording.format import RecordingReader, RecordingWriter, Source
from indexer.recording.replay import RecordFilter, replay_into_index

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
# written by the version-1 writer: stream w0#dp0 (page 4), one stored page per seq 0-5, chained,
# seqs 2-5 replayed
VERSION_1 = Path(__file__).resolve().parent.parent / "fixtures" / "recordings" / "version1.kvrec"


def _store(seq: int, *, salt: str | None = None, parent: int | None = None) -> bytes:
    """One page of 4 tokens whose engine hash is its seq + 1000; chains to `parent`."""
    event = Stored(
        block_hashes=[1000 + seq],
        parent=parent,
        token_ids=[seq * 4 + i for i in range(4)],
        block_size=4,
        medium="GPU",
        cache_salt=salt,
    )
    return encode_batch(EventBatch(ts=float(seq), events=[event], dp_rank=0))


def _write(path: Path, rows: list[tuple[str, int, bytes, bool]]) -> None:
    """Rows as the subscriber writes them: the first of each stream's runs of replayed records
    marked as the start of a counted run."""
    sources = [Source(stream=s, block_size=4) for s in sorted({r[0] for r in rows})]
    in_run: dict[str, bool] = {}
    with RecordingWriter.create(path, sources) as writer:
        for i, (stream, seq, payload, replayed) in enumerate(rows):
            starts = replayed and not in_run.get(stream, False)
            in_run[stream] = replayed
            writer.write(
                stream, b"", seq, payload, replayed=replayed, run_start=starts, recv_time=100.0 + i
            )


def test_scenario_fixture_replays_to_the_directly_built_index(tmp_path: Path) -> None:
    scenario = json.loads((FIXTURES / "scenario-radix-salted.json").read_text())
    frames = [op["frames"] for op in scenario["operations"] if op["frames"]]
    path = tmp_path / "scenario.kvrec"
    direct = PrefixIndex()
    with RecordingWriter.create(path, [Source(stream="w0/0", model="m")]) as writer:
        direct.add_stream("w0/0", model="m")
        for topic, seq, payload in frames:
            raw = bytes.fromhex(payload)
            writer.write("w0/0", bytes.fromhex(topic), int(seq, 16), raw)
            direct.apply("w0/0", decode_batch(raw), int(seq, 16))
    summary, index = replay_into_index(path)
    assert summary.damage is None
    assert summary.batches == len(frames)
    assert len(index) == len(direct) > 0
    assert sorted(msgspec.json.encode(n) for n in index.namespaces()) == sorted(
        msgspec.json.encode(n) for n in direct.namespaces()
    )
    (stream,) = summary.streams
    assert (stream.gaps, stream.restarts, stream.decode_errors) == (0, 0, 0)
    # salts only as fingerprints
    text = msgspec.json.encode(summary).decode()
    assert "tenant-1" not in text
    assert salt_fingerprint("tenant-1") in text


def test_a_replayed_run_is_one_repaired_gap(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [("s", i, _store(i, parent=1000 + i - 1 if i else None), i in (3, 4)) for i in range(6)]
    _write(path, rows)
    summary, index = replay_into_index(path)
    (s,) = summary.streams
    assert (s.gaps, s.replays, s.lost_gaps, s.replayed_records, s.restarts) == (1, 1, 0, 2, 0)
    assert s.entries == 6 == len(index)


@pytest.mark.parametrize("marks", [(2, 4), ()], ids=["two-runs", "no-counted-run"])
def test_replay_runs_count_where_the_subscriber_marked_them(
    tmp_path: Path, marks: tuple[int, ...]
) -> None:
    # seqs 0-1 live, then 2-5 replayed: two repairs whose live copies were duplicates (marked
    # where each began), or replays the subscriber counted as no run (a reconnected stream's
    # check against the replay socket)
    path = tmp_path / "r.kvrec"
    with RecordingWriter.create(path, [Source(stream="s", block_size=4)]) as writer:
        for seq in range(6):
            payload = _store(seq, parent=1000 + seq - 1 if seq else None)
            writer.write("s", b"", seq, payload, replayed=seq >= 2, run_start=seq in marks)
    summary, _ = replay_into_index(path)
    (s,) = summary.streams
    runs = len(marks)
    assert (s.gaps, s.replays, s.lost_gaps, s.replayed_records) == (runs, runs, 0, 4)
    assert s.entries == 6


def test_a_version_1_file_counts_each_run_of_replayed_records_once() -> None:
    # the same records in a version-1 file (no marks): seqs 2-5 read as one run
    summary, _ = replay_into_index(VERSION_1)
    (s,) = summary.streams
    assert (s.gaps, s.replays, s.lost_gaps, s.replayed_records) == (1, 1, 0, 4)
    assert s.entries == 6 and s.decode_errors == 0


def test_a_jump_nobody_filled_clears_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [("s", i, _store(i), False) for i in (0, 1, 2, 7, 8)]
    _write(path, rows)
    summary, _ = replay_into_index(path)
    (s,) = summary.streams
    assert (s.gaps, s.lost_gaps, s.replays) == (1, 1, 0)
    assert s.entries == 2  # 7 and 8 only


def test_a_seq_decrease_is_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [("s", i, _store(i), False) for i in (0, 1, 2, 3)]
    rows += [("s", 0, _store(10), False), ("s", 1, _store(11), False)]
    # a restart revealed by a live message whose repair replays the new process's seqs
    rows += [("t", 0, _store(20), False), ("t", 1, _store(21), False)]
    rows += [("t", 0, _store(22), True), ("t", 1, _store(23), True), ("t", 2, _store(24), False)]
    _write(path, rows)
    summary, _ = replay_into_index(path)
    s, t = summary.streams
    assert (s.restarts, s.entries) == (1, 2)
    assert (t.restarts, t.entries) == (1, 3)


def test_malformed_payloads_are_counted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [("s", 0, _store(0), False), ("s", 1, b"\xc1garbage", False)]
    rows += [("s", 2, b"", False), ("s", 3, _store(3), False)]
    _write(path, rows)
    summary, _ = replay_into_index(path)
    (s,) = summary.streams
    assert (s.decode_errors, s.batches) == (2, 2)
    # no replayed copy followed either bad batch: the subscriber gave each up and cleared the
    # stream (a lost batch may have removed blocks), so only batch 3 is held
    assert (s.lost_batches, s.refetches, s.entries) == (2, 0, 1)


def test_a_refetched_copy_replaces_the_undecodable_live_batch(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [("s", 0, _store(0), False), ("s", 1, b"\xc1garbage", False)]
    rows += [("s", 1, _store(1, parent=1000), True), ("s", 2, _store(2, parent=1001), False)]
    # a second stream whose refetched copy is garbage too: cleared, then continues
    rows += [("t", 0, _store(0), False), ("t", 1, b"\xc1", False), ("t", 1, b"\xc1", True)]
    rows += [("t", 2, _store(2), False)]
    _write(path, rows)
    summary, _ = replay_into_index(path)
    s, t = summary.streams
    assert (s.decode_errors, s.refetches, s.lost_batches, s.entries) == (1, 1, 0, 3)
    assert (s.gaps, s.replays, s.restarts) == (0, 0, 0)  # a refetch is not a gap
    assert (t.decode_errors, t.refetches, t.lost_batches, t.entries) == (2, 1, 1, 1)


def test_a_truncated_file_replays_up_to_the_damage(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    _write(path, [("s", i, _store(i), False) for i in range(10)])
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    summary, index = replay_into_index(path)
    assert summary.damage is not None
    assert (summary.damage.kind, summary.damage.record) == ("truncated", 9)
    assert summary.records == 9 == len(index)


def test_filters_by_stream_seq_and_time(tmp_path: Path) -> None:
    path = tmp_path / "r.kvrec"
    rows = [(("a", "b")[i % 2], i // 2, _store(i), False) for i in range(20)]
    _write(path, rows)
    only_a, _ = replay_into_index(path, flt=RecordFilter(streams=frozenset({"a"})))
    assert [s.stream for s in only_a.streams] == ["a"] and only_a.records == 10
    seqs, _ = replay_into_index(path, flt=RecordFilter(from_seq=3, to_seq=5))
    assert seqs.records == 6
    assert all((s.first_seq, s.last_seq) == (3, 5) for s in seqs.streams)
    window, _ = replay_into_index(path, flt=RecordFilter(from_time=105.0, to_time=109.5))
    assert window.records == 5
    assert window.first_time == 105.0 and window.last_time == 109.0


def test_a_window_that_starts_mid_stream_keeps_no_fence(tmp_path: Path) -> None:
    # a dump of it must not claim to be the stream's state: a router loading it would prove
    # the fence and keep the stream synced with a part of its entries, never rebuilt
    path = tmp_path / "r.kvrec"
    rows = [("a", i, _store(i, parent=1000 + i - 1 if i else None), False) for i in range(6)]
    rows += [("b", i, _store(100 + i), False) for i in range(2)]  # b starts at 106.0
    _write(path, rows)
    whole, index = replay_into_index(path)
    assert index.fence("a") is not None and not any(s.partial for s in whole.streams)
    for flt in (RecordFilter(from_seq=2), RecordFilter(from_time=102.0)):
        summary, index = replay_into_index(path, flt=flt)
        partial = {s.stream: s.partial for s in summary.streams}
        assert partial["a"], flt
        assert (index.last_seq("a"), index.fence("a")) == (None, None), flt
    # a stream the window holds from its first record keeps its own
    summary, index = replay_into_index(path, flt=RecordFilter(from_time=104.0))
    assert {s.stream: s.partial for s in summary.streams} == {"a": True, "b": False}
    assert index.fence("b") is not None and index.last_seq("b") == 1
    # a window that ends early is the state at its end: its fence stands
    summary, index = replay_into_index(path, flt=RecordFilter(to_seq=3))
    assert index.last_seq("a") == 3 and index.fence("a") is not None


def _damaged_before_the_window(path: Path) -> int:
    """2,000 records (times 100.0 on, one a second) over 128 KiB, so a time window seeks by
    bisection; a alone first, then a and b in turn, b's first record (seq 0, at 200.0) in the
    frame that is damaged. Returns the damaged frame's offset."""
    rows = [("a", i, _store(i), False) for i in range(100)]
    for i in range(1900):
        rows.append(
            ("b", i // 2, _store(i), False) if i % 2 == 0 else ("a", 100 + i // 2, _store(i), False)
        )
    _write(path, rows)
    with RecordingReader(path) as reader:
        offset = next(p.offset for p in reader if p.record.stream == "b")
    data = bytearray(path.read_bytes())
    assert len(data) > 2 * 64 * 1024  # else nothing bisects: the read would start at 0
    data[offset + 40] ^= 1  # in the frame's body: its checksum fails
    path.write_bytes(bytes(data))
    return offset


def test_damage_before_a_time_window_is_reported_and_no_stream_kept_whole(
    tmp_path: Path,
) -> None:
    # the window's time seek starts past the damage, and the scan for the streams that began
    # earlier stopped at it: b's first record was in the damaged frame, so b looked whole and
    # kept its seq and fence (a dump claimed the whole stream), and the replay said nothing
    path = tmp_path / "r.kvrec"
    offset = _damaged_before_the_window(path)
    summary, index = replay_into_index(path, flt=RecordFilter(from_time=1900.0))
    assert {s.stream: s.partial for s in summary.streams} == {"a": True, "b": True}
    assert all((index.last_seq(s), index.fence(s)) == (None, None) for s in ("a", "b"))
    assert summary.damage is None  # the window itself read to the end
    assert summary.damage_before_window is not None and summary.damaged
    assert (summary.damage_before_window.offset, summary.damage_before_window.kind) == (
        offset,
        "corrupt",
    )
    assert summary.records == 200
    # a window that starts just past the damage, inside the 64 KiB its seek may land before:
    # the read went from there, stopped at the damage with nothing of the window read, and
    # the replay said the damage was the window's ("everything before it was replayed")
    near, index = replay_into_index(path, flt=RecordFilter(from_time=210.0))
    assert near.damage is None and near.damage_before_window is not None
    assert near.damage_before_window.offset == offset
    assert near.records == 2000 - 110 and {s.partial for s in near.streams} == {True}
    # damage inside the window stops it there, said once, as a whole replay
    inside, _ = replay_into_index(path, flt=RecordFilter(from_time=150.0))
    assert inside.damage is not None and inside.damage.offset == offset
    assert inside.damage_before_window is None
    # a seq window reads from the start: it stops at the damage too (and says so)
    seqs, _ = replay_into_index(path, flt=RecordFilter(from_seq=500))
    assert seqs.damage is not None and seqs.damage.offset == offset and seqs.records == 0
    # a window that ends before the damage never reaches it: nothing to say
    early, _ = replay_into_index(path, flt=RecordFilter(from_time=110.0, to_time=150.0))
    assert not early.damaged and early.records == 41
