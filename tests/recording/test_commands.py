"""The `kvroute record`, `kvroute record inspect` and `kvroute replay` verbs, end to end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from bench.synthetic_recording import SyntheticWorkload, synthesize_recording
from indexer.config import StreamConfig
from indexer.protocol import BlockHash, EventBatch, Stored, encode_batch
from indexer.recording.format import RecordingReader, RecordingWriter, RecordMark, Source
from indexer.recording.replay import replay_into_index
from indexer.recording.republish import RepublishConfig, Republisher
from indexer.service import IndexerService
from indexer.snapshot import dump_index, load_index
from router.commands.cli import main
from router.commands.record import record
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

ROOT = Path(__file__).resolve().parent.parent.parent
SMALL = SyntheticWorkload(streams=2, tenants=3, conversations=12, capacity_pages=64, seed=3)


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "small.kvrec"
    synthesize_recording(path, SMALL)
    return path


def test_replay_prints_a_summary(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(recording)]) == 0
    out = capsys.readouterr().out
    assert "block ops/s" in out and "final index:" in out
    assert "sim-0#dp0" in out and "sim-1#dp0" in out
    assert "tenant-" not in out  # salts are secrets
    assert "salt:" in out


def test_replay_json_and_dump(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = tmp_path / "index.msgpack"
    assert main(["replay", str(recording), "--json", "--dump", str(dump)]) == 0
    assert dump.stat().st_mode & 0o777 == 0o600  # it holds the salts in clear
    summary = json.loads(capsys.readouterr().out)
    _, index = replay_into_index(recording)
    assert summary["index_entries"] == len(index) == len(load_index(dump.read_bytes())) > 0
    assert dump.read_bytes() == dump_index(index)


def test_replay_windows_and_streams(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(recording), "--json", "--stream", "sim-1#dp0"]) == 0
    assert [s["stream"] for s in json.loads(capsys.readouterr().out)["streams"]] == ["sim-1#dp0"]
    assert main(["replay", str(recording), "--json", "--from", "seq:2", "--to", "seq:4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all((s["first_seq"], s["last_seq"]) == (2, 4) for s in doc["streams"])
    assert main(["replay", str(recording), "--json", "--from", "+0.01", "--to", "0.05s"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_time"] - 1_700_000_000.0 >= 0.01
    assert doc["last_time"] - doc["first_time"] <= 0.04 + 1e-6
    # 1_700_000_000 is 2023-11-14T22:13:20Z; naive ISO times are UTC
    iso = ["--from", "2023-11-14T22:13:20.02Z", "--to", "2023-11-14T22:13:20.06"]
    assert main(["replay", str(recording), "--json", *iso]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert 1_700_000_000.02 <= doc["first_time"] <= doc["last_time"] <= 1_700_000_000.06
    assert main(["replay", str(recording), "--from", "yesterday"]) == 2
    assert "--from 'yesterday'" in capsys.readouterr().err


def test_replay_of_a_damaged_file_says_where_it_stopped(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tear(recording)
    assert main(["replay", str(recording)]) == 1
    out = capsys.readouterr().out
    assert "STOPPED at byte" in out and "truncated" in out


def test_inspect_hides_salts_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.kvrec"
    event = Stored(
        block_hashes=[7], parent=None, token_ids=[1, 2], block_size=2, cache_salt="s3cr3t"
    )
    with RecordingWriter.create(path, [Source(stream="w#dp0", block_size=2)]) as writer:
        writer.write("w#dp0", b"kv", 0, encode_batch(EventBatch(ts=1.0, events=[event])))
        writer.write("w#dp0", b"kv", 1, b"\x93not msgpack")
        empty = encode_batch(EventBatch(ts=2.0, events=[]))
        writer.write("w#dp0", b"kv", 2, empty, replayed=True, run_start=True)
        writer.write("w#dp0", b"kv", 3, empty, replayed=True)
    assert main(["record", "inspect", str(path), "--events"]) == 0
    out = capsys.readouterr().out
    assert "format version 3" in out and "w#dp0" in out
    assert "seq 2 topic b'kv' replayed, run start (" in out
    assert "seq 3 topic b'kv' replayed (" in out
    assert "BlockStored 1 pages x 2" in out and "MALFORMED" in out
    assert "s3cr3t" not in out and "salt:" in out
    assert "decode errors 1" in out
    assert main(["record", "inspect", str(path), "--events", "--show-salts"]) == 0
    assert "'s3cr3t'" in capsys.readouterr().out


def test_inspect_says_a_block_size_not_set_is_learned_not_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "unsized.kvrec"
    event = Stored(block_hashes=[7], parent=None, token_ids=[1, 2], block_size=2)
    with RecordingWriter.create(path, [Source(stream="w#dp0")]) as writer:
        writer.write("w#dp0", b"kv", 0, encode_batch(EventBatch(ts=1.0, events=[event])))
    assert main(["record", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "block size not set (learned from its pages)" in out and "None" not in out, out
    # none learned from its one page either (it holds no entry): said so, not "None"
    assert "block size unknown (mismatches 0)" in out


def _two_streams_wb_first(path: Path) -> None:
    """wA#dp0 and wB#dp0, wB declared and recorded first (it published first in the capture)."""
    empty = encode_batch(EventBatch(ts=1.0, events=[]))
    sources = [Source(stream=f"{w}#dp0", block_size=2, topic="kv") for w in ("wB", "wA")]
    with RecordingWriter.create(path, sources) as writer:
        writer.write("wB#dp0", b"kv", 0, empty)
        writer.write("wA#dp0", b"kv", 0, empty)


