"""`kvroute record` against reference workers: how a session stops (signals, limits, a failed
write), what its summary says against what the file holds, and what a second writer or a
second session (`--append`) may do to a file."""

from __future__ import annotations

import asyncio
import io
import os
import random
import re
import resource
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from indexer.protocol.events import Removed
from indexer.recording.format import Record, RecordingReader, RecordingWriter, Source
from indexer.recording.replay import replay_into_index
from indexer.snapshot import dump_index
from router.commands.cli import main
from router.commands.record import _print_done, record
from tests.recording.snapshots import canonical
from workers.config import WorkerConfig
from workers.worker import ReferenceWorker

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
async def worker() -> AsyncIterator[ReferenceWorker]:
    # a small cache: stores and evictions, several batches per request
    async with ReferenceWorker(WorkerConfig(time_scale=0.0, capacity_tokens=1024)) as w:
        yield w


async def _traffic(worker: ReferenceWorker, requests: int, seed: int) -> int:
    """Send `requests` generations; returns the seq the worker publishes next."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            body = {
                "input_ids": [rng.randrange(3, 259) for _ in range(64)],
                "sampling_params": {"max_new_tokens": 2},
            }
            async with session.post(f"{worker.url}/generate", json=body) as response:
                assert response.status == 200, await response.text()
    return worker.ranks[0].publisher.next_seq


def _source(worker: ReferenceWorker, name: str = "w") -> Source:
    kv = worker.kv_events
    return Source(
        stream=f"{name}#dp0",
        endpoint=kv.endpoints[0],
        replay_endpoint=kv.replay_endpoints[0],
        topic=kv.topic,
        worker=name,
    )


def _endpoint_args(worker: ReferenceWorker) -> list[str]:
    kv = worker.kv_events
    return ["--endpoint", kv.endpoints[0], "--replay", kv.replay_endpoints[0], "--topic", kv.topic]


def _records(path: Path) -> list[Record]:
    with RecordingReader(path) as reader:
        records = [p.record for p in reader]
        assert reader.damage is None, reader.damage
    return records


async def _cli(
    *args: str, limit_file_bytes: int | None = None, stdout: int = asyncio.subprocess.PIPE
) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def limit() -> None:  # in the child: a full disk at this size (SIGXFSZ is ignored there)
        assert limit_file_bytes is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.commands.cli",
        *args,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        preexec_fn=None if limit_file_bytes is None else limit,
    )


async def _started(proc: asyncio.subprocess.Process) -> None:
    """Until a `kvroute record` process has its file and subscriptions."""
    assert proc.stderr is not None
    line = await asyncio.wait_for(proc.stderr.readline(), 20.0)
    assert line.startswith(b"recording 1 stream(s)"), line


async def _until_recorded(path: Path, seq: int) -> None:
    """Until the file (read while written) holds `seq`."""
    async with asyncio.timeout(20.0):
        while not any(r.seq == seq for r in _records(path)):  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.05)


def _summary_counts(stdout: bytes) -> tuple[int, int, int]:
    """(recorded, in the file, the stream's batches) of a `kvroute record` summary."""
    head = re.search(
        rb"recorded (\d+) records(?: and \d+ subscriber marks \(clear / forget-seq\))? "
        rb"\((\d+) records in the file",
        stdout,
    )
    batches = re.search(rb"#dp0: batches (\d+)", stdout)
    assert head is not None and batches is not None, stdout
    return int(head[1]), int(head[2]), int(batches[1])


@pytest.mark.parametrize(
    ("sig", "said"),
    [(signal.SIGTERM, b"sigterm"), (signal.SIGHUP, b"sighup")],
    ids=["sigterm", "sighup"],
)
async def test_a_stop_signal_stops_a_compressed_recording_as_ctrl_c_does(
    worker: ReferenceWorker, tmp_path: Path, sig: signal.Signals, said: bytes
) -> None:
    # SIGHUP: the terminal hung up (an ssh session's end), the usual end of a long capture
    history = await _traffic(worker, 30, seed=1)
    out = tmp_path / "term.kvrec"
    proc = await _cli("record", *_endpoint_args(worker), "--out", str(out), "--compress")
    try:
        await _started(proc)
        await _until_recorded(out, history - 1)  # joined: it records as the worker publishes
        published = await _traffic(worker, 5, seed=2)
        await asyncio.sleep(0.1)  # delivered, and held in the open chunk (flushed every 0.5 s)
        proc.send_signal(sig)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 20.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr  # as Ctrl-C: a clean stop, not a death by signal
    assert b"stopped by " + said in stdout and b"Traceback" not in stderr
    records = _records(out)
    assert [r.seq for r in records] == list(range(published))  # the open chunk too
    assert _summary_counts(stdout) == (published, published, published)


async def test_a_hung_up_terminal_ends_a_recording_cleanly_though_it_cannot_show_it(
    worker: ReferenceWorker, tmp_path: Path
) -> None:
    # an ssh session's end, for real: stdout is a terminal (the live table on it) whose other
    # side is gone, where every write fails (EIO), then the SIGHUP that hangup sends
    history = await _traffic(worker, 30, seed=1)
    out = tmp_path / "hup.kvrec"
    master, terminal = os.openpty()
    loop = asyncio.get_running_loop()
    shown = bytearray()  # what the terminal shows (drained, or the live table would block)
    loop.add_reader(master, lambda: shown.extend(os.read(master, 65536)))
    try:
        proc = await _cli(
            "record", *_endpoint_args(worker), "--out", str(out), "--compress", stdout=terminal
        )
    finally:
        os.close(terminal)
    try:
        async with asyncio.timeout(20.0):  # its first line: on the terminal, as the table
            while b"recording 1 stream(s)" not in shown:  # noqa: ASYNC110 (another process)
                await asyncio.sleep(0.05)
        await _until_recorded(out, history - 1)
        published = await _traffic(worker, 5, seed=2)
        await asyncio.sleep(0.1)  # held in the open chunk
        loop.remove_reader(master)
        os.close(master)
        proc.send_signal(signal.SIGHUP)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr  # nobody to read the summary: not a failure
    assert b"Traceback" not in stderr
    assert [r.seq for r in _records(out)] == list(range(published))


async def test_a_second_recorder_cannot_write_into_a_file_being_recorded(
    worker: ReferenceWorker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = await _traffic(worker, 20, seed=3)
    out = tmp_path / "one.kvrec"
    first = await _cli("record", *_endpoint_args(worker), "--worker", "a", "--out", str(out))
    try:
        await _started(first)
        await _until_recorded(out, history - 1)
        before = out.read_bytes()
        second = [*_endpoint_args(worker), "--worker", "b", "--out", str(out), "--append"]
        # the CLI as run, off this loop (which serves the worker)
        assert await asyncio.to_thread(main, ["record", *second, "--duration", "5"]) == 2
        assert "another writer has it open" in capsys.readouterr().err
        assert out.read_bytes() == before  # nothing cut, nothing added
        published = await _traffic(worker, 10, seed=4)
        await _until_recorded(out, published - 1)
        first.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(first.communicate(), 20.0)
    finally:
        if first.returncode is None:
            first.kill()
            await first.wait()
    assert first.returncode == 0, stderr
    records = _records(out)  # whole: no frames of another writer among its own
    assert {r.stream for r in records} == {"a#dp0"}
    assert [r.seq for r in records] == list(range(published))
    # the first one gone, the file is free again
    assert await asyncio.to_thread(main, ["record", *second, "--duration", "0.3"]) == 0


async def test_append_refuses_another_worker_under_a_recorded_stream_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = ReferenceWorker(WorkerConfig(time_scale=0.0, topic="kv"))
    two = ReferenceWorker(WorkerConfig(time_scale=0.0))
    out = tmp_path / "merge.kvrec"
    async with one, two:
        await _traffic(one, 5, seed=5)
        await _traffic(two, 5, seed=6)
        # the default --worker, both times: the same stream id for two publishers
        args = ["record", "--out", str(out), "--duration", "0.5"]
        assert await asyncio.to_thread(main, [*args, *_endpoint_args(one)]) == 0
        before = out.read_bytes()
        capsys.readouterr()
        assert await asyncio.to_thread(main, [*args, *_endpoint_args(two), "--append"]) == 2
    err = capsys.readouterr().err
    assert "stream worker#dp0 is recorded from another source" in err
    assert one.kv_events.endpoints[0] in err and two.kv_events.endpoints[0] in err
    assert out.read_bytes() == before
    # the same source again is a continuation, and a new worker id a new stream: both go in
    with RecordingReader(out) as reader:
        (known,) = reader.sources.values()
    RecordingWriter.append(out, [known, _source(two, "two")]).close()


async def test_an_append_continues_each_stream_where_the_file_ends(
    worker: ReferenceWorker, tmp_path: Path
) -> None:
    published = await _traffic(worker, 20, seed=7)
    out = tmp_path / "sessions.kvrec"
    sources = [_source(worker)]
    first = await record(RecordingWriter.create(out, sources), sources, duration_s=1.0)
    assert first.records == published
    # an idle worker: the second session has nothing new to record
    idle = await record(RecordingWriter.append(out, sources), sources, duration_s=1.0)
    assert idle.records == 0 and idle.streams["w#dp0"]["restarts"] == 0
    # what the worker published between two sessions is recorded once, after the rest
    published = await _traffic(worker, 20, seed=8)
    third = await record(RecordingWriter.append(out, sources), sources, duration_s=1.0)
    assert third.records == published - first.records
    assert [r.seq for r in _records(out)] == list(range(published))
    summary, index = replay_into_index(out)
    (stream,) = summary.streams
    assert (stream.restarts, stream.lost_gaps, stream.records) == (0, 0, published)
    # the index of one session that recorded it all
    whole = tmp_path / "whole.kvrec"
    await record(RecordingWriter.create(whole, sources), sources, duration_s=1.0)
    assert canonical(dump_index(index)) == canonical(dump_index(replay_into_index(whole)[1]))


async def test_the_max_bytes_summary_counts_what_the_file_holds(
    worker: ReferenceWorker, tmp_path: Path
) -> None:
    published = await _traffic(worker, 40, seed=9)
    out = tmp_path / "capped.kvrec"
    sources = [_source(worker)]
    stats = await record(RecordingWriter.create(out, sources), sources, max_bytes=5000)
    assert stats.stopped_by == "max-bytes"
    held = len(_records(out))
    # the subscriber went on with the worker's buffer after the stop: none of it was written
    assert 0 < held < published
    assert stats.records == stats.streams["w#dp0"]["batches"] == held


async def test_a_failed_compressed_write_is_not_counted_as_recorded(
    worker: ReferenceWorker, tmp_path: Path
) -> None:
    # more than two chunks of history: the first chunk (256 records) fits under the limit,
    # the second is refused by it
    assert await _traffic(worker, 350, seed=10) > 600
    sources = [_source(worker)]
    sized = tmp_path / "sized.kvrec"
    await record(RecordingWriter.create(sized, sources, compress=True), sources, duration_s=1.0)
    with RecordingReader(sized) as reader:
        second_chunk = next(p.offset for p in reader if p.number == 256)
    out = tmp_path / "full.kvrec"
    proc = await _cli(
        "record",
        *_endpoint_args(worker),
        "--out",
        str(out),
        "--compress",
        "--duration",
        "10",
        limit_file_bytes=second_chunk + 100,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30.0)
    assert proc.returncode == 1, stderr
    assert b"write failed" in stderr and b"stopped by write-error" in stdout
    held = len(_records(out))  # whole: the refused chunk left nothing behind
    # the first chunk, or a smaller one a flush closed first, or none at all when the
    # recorder's own chunks came out larger than the sized run's (a loaded machine flushes
    # later): whatever it is, the summary counts what the file holds, never the refused ones
    assert held <= 256
    assert _summary_counts(stdout) == (held, held, held)


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


async def test_an_append_replays_the_clear_of_a_restart_found_at_the_seam(
    tmp_path: Path,
) -> None:
    # The worker restarts between two sessions, and its new process has buffered exactly the
    # seqs after the file's last one: the appended records look contiguous. The second
    # session's subscriber clears the stream (the replay starts after our last batch: nothing
    # proves the publisher unchanged); the replay must clear it there too, or it predicts the
    # dead process's pages (false hits), with the new process's fence on them in a dump.
    out = tmp_path / "seam.kvrec"
    async with ReferenceWorker(WorkerConfig(time_scale=0.0, capacity_tokens=1024)) as worker:
        sources = [_source(worker)]
        last = await _traffic(worker, 20, seed=7) - 1
        first = await record(RecordingWriter.create(out, sources), sources, duration_s=1.0)
        assert first.records == last + 1
        kv = worker.kv_events
    restarted = WorkerConfig(
        time_scale=0.0,
        capacity_tokens=1024,
        buffer_steps=5,
        events_port=_port(kv.endpoints[0]),
        replay_port=_port(kv.replay_endpoints[0]),
    )
    async with ReferenceWorker(restarted) as again:
        publisher = again.ranks[0].publisher
        while publisher.next_seq <= last:  # batches that remove nothing held, up to the seam
            publisher.publish([Removed(block_hashes=[publisher.next_seq + 1])])
        await _traffic(again, 5, seed=9)  # one stored batch each: seqs last+1 .. last+5
        assert publisher.next_seq == last + 6, publisher.next_seq
        writer = RecordingWriter.append(out, sources)
        second = await record(writer, sources, duration_s=1.0)
        assert second.streams["w#dp0"]["clears"] == 1
        # the clear mark apart from the messages: it was counted as a sixth record, where
        # inspect and replay count the messages
        assert (second.records, second.marks) == (5, 1)
        said = io.StringIO()
        _print_done(out, writer, second, said)
        assert said.getvalue().startswith(
            f"recorded 5 records and 1 subscriber marks (clear / forget-seq) ({last + 6} "
            "records in the file, "
        ), said.getvalue()
        # what a router subscribing to the new process now holds: its buffer, and nothing else
        fresh = tmp_path / "fresh.kvrec"
        await record(RecordingWriter.create(fresh, sources), sources, duration_s=1.0)
    summary, index = replay_into_index(out)
    assert canonical(dump_index(index)) == canonical(dump_index(replay_into_index(fresh)[1]))
    assert index.last_seq("w#dp0") == last + 5
    (stream,) = summary.streams
    assert stream.marked_clears == 1
    assert summary.records == last + 6  # what the summary above said the file holds
