"""A scripted KV-event publisher for integration tests: real PUB and ROUTER sockets on 127.0.0.1.

It speaks the real transport (frames from `indexer.protocol.frames`, payloads from the real
encoder) and can misbehave on purpose: drop a live message (kept in the replay buffer, as a PUB
dropping for a slow subscriber would), restart (seq back to 0, buffer emptied), keep only the
newest N batches for replay, answer in the old or new reply layout, never answer, or put
garbage on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from indexer.protocol.encode import WireLayout, encode_batch
from indexer.protocol.events import EventBatch, Removed, Stored
from indexer.protocol.frames import (
    build_live,
    build_replay_end,
    build_replay_reply,
    parse_replay_request,
)


class ScriptedPublisher:
    """PUB + replay ROUTER with a bounded buffer; use as an async context manager."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: bytes = b"kv",
        buffer_steps: int = 10_000,
        reply_with_topic: bool = True,
        answer_replays: bool = True,
        layout: WireLayout = "array",
        endpoints: tuple[str, str] | None = None,
    ) -> None:
        self.topic = topic
        self.reply_with_topic = reply_with_topic
        self.answer_replays = answer_replays
        self.layout: WireLayout = layout
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.replay_requests: list[int] = []
        # answers a replay request from `start` with these frames instead (an end marker
        # included, or not); None from it: the usual answer
        self.answer_with: Callable[[int], list[list[bytes]] | None] | None = None
        self.answer_delay_s = 0.0  # before each answer: a busy (or remote) replay socket
        self.end_delay_s = 0.0  # between an answer's batches and its end marker
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if endpoints is not None:
            # the ports of a publisher that died: a restarted process on the same sockets
            self.endpoint, self.replay_endpoint = endpoints
            try:
                self.pub.bind(self.endpoint)
                self.router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                # a port still taken: the caller may try again, leaving no socket open
                self.pub.close(linger=0)
                self.router.close(linger=0)
                raise
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ScriptedPublisher:
        self._task = asyncio.create_task(self._serve_replays())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def publish(
        self, batch: EventBatch, *, drop: bool = False, corrupt_live: bool = False
    ) -> int:
        """Publish the next batch (or only buffer it when `drop`); returns its seq.

        `corrupt_live` damages the live copy only (a bit flip in flight): the replay buffer
        keeps the good bytes, as the engine's does.
        """
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(batch, self.layout)
        self.buffer.append((seq, payload))
        if not drop:
            live = b"\xc1" + payload[1:] if corrupt_live else payload
            await self.pub.send_multipart(build_live(self.topic, seq, live))
        return seq

    async def publish_payload(self, payload: bytes) -> int:
        """Publish (and buffer) arbitrary payload bytes under the next seq."""
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        await self.pub.send_multipart(build_live(self.topic, seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        """Put arbitrary frames on the live socket."""
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine restarted: seq back to 0 and an empty replay buffer (same sockets, so
        no connection drops: only the seqs and the buffered batches tell)."""
        self.next_seq = 0
        self.buffer.clear()

    async def _serve_replays(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            identity, body = frames[0], frames[1:]
            start = parse_replay_request(body)
            self.replay_requests.append(start)
            if not self.answer_replays:
                continue
            if self.answer_delay_s:
                await asyncio.sleep(self.answer_delay_s)
            scripted = self.answer_with(start) if self.answer_with is not None else None
            if scripted is not None:
                for reply in scripted:
                    await self.router.send_multipart([identity, *reply])
                continue
            topic = self.topic if self.reply_with_topic else None
            for seq, payload in list(self.buffer):
                if seq >= start:
                    reply = build_replay_reply(topic, seq, payload)
                    await self.router.send_multipart([identity, *reply])
            if self.end_delay_s:
                await asyncio.sleep(self.end_delay_s)
            end = build_replay_end(with_topic=self.reply_with_topic)
            await self.router.send_multipart([identity, *end])


def engine_hash(salt: str | None, prefix: tuple[int, ...]) -> int:
    """A deterministic signed-int64 stand-in for SGLang's event hash."""
    return hash((salt, prefix)) % (2**64) - 2**63


def workload(seed: int, batches: int, block_size: int = 4) -> list[EventBatch]:
    """Coalesced SGLang-style batches: chained stores in three namespaces, removes, a flush."""
    rng = random.Random(seed)
    salts = [None, "tenant-a", "tenant-b"]
    docs = [[rng.randrange(50) for _ in range(block_size * 8)] for _ in range(5)]
    held: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    out = []
    for step in range(batches):
        events: list[Stored | Removed] = []
        for _ in range(rng.randrange(1, 4)):
            salt = rng.choice(salts)
            doc = docs[rng.randrange(len(docs))]
            if held and rng.random() < 0.3:
                victims = rng.sample(sorted(held), min(len(held), 2))
                for h in victims:
                    del held[h]
                events.append(Removed(block_hashes=victims))  # type: ignore[arg-type]
                continue
            n = rng.randrange(1, 9)
            start = rng.randrange(n)
            parent = engine_hash(salt, tuple(doc[: start * block_size])) if start else None
            if parent is not None and parent not in held:
                start, parent = 0, None
            prefixes = [tuple(doc[: (b + 1) * block_size]) for b in range(start, n)]
            hashes = [engine_hash(salt, p) for p in prefixes]
            for h, p in zip(hashes, prefixes, strict=True):
                held[h] = (salt, p)
            events.append(
                Stored(
                    block_hashes=hashes,  # type: ignore[arg-type]
                    parent=parent,
                    token_ids=doc[start * block_size : n * block_size],  # type: ignore[arg-type]
                    block_size=block_size,
                    medium="GPU",
                    cache_salt=salt,
                )
            )
        out.append(EventBatch(ts=float(step), events=events))  # type: ignore[arg-type]
    return out