async def test_replay_publish_binds_ports_in_the_order_inspect_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stream i publishes on PUB port + i, i counted in stream id order, the order `record
    inspect` lists. Before, the streams took ports in first-record order: inspect listed wA#dp0
    then wB#dp0, and wB#dp0 was bound to the first port."""
    path = tmp_path / "two.kvrec"
    _two_streams_wb_first(path)
    assert main(["record", "inspect", str(path)]) == 0
    listed = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()]
    assert [s for s in listed if s.endswith("#dp0")][:2] == ["wA#dp0", "wB#dp0"]
    proc, port, out, err = await _replay_publish(path)
    assert proc.returncode == 0, err
    bound = [line.split()[1:4] for line in out.decode().splitlines() if line.startswith("stream ")]
    assert bound == [
        ["wA#dp0:", "PUB", f"tcp://127.0.0.1:{port}"],
        ["wB#dp0:", "PUB", f"tcp://127.0.0.1:{port + 1}"],
    ], out


def test_inspect_events_shows_the_marks_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The subscriber's clear and forget-seq marks were left out of `--events`: a clear the
    seqs do not show, which the replay below the list applies, was nowhere to be seen."""
    path = tmp_path / "m.kvrec"
    empty = encode_batch(EventBatch(ts=1.0, events=[]))
    with RecordingWriter.create(path, [Source(stream="w#dp0", block_size=2)]) as writer:
        writer.write_mark("w#dp0", RecordMark.CLEAR, None)  # e.g. a replay socket's answer
        writer.write("w#dp0", b"kv", 4, empty)
        writer.write("w#dp0", b"kv", 5, empty)
        writer.write_mark("w#dp0", RecordMark.CLEAR, 5)
        writer.write_mark("w#dp0", RecordMark.FORGET_SEQ, 5)
        writer.write("w#dp0", b"kv", 0, empty)
    assert main(["record", "inspect", str(path), "--events"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert [line.split(" ", 3)[3] for line in lines] == [
        "MARK CLEAR (no seq yet): the subscriber dropped the stream's entries here",
        "seq 4 topic b'kv' (12 bytes)",
        "seq 5 topic b'kv' (12 bytes)",
        "MARK CLEAR (after seq 5): the subscriber dropped the stream's entries here",
        "MARK FORGET SEQ (after seq 5): the subscriber forgot the stream's seq and fence here "
        "(a restart: it rebuilds from the next seq)",
        "seq 0 topic b'kv' (12 bytes)",
    ]
    assert [line.split(" ", 1)[0] for line in lines] == [f"#{n}" for n in range(6)]


def test_inspect_lists_streams_an_append_added(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    late = Source(stream="late#dp0", endpoint="tcp://127.0.0.1:7001", block_size=16)
    with RecordingWriter.append(recording, [late]) as writer:
        writer.write("late#dp0", b"kv", 0, encode_batch(EventBatch(ts=1.0, events=[])))
    assert main(["record", "inspect", str(recording)]) == 0
    assert "  late#dp0: sglang tcp://127.0.0.1:7001" in capsys.readouterr().out
    assert main(["record", "inspect", str(recording), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "late#dp0" in [s["stream"] for s in doc["sources"]]
    # text and JSON on one stdout would be neither
    assert main(["record", "inspect", str(recording), "--json", "--events"]) == 2
    assert "--events and --json" in capsys.readouterr().err


def test_replay_refuses_what_would_do_nothing(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = str(recording)
    publish = ["--publish", "tcp://127.0.0.1:1", "--wait", "0", "--linger", "0"]
    cases = [
        (["--dump", str(tmp_path / "x.snap"), *publish], "--dump and --publish"),
        (["--json", "--into", "index", *publish], "--json, --into and --publish"),
        (["--stream", "nope#dp0"], "--stream nope#dp0: not in"),
        (["--from", "nan"], "--from 'nan': not a number"),
        (["--from", "+3", "--to", "+1"], "the window is empty"),
        (["--from", "seq:9", "--to", "seq:2"], "the window is empty"),
        (["--speed", "abc", *publish], "--speed 'abc'"),
        (["--replay-buffer", "0", *publish], "--replay-buffer 0"),
        # a republish's options into an index: refused (`--speed fast` ran as fast as ever)
        (["--speed", "fast"], "--speed needs --publish"),
        (["--faults", "drop=0.1"], "--faults needs --publish"),
        (["--speed", "10", "--wait", "0", "--seed", "3"], "--speed, --seed, --wait need --publish"),
    ]
    for args, said in cases:
        assert main(["replay", file, *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err, (args, err)
        assert "sim-0#dp0" in err or "--stream" not in said  # the streams there are, named
    assert not (tmp_path / "x.snap").exists()


@pytest.mark.parametrize(
    "window",
    [
        ["--from", "+1000"],  # past the end
        ["--to", "2001-01-01T00:00:00Z"],  # before the start
        ["--from", "2030-01-01T00:00:00Z", "--to", "2031-01-01T00:00:00Z"],
        ["--from", "seq:100000"],  # past every stream's last seq
        ["--to", "+0.05", "--from", "seq:100000"],
    ],
)
@pytest.mark.parametrize("publish", [False, True], ids=["index", "publish"])
def test_a_window_beyond_the_recording_is_refused_as_an_empty_one(
    recording: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    window: list[str],
    publish: bool,
) -> None:
    """Before, `--from +1000` replayed nothing, wrote a 0-entry --dump and exited 0, where
    `--from +3 --to +1` was refused: both select no record."""
    dump = tmp_path / "x.snap"
    how = (
        ["--publish", "tcp://127.0.0.1:0", "--wait", "0", "--linger", "0"]
        if publish
        else ["--dump", str(dump)]
    )
    assert main(["replay", str(recording), *window, *how]) == 2
    err = capsys.readouterr().err
    assert "the window is empty" in err and window[1] in err, err
    assert "+0.0" in err  # where the recording's records are, to choose another
    assert not dump.exists()


def test_replay_refuses_negative_seqs_and_waits_and_ports_past_65535(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--to seq:-1` and `--wait -1` were taken in silence; a --publish port whose streams'
    ports run past 65535 failed at the bind with "cannot bind ...:65536: Invalid argument"."""
    file = str(recording)  # two streams
    publish = ["--publish", "tcp://127.0.0.1:0", "--linger", "0"]
    cases = [
        (["--to", "seq:-1"], "--to 'seq:-1': a seq is >= 0"),
        (["--from", "seq:-1", "--to", "seq:5"], "--from 'seq:-1': a seq is >= 0"),
        (["--wait", "-1", *publish], "--wait -1.0: seconds, >= 0"),
        (["--wait", "0", "--publish", "tcp://127.0.0.1:0", "--linger", "-1"], "--linger -1.0"),
        (
            ["--publish", "tcp://127.0.0.1:65535"],
            "--publish tcp://127.0.0.1:65535: 2 stream(s) publish and answer on ports "
            "65535-65538 (one per stream and socket from the given port), past 65535: give a "
            "port up to 65532, or 0 for free ports",
        ),
        (
            ["--publish", "tcp://127.0.0.1:65532", "--replay-endpoint", "tcp://127.0.0.1:65535"],
            "--replay-endpoint tcp://127.0.0.1:65535: 2 stream(s) answer on ports 65535-65536",
        ),
    ]
    for args, said in cases:
        assert main(["replay", file, *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err and len(err.splitlines()) == 1, (args, err)
        assert "Invalid argument" not in err


def _tear(path: Path) -> None:
    """Cut the file a third from its end, mid-frame (as a crash would)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def test_an_empty_window_of_a_damaged_file_says_where_its_records_stop(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the refusal gave the span read up to the damage as the file's records, with no
    word of the damage: the window asked for may lie past it, in what could not be read."""
    _tear(recording)
    assert main(["replay", str(recording), "--to", "2001-01-01T00:00:00Z"]) == 2
    err = capsys.readouterr().err
    assert "the window is empty" in err, err
    assert "read up to damage at byte" in err and "what lies past it is unknown" in err, err


async def test_replay_publish_of_a_damaged_file_exits_1(recording: Path) -> None:
    _tear(recording)
    proc, _, out, err = await _replay_publish(recording)
    assert proc.returncode == 1, err
    assert b"recording damaged at byte" in err and b"sent" in out


def _damaged_before_the_window(path: Path) -> None:
    """Over 128 KiB (a time window seeks by bisection), times +0 to +1999 s; stream b starts at
    +100 s, in the frame that is damaged."""
    sources = [Source(stream=s, block_size=2) for s in ("a#dp0", "b#dp0")]
    seqs = {"a#dp0": 0, "b#dp0": 0}
    with RecordingWriter.create(path, sources) as writer:
        for i in range(2000):
            stream = "b#dp0" if i >= 100 and i % 2 == 0 else "a#dp0"
            event = Stored(list[BlockHash]([i]), None, [i, i], 2)
            payload = encode_batch(EventBatch(ts=float(i), events=[event]))
            writer.write(stream, b"kv", seqs[stream], payload, recv_time=1000.0 + i)
            seqs[stream] += 1
    with RecordingReader(path) as reader:
        offset = next(p.offset for p in reader if p.record.stream == "b#dp0")
    data = bytearray(path.read_bytes())
    data[offset + 40] ^= 1  # the frame's checksum fails
    path.write_bytes(bytes(data))


async def test_replay_from_a_time_past_damage_says_so_and_dumps_no_stream_whole(
    tmp_path: Path,
) -> None:
    # the time seek read past the damage and the scan for earlier streams stopped at it in
    # silence: exit 0, no STOPPED line, and b (its first record in the damaged frame) kept
    # its seq and fence in the dump, claiming a whole stream
    path, dump = tmp_path / "r.kvrec", tmp_path / "r.msgpack"
    _damaged_before_the_window(path)
    proc = await _cli("replay", str(path), "--from", "+1500", "--dump", str(dump))
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err
    assert b"STOPPED at byte" in out and b"before the window" in out
    index = load_index(dump.read_bytes())
    assert len(index) > 0
    assert all((index.last_seq(s), index.fence(s)) == (None, None) for s in ("a#dp0", "b#dp0"))
    # a republish of the window says it too, with the same exit status
    proc, _, out, err = await _replay_publish(path, "--from", "+1500")
    assert proc.returncode == 1, err
    assert b"before the window" in err and b"sent" in out


def test_record_refuses_limits_and_ports_that_cannot_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "r.kvrec")]
    cases = [
        (["--endpoint", "tcp://127.0.0.1:99999"], "the port must be 1-65535"),
        (["--endpoint", "tcp://127.0.0.1:5557", "--replay", "tcp://h:x"], "--replay 'tcp://h:x'"),
        (["--endpoint", "tcp://127.0.0.1:5557", "--duration", "-1"], "--duration -1.0"),
        (["--endpoint", "tcp://127.0.0.1:5557", "--max-bytes", "0"], "--max-bytes 0"),
        (["--endpoint", "tcp://127.0.0.1:5557", "--append"], "cannot append"),
    ]
    cases.append((["--endpoint", "tcp://127.0.0.1:5557", "--max-bytes", "10"], "before any record"))
    for args, said in cases:
        assert main(["record", *args, *out]) == 2, args
        assert said in capsys.readouterr().err, args
    assert not (tmp_path / "r.kvrec").exists()


