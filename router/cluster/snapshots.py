"""Index snapshots in JetStream's object store: what a new replica starts from.

The oldest live replica puts its `IndexerService.dump()` under one name every
`snapshot_interval_s`; a starting replica reads the latest back and loads it, then the workers'
replay sockets bring each stream from the snapshot's seq to now. Objects are written with
nats-py's object store (the standard layout, readable with `nats object get`), but read here
with a batched pull consumer: nats-py's own `get` (an ordered push consumer) read a 30 MB
snapshot in about a second on loopback, the pull consumer in under 0.1 s. The object's digest is
checked all the same, and the snapshot's own (`indexer.snapshot`) when it is loaded.
"""

from __future__ import annotations

import base64
import hashlib

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError, ObjectDeletedError

from router.cluster.errors import ClusterError

__all__ = ["SNAPSHOT_NAME", "fetch_snapshot", "publish_snapshot"]

SNAPSHOT_NAME = "latest"
# under NATS's default 1 MiB max_payload, with room for headers
_CHUNK_BYTES = 512 * 1024
_BATCH = 64


async def publish_snapshot(js: JetStreamContext, bucket: str, data: bytes, at: float) -> None:
    """Store `data` (an index dump taken at wall time `at`) as the latest snapshot."""
    store = await js.create_object_store(bucket)
    meta = ObjectMeta(
        name=SNAPSHOT_NAME,
        description=repr(at),
        options=ObjectMetaOptions(max_chunk_size=_CHUNK_BYTES),
    )
    await store.put(SNAPSHOT_NAME, data, meta=meta)


async def fetch_snapshot(js: JetStreamContext, bucket: str) -> tuple[bytes, float] | None:
    """The latest snapshot and the wall time it was taken at, or None when there is none."""
    store = await js.create_object_store(bucket)
    try:
        info = await store.get_info(SNAPSHOT_NAME)
    except (NotFoundError, ObjectDeletedError):
        return None
    size = info.size or 0
    if size == 0 or not info.nuid:
        return None
    subject = f"$O.{bucket}.C.{info.nuid}"
    sub = await js.pull_subscribe(
        subject,
        stream=f"OBJ_{bucket}",
        config=ConsumerConfig(ack_policy=AckPolicy.NONE),
    )
    parts: list[bytes] = []
    got = 0
    try:
        while got < size:
            for msg in await sub.fetch(batch=_BATCH, timeout=5.0):
                parts.append(msg.data)
                got += len(msg.data)
    finally:
        await sub.unsubscribe()
    data = b"".join(parts)
    digest = (info.digest or "").partition("=")[2]
    if digest and base64.urlsafe_b64decode(digest) != hashlib.sha256(data).digest():
        raise ClusterError("the index snapshot in JetStream does not match its digest")
    try:
        at = float(info.description or 0.0)
    except ValueError:
        at = 0.0
    return data, at
