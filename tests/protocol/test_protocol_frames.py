"""Frame codec against every capture: live frames, both replay layouts, end marker, gaps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from indexer.errors import ProtocolError
from indexer.protocol import (
    END_SEQ,
    ReplayData,
    ReplayEnd,
    build_live,
    build_replay_end,
    build_replay_reply,
    build_replay_request,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    topic_matches,
)

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "kv-events"
LIVE = sorted(p.name for p in FIXTURE_DIR.glob("*-live-*.json"))
REPLAY = sorted(p.name for p in FIXTURE_DIR.glob("*-replay*.json"))

Load = Callable[[str], dict[str, Any]]


def _frames(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


@pytest.mark.parametrize("name", LIVE)
def test_live_frames_parse_and_rebuild(name: str, load_fixture: Load) -> None:
    data = load_fixture(name)
    frames = _frames(data["frames"])
    message = parse_live(frames)
    assert message.topic == data["expected"]["topic"].encode()
    assert message.seq == data["expected"]["seq"]
    assert message.payload == frames[2]
    assert build_live(message.topic, message.seq, message.payload) == frames


def test_scenario_frames_count_published_batches(load_fixture: Load) -> None:
    ops = load_fixture("scenario-radix-salted.json")["operations"]
    seqs = [parse_live(_frames(op["frames"])).seq for op in ops if op["frames"]]
    assert seqs == list(range(len(seqs)))


@pytest.mark.parametrize("name", REPLAY)
def test_replay_capture(name: str, load_fixture: Load) -> None:
    data = load_fixture(name)
    expected = data["expected"]
    start = data["request"]["start_seq"]
    with_topic = "topic" in expected["reply_layout"]

    request = _frames(data["request"]["frames_sent"])
    assert build_replay_request(start) == request
    assert parse_replay_request(request) == start

    replies = [_frames(reply) for reply in data["replies"]]
    parsed = [parse_replay_reply(reply) for reply in replies]
    # Exactly one end marker, last, in the layout of this version.
    assert isinstance(parsed[-1], ReplayEnd)
    assert replies[-1] == _frames(expected["end_marker"])
    assert build_replay_end(with_topic=with_topic) == replies[-1]
    data_replies = parsed[:-1]
    assert not any(isinstance(reply, ReplayEnd) for reply in data_replies)

    seqs: list[int] = []
    for frames, reply in zip(replies, data_replies, strict=False):
        assert isinstance(reply, ReplayData)
        assert (reply.topic is not None) == with_topic
        assert build_replay_reply(reply.topic, reply.seq, reply.payload) == frames
        seqs.append(reply.seq)
    assert seqs == expected["seqs"]
    first = seqs[0] if seqs else None
    assert first == expected["first_seq"]
    # The consumer's gap rule: the first replayed seq is later than the one asked for.
    assert (first is not None and first > start) == expected["gap"]


def test_gap_captures_start_later_than_asked(load_fixture: Load) -> None:
    for name in ("sglang-0.5.21-replay-gap.json", "sglang-0.5.23-replay-gap.json"):
        data = load_fixture(name)
        assert data["expected"]["gap"] is True
        first = parse_replay_reply(_frames(data["replies"][0]))
        assert isinstance(first, ReplayData)
        assert first.seq > data["request"]["start_seq"]


def test_empty_topic_data_reply_is_not_an_end_marker(load_fixture: Load) -> None:
    data = load_fixture("sglang-0.5.23-replay-empty-topic.json")
    first = _frames(data["replies"][0])
    assert len(first) == len(_frames(data["expected"]["end_marker"]))
    parsed = parse_replay_reply(first)
    assert isinstance(parsed, ReplayData)
    assert parsed.topic == b""


def test_empty_replay_is_only_the_end_marker(load_fixture: Load) -> None:
    data = load_fixture("sglang-0.5.23-replay-empty.json")
    assert [type(parse_replay_reply(_frames(r))) for r in data["replies"]] == [ReplayEnd]


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"x", pack_seq(1), b"p"],
        [b""],
        [b"", b"\x00" * 7, b"p"],
        [b"", b"t", b"\x00" * 9, b"p"],
        [b"", b"a", b"b", b"c", b"d"],
    ],
)
def test_bad_replay_replies_raise_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        parse_replay_reply(frames)


@pytest.mark.parametrize(
    "frames", [[], [b"t", pack_seq(0)], [b"t", b"\x01", b"p"], [b"t", pack_seq(0), b"p", b"x"]]
)
def test_bad_live_frames_raise_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        parse_live(frames)


def test_seq_bounds_and_prefix_topics() -> None:
    assert pack_seq(END_SEQ) == b"\xff" * 8
    for bad in (-1, END_SEQ + 1):
        with pytest.raises(ProtocolError):
            pack_seq(bad)
    with pytest.raises(ProtocolError):
        parse_replay_request([b"x", pack_seq(0)])
    assert topic_matches(b"kv@worker-0@model", b"kv@worker-0")
    assert topic_matches(b"anything", b"")
    assert not topic_matches(b"kv@worker-1", b"kv@worker-0")