def test_record_needs_a_source_and_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["record", "--endpoint", "tcp://127.0.0.1:1"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["record", "--out", "/nonexistent/x.kvrec"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    bad = ["--endpoint", "tcp://127.0.0.1:1", "--block-size", "0"]
    assert main(["record", *bad, "--out", "/nonexistent/x.kvrec"]) == 2
    assert "--block-size 0" in capsys.readouterr().err
    bad = ["--endpoint", "tcp://127.0.0.1:1", "--block-size", "65537"]  # the wire's largest: 2**16
    assert main(["record", *bad, "--out", "/nonexistent/x.kvrec"]) == 2
    assert "--block-size 65537: must be 1-65536" in capsys.readouterr().err
    assert main(["record", "--endpoint", "127.0.0.1:5557", "--out", "/nonexistent/x.kvrec"]) == 2
    assert "--endpoint '127.0.0.1:5557'" in capsys.readouterr().err


async def _replay_publish(
    path: Path, *more: str
) -> tuple[asyncio.subprocess.Process, int, bytes, bytes]:
    """`kvroute replay PATH --publish` at full speed on a free port: the process, its first
    port and its output."""
    for _ in range(5):
        # a port free now may be taken by the time the child binds it (another test's
        # connection): then it says so, and another is tried
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        publish = ["--publish", f"tcp://127.0.0.1:{port}", "--speed", "max"]
        proc = await _cli("replay", str(path), *publish, "--wait", "0", "--linger", "0", *more)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        if b"Address already in use" not in err:
            break
    return proc, port, out, err


async def _cli(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def test_record_cli_stops_at_max_bytes_and_on_ctrl_c(recording: Path, tmp_path: Path) -> None:
    with RecordingReader(recording) as reader:
        records = [p.record for p in reader if p.record.stream == "sim-0#dp0"]
    source = Source(stream="sim-0#dp0", topic="kv", block_size=16, worker="sim-0")
    async with Republisher([source], RepublishConfig(speed=None)) as rep:
        (pub,) = rep.streams
        out = tmp_path / "cli.kvrec"
        proc = await _cli(
            "record",
            "--endpoint",
            pub.endpoint,
            "--replay",
            pub.replay_endpoint,
            "--topic",
            "kv",
            "--worker",
            "sim-0",
            "--out",
            str(out),
            "--max-bytes",
            "2000",
        )
        assert await rep.wait_subscribed(20.0)
        await rep.run(records)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 20.0)
        assert proc.returncode == 0, stderr
        assert b"stopped by max-bytes" in stdout
        with RecordingReader(out) as reader:
            got = list(reader)
            assert reader.damage is None
        assert 2000 <= out.stat().st_size < 2000 + max(len(r.payload) for r in records) + 100
        assert [p.record.payload for p in got] == [r.payload for r in records[: len(got)]]

        # Ctrl-C: a clean stop, the file ends at a complete record
        out2 = tmp_path / "ctrlc.kvrec"
        proc = await _cli(
            "record",
            "--endpoint",
            pub.endpoint,
            "--replay",
            pub.replay_endpoint,
            "--worker",
            "sim-0",
            "--out",
            str(out2),
        )
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 20.0)
        assert line.startswith(b"recording 1 stream(s)"), line
        proc.send_signal(signal.SIGINT)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 20.0)
        assert proc.returncode == 0, stderr
        with RecordingReader(out2) as reader:
            list(reader)
            assert reader.damage is None


async def test_replay_publish_cli_feeds_a_live_indexer(recording: Path) -> None:
    proc = await _cli(
        "replay",
        str(recording),
        "--publish",
        "tcp://127.0.0.1:0",
        "--speed",
        "max",
        "--wait",
        "20",
        "--linger",
        "1",
        "--faults",
        "drop=0.1",
        "--seed",
        "4",
    )
    assert proc.stdout is not None
    endpoints: dict[str, tuple[str, str]] = {}
    while len(endpoints) < 2:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
        assert line.startswith("stream "), line
        _, stream, _, pub, _, replay = line.split()
        endpoints[stream.rstrip(":")] = (pub, replay)
    _, expected = replay_into_index(recording)
    with RecordingReader(recording) as reader:
        last = {p.record.stream: p.record.seq for p in reader}
    async with IndexerService() as service:
        for stream, (pub, replay) in endpoints.items():
            worker = stream.split("#")[0]
            config = StreamConfig(endpoint=pub, replay_endpoint=replay, topic="kv", model="sim")
            await service.add_worker(worker, [config])
        for stream in endpoints:
            assert await service.wait_applied(stream.split("#")[0], last[stream], timeout_s=20.0)
        assert len(service.index) == len(expected)
        assert sorted(n.blocks for n in service.namespaces()) == sorted(
            n.blocks for n in expected.namespaces()
        )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 20.0)
    assert proc.returncode == 0, stderr
    assert b"dropped" in stdout


async def test_replay_publish_sends_the_clears_so_a_subscriber_drops_the_pages(
    tmp_path: Path,
) -> None:
    """A clear the recorder's subscriber decided with the seqs continuous (the restart an
    --append found at its seam) was not republished: a router fed the replay kept the pages
    the live one had dropped. Now it ends with the index an offline replay builds: only the
    page stored after the clear."""
    path = tmp_path / "cleared.kvrec"
    source = Source(stream="w#dp0", topic="kv", block_size=2, model="sim", worker="w")

    def stored(hashes: list[int], parent: int | None) -> bytes:
        event = Stored(list[BlockHash](hashes), parent, list(range(2 * len(hashes))), 2)
        return encode_batch(EventBatch(ts=1.0, events=[event]), "map")

    with RecordingWriter.create(path, [source]) as writer:
        writer.write("w#dp0", b"kv", 0, stored([1, 2], None))
        writer.write("w#dp0", b"kv", 1, stored([3], 2))
        writer.write_mark("w#dp0", RecordMark.CLEAR, 1)
        writer.write_mark("w#dp0", RecordMark.FORGET_SEQ, 1)
        writer.write("w#dp0", b"kv", 2, stored([10], None))
    _, expected = replay_into_index(path)
    assert len(expected) == 1  # what the live router held
    publish = ["--publish", "tcp://127.0.0.1:0", "--speed", "max", "--wait", "20"]
    proc = await _cli("replay", str(path), *publish, "--linger", "0.5")
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
    _, _, _, pub, _, replay = line.split()
    async with IndexerService() as service:
        config = StreamConfig(endpoint=pub, replay_endpoint=replay, topic="kv", model="sim")
        await service.add_worker("w", [config])
        out, err = await asyncio.wait_for(proc.communicate(), 20.0)
        assert proc.returncode == 0, err
        last = int(out.split(b"last seq ")[1].split()[0])
        assert await service.wait_applied("w", last, timeout_s=10.0)
        assert len(service.index) == len(expected) == 1
    assert b"clears 1 (sent)  forgets 1 (not sent)" in out, out
    assert b"forget-seq mark is not republished" in err


def test_record_config_lists_every_stream_of_every_worker(tmp_path: Path) -> None:
    from router.commands.record import _config_sources

    config = tmp_path / "router.toml"
    config.write_text(
        """
[[workers]]
url = "http://127.0.0.1:30000"
id = "a"
events = "tcp://127.0.0.1:5557"
replay = "tcp://127.0.0.1:5600"
block_size = 16
dp_size = 2
topic = "kv"
model = "m"

[[workers]]
url = "http://127.0.0.1:30001"
id = "b"
events = "tcp://127.0.0.1:6557"
block_size = 32
engine = "vllm"
model = "v"
"""
    )
    sources, skipped = _config_sources(config)
    assert not skipped
    assert [(s.stream, s.endpoint, s.replay_endpoint, s.dp_rank) for s in sources] == [
        ("a#dp0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600", 0),
        ("a#dp1", "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601", 1),
        ("b#dp0", "tcp://127.0.0.1:6557", None, 0),
    ]
    assert (sources[0].model, sources[0].topic, sources[0].block_size) == ("m", "kv", 16)
    assert (sources[2].engine, sources[2].block_size) == ("vllm", 32)


async def test_record_config_asks_the_worker_for_its_streams_and_model(tmp_path: Path) -> None:
    from router.commands.record import _config_sources

    worker = ReferenceWorker(WorkerConfig(model="served/by-it", dp_size=2, time_scale=0.0))
    config = tmp_path / "router.toml"
    async with worker:
        config.write_text(f'[[workers]]\nid = "w"\nurl = "{worker.url}"\n')
        # a blocking read, as the CLI does it: off this loop, which serves the worker
        sources, _ = await asyncio.to_thread(_config_sources, config)
    kv = worker.kv_events
    assert [(s.stream, s.endpoint, s.replay_endpoint) for s in sources] == [
        ("w#dp0", kv.endpoints[0], kv.replay_endpoints[0]),
        ("w#dp1", kv.endpoints[1], kv.replay_endpoints[1]),
    ]
    # the namespace the router indexes it under: without it a replay names other namespaces
    assert {s.model for s in sources} == {"served/by-it"}
    assert {s.block_size for s in sources} == {kv.block_size}


def test_record_config_names_a_worker_it_cannot_ask(tmp_path: Path) -> None:
    from router.commands.record import _config_sources

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    config = tmp_path / "router.toml"
    config.write_text(f'[[workers]]\nid = "gone"\nurl = "{url}"\n')
    with pytest.raises(ValueError, match=f"worker gone: cannot read server_info of {url}"):
        _config_sources(config)
    # its streams configured, but not its model: still asked, and the refusal says why
    config.write_text(
        f'[[workers]]\nid = "gone"\nurl = "{url}"\nevents = "tcp://127.0.0.1:5557"\n'
        "block_size = 16\n"
    )
    with pytest.raises(ValueError, match=r"worker gone: cannot read the models of .*Connect"):
        _config_sources(config)


async def test_record_config_records_the_workers_that_answer_and_names_the_one_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One worker of the config down (needing discovery) made the whole recording exit 2, as
    an operator most needs it, while `kvroute serve` starts on the same config; the others are
    recorded now and the one down is named in one line."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{probe.getsockname()[1]}"
    worker = ReferenceWorker(WorkerConfig(model="served/by-it", time_scale=0.0))
    config = tmp_path / "router.toml"
    out = tmp_path / "up.kvrec"
    async with worker:
        config.write_text(
            f'[[workers]]\nid = "up"\nurl = "{worker.url}"\n'
            f'[[workers]]\nid = "gone"\nurl = "{gone}"\n'
        )
        args = ["record", "--config", str(config), "--out", str(out), "--duration", "0.3"]
        # the CLI blocks: off this loop, which serves the worker
        code = await asyncio.to_thread(main, args)
    err = capsys.readouterr().err
    assert code == 0, err
    said = [line for line in err.splitlines() if "gone" in line]
    assert len(said) == 1, err
    assert (
        "worker gone is NOT recorded" in said[0] and f"cannot read server_info of {gone}" in said[0]
    )
    with RecordingReader(out) as reader:
        assert [s.stream for s in reader.header.sources] == ["up#dp0"]


def test_replay_reports_unwritable_dump_and_taken_port(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(recording), "--dump", str(tmp_path / "no" / "x.msgpack")]) == 2
    assert "kvroute replay:" in capsys.readouterr().err
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        publish = ["--publish", f"tcp://127.0.0.1:{port}", "--wait", "0", "--linger", "0"]
        assert main(["replay", str(recording), *publish]) == 2
        assert f"cannot bind tcp://127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        taken.close(linger=0)
        ctx.term()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
async def test_record_stops_cleanly_when_the_disk_is_full(recording: Path, tmp_path: Path) -> None:
    with RecordingReader(recording) as reader:
        records = [p.record for p in reader if p.record.stream == "sim-0#dp0"]
    source = Source(stream="sim-0#dp0", topic="kv", block_size=16, worker="sim-0")
    async with Republisher([source], RepublishConfig(speed=None)) as rep:
        (pub,) = rep.streams
        live = msgspec.structs.replace(
            source, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint
        )
        writer = RecordingWriter.create(tmp_path / "full.kvrec", [live])
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, writer._fd)  # every later write fails with ENOSPC, as on a full disk
        os.close(full)
        recorder = asyncio.create_task(record(writer, [live]))
        assert await rep.wait_subscribed(20.0)
        await rep.run(records)
        stats = await asyncio.wait_for(recorder, 20.0)
    assert stats.stopped_by == "write-error" and "write failed" in stats.error
    assert stats.records == 0


def test_replay_dump_never_replaces_a_file(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = recording.read_bytes()
    # its own input, mistyped for a new name: the recording must survive
    assert main(["replay", str(recording), "--dump", str(recording)]) == 2
    assert "it exists" in capsys.readouterr().err
    assert recording.read_bytes() == kept
    # an older snapshot, readable by all: neither overwritten nor left to hold the salts
    older = tmp_path / "older.msgpack"
    older.write_bytes(b"older")
    older.chmod(0o644)
    assert main(["replay", str(recording), "--dump", str(older)]) == 2
    assert f"--dump {older}: cannot create: it exists" in capsys.readouterr().err
    assert older.read_bytes() == b"older"
    # a dump that fails leaves no empty file behind
    assert main(["replay", str(tmp_path / "missing.kvrec"), "--dump", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "verb",
    [["replay"], ["record", "inspect", "--events"], ["record", "inspect", "--json"]],
    ids=["replay", "inspect-events", "inspect-json"],
)
def test_a_closed_stdout_ends_quietly(recording: Path, verb: list[str]) -> None:
    """`kvroute replay F | head -1`: no traceback, no error; the status of a tool SIGPIPE ends."""
    import subprocess

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write fails (EPIPE)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "router.commands.cli", *verb, str(recording)],
            stdout=write,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert done.stderr == b""
    assert done.returncode == 128 + signal.SIGPIPE
