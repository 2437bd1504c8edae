"""What replicas tell each other on NATS: msgspec structs and the codecs built once.

One subject per replica, `<prefix>.replica.<id>`, carries `Batch`es of that replica's
decisions in the order it made them, heartbeats included: NATS keeps one publisher's messages
in order on one subject, so a heartbeat listing the requests in flight is never overtaken by
the `Begin` of one of them. Structs are arrays on the wire (no field names per decision) and
evolve by appending optional fields with defaults.

Salts are secrets, and they travel here: a pending mark names its namespace whole (the other
replicas must mark the same cache key), so this traffic stays inside the cluster and is never
logged.
"""

from __future__ import annotations

import msgspec

from indexer.namespace import Namespace
from router.config import WorkerConfig

__all__ = [
    "Batch",
    "Begin",
    "Decision",
    "End",
    "EvictionRecord",
    "FirstByte",
    "Goodbye",
    "Heartbeat",
    "LogoutRecord",
    "OpenTicket",
    "Pending",
    "Shadow",
    "WorkerRecord",
    "batch_decoder",
    "encoder",
]


class Pending(msgspec.Struct, tag="pending", array_like=True, frozen=True):
    """A request's prefix was routed to (worker, rank): mark it pending there too."""

    worker: str
    dp_rank: int | None
    namespace: Namespace
    tokens: list[int]
    # the request's number (its `Begin`'s; 0: not sent, by a sender from before this field),
    # and what the sender predicted it reuses and saw held there: the admission forecast's
    # book of recency and waiting decisions takes it in as the sender's did
    ticket: int = 0
    kept_tokens: int = 0
    held_tokens: int = 0
    # the prompt's block keys on the chosen stream(s), for pages of `block_size` tokens, sent
    # instead of its tokens (then empty): the sender made them routing it, and a receiver
    # marks and touches the blocks without decoding thousands of token ids (an 8k-token
    # prompt: 512 keys for 8,192 ids) and hashing them again. A receiver whose stream has
    # other pages cannot use them and marks nothing there (no hit is predicted from it). An
    # older sender sends tokens only; an older receiver ignores these and marks nothing. An
    # extra_key's decision comes with its tokens: the receiver ties its marks to the plain
    # pages of the same blocks, whose removal drops them (`PendingTable.twin`).
    block_size: int = 0
    keys: list[int] = []
    # the server `worker` named when the sender decided (`WorkerPool.server_of`; "": a sender
    # from before this field). Ids are names the replicas agree on through the fleet records,
    # one after another: a decision sent while one replica had swapped two ids (or moved an
    # id to another server) and another had not would mark the other server. A receiver that
    # knows the id as another server marks the one meant, under its id there, or nothing
    # (`Peers`); an older receiver ignores it and marks the id, as before.
    server: str = ""
    # the output the request may generate (None: not known, or a sender from before this
    # field): the receiver judges whether the pool has room for it beside the requests in
    # flight as the sender did. Before, it booked the reserve (16 tokens) in its place, took
    # a request waiting for room as admitted, and predicted a request it routed behind it the
    # prefix the worker admitted in the same batch (QA: a false hit across replicas)
    output_tokens: int | None = None


class Begin(msgspec.Struct, tag="begin", array_like=True, frozen=True):
    """A request went to (worker, rank) with this many uncached prompt tokens."""

    ticket: int  # the sender's own number for the request, unique while it is in flight
    worker: str
    dp_rank: int | None
    prefill_tokens: int
    # the output it may generate (None: not known; a sender from before this field sends none)
    output_tokens: int | None = None
    # the KV a decode side holds while the request runs (0: not a decode side)
    kv_tokens: int = 0
    # its whole prompt, cached or not (None: a sender from before this field; its uncached
    # tokens count): the pages a running request keeps, which say whether the requests
    # routed behind it wait for KV room (`router.routing.admission`)
    prompt_tokens: int | None = None


class Shadow(msgspec.Struct, tag="shadow", array_like=True, frozen=True):
    """A request with an extra_key went to (worker, rank): its pages arrive as plain pages of
    its salt, so plain requests must not be predicted them there (`indexer.shadowed`), for
    `keep_s` more seconds at least. Sent whatever the sender's policy, and again to every
    replica after NATS comes back (the shadow outlives the outage)."""

    worker: str
    dp_rank: int | None
    namespace: Namespace
    # the prompt's head: its blocks are shadowed, the last one its tail (what follows may be
    # the extra_key's: `indexer.shadowed`)
    tokens: list[int]
    keep_s: float
    # the request's number (its `Begin`'s, which comes first; 0: none, a shadow sent again or
    # a gateway's): its `End` may withdraw the shadow (`End.withdraw`)
    ticket: int = 0
    # the server `worker` named when the sender decided (as `Pending.server`): a receiver
    # that knows the id as another server applies nothing (the shadow is the indexer's to
    # follow across a rename, not the wire's)
    server: str = ""


class FirstByte(msgspec.Struct, tag="first_byte", array_like=True, frozen=True):
    """The worker answered request `ticket`: its prompt no longer counts as queued prefill."""

    ticket: int


class End(msgspec.Struct, tag="end", array_like=True, frozen=True):
    """Request `ticket` ended: it no longer counts as running."""

    ticket: int
    # what it takes back (`router.routing.load.Withdraw`): 1 its pending marks (it failed), 2
    # those and its shadows (the worker stored nothing); 0: nothing (an older sender sends
    # none, and an older receiver ignores it: it keeps the marks until their TTL)
    withdraw: int = 0


class OpenTicket(msgspec.Struct, array_like=True, frozen=True):
    """One request in flight, as a heartbeat lists it."""

    ticket: int
    worker: str
    dp_rank: int | None
    prefill_tokens: int
    prefilled: bool
    kv_tokens: int = 0  # as `Begin.kv_tokens`
    # as `Begin.output_tokens` and `Begin.prompt_tokens` (a ticket a heartbeat rebuilds,
    # its Begin lost, counts its whole footprint in the pool)
    output_tokens: int | None = None
    prompt_tokens: int | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """The sender is alive, and these are all its requests in flight.

    Listing them makes the load view heal itself: a `Begin` or `End` lost while NATS was away
    is repaired by the next heartbeat.
    """

    open: list[OpenTicket]


class Goodbye(msgspec.Struct, tag="goodbye", array_like=True, frozen=True):
    """The sender stops (a graceful stop): its requests in flight no longer count, at once,
    and it is said stopped (INFO), not silent. Before, the others took a stop for a crash: its
    load counted until `heartbeat_timeout_s`, then a WARNING said it silent. Sent last, alone
    in its batch: a replica from before it drops that batch (an unknown type), nothing else,
    and finds the sender silent as before."""


# a replica drops a batch holding a decision type it does not know (a new type is not an
# optional field): the replicas of one cluster run the same kvroute version, and a new type
# goes alone in its batch (`Goodbye`)
Decision = Pending | Begin | Shadow | FirstByte | End | Heartbeat | Goodbye


class Batch(msgspec.Struct, array_like=True, frozen=True):
    """Decisions of one replica, in order, sent together (one NATS message per loop turn)."""

    replica: str
    sent_at: float  # time.time() when published: the propagation delay, on one host
    decisions: list[Decision]
    # the sending process's own random token: a replica back under the same id (restarted
    # within the heartbeat timeout) is told apart from the one before it ("": an older sender)
    instance: str = ""


class WorkerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A worker's entry in the shared fleet (JetStream KV, one key per worker).

    A removed worker keeps its record (`removed`), so a replica restarting with the worker in
    its config file does not bring it back.
    """

    id: str
    config: WorkerConfig | None = None
    removed: bool = False
    draining: bool = False
    by: str = ""  # the replica that wrote it (for operators reading the bucket)
    # when an operator made the change (time.time()); 0: no operator's change, a seed from a
    # config file or a pool. A change kept through an outage by a replica that never read the
    # bucket is written over an older one only (`FleetState.flush`); any kept change over a seed
    at: float = 0.0
    # the revision of this record's key the writing replica had read (or written) when the
    # change was made (0: none): a change made after reading another replica's one stands over
    # it, whatever the two replicas' clocks say; only changes that did not see each other (NATS
    # hung on both, or on one replica's link) are ordered by `at` (`FleetState.newer_than`)
    seen: int = 0
    # the revision of this record's key it was written over after weighing that record: a
    # change written again over a concurrent earlier one (`FleetState.newer_than`), whose `seen`
    # stays what its operator had read (0: none). The replica whose change sat at that revision
    # takes it as made after its own; any other weighs it as the change it is
    over: int = 0
    # the worker as the config file last written into the fleet named it (None: no file named
    # it: removed from the file, or added through the admin API), and that file's modification
    # time (0: unknown). A record from before these fields has neither. A replica starting with
    # a file whose entry differs from both the record and `file` takes it as an operator's
    # edit, and writes it if its file is the newer (`FleetState.seed`)
    file: WorkerConfig | None = None
    file_at: float = 0.0


class EvictionRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A namespace, or every namespace of one salt, an operator evicted from the index
    (JetStream KV, kept for a day)."""

    namespace: Namespace | None = None
    # an eviction by `cache_salt` ("": the unsalted namespaces): every namespace of that salt in
    # the receiver's own index. The evicting replica's index may not hold them (its streams lag
    # behind, or it never saw that tenant), and the others' must be evicted all the same
    cache_salt: str | None = None
    at: float  # time.time(): a warm start applies the evictions newer than its snapshot
    by: str = ""


class LogoutRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A dashboard session logged out on some replica (JetStream KV, key `s.<session id>`,
    kept for a session's lifetime): every replica refuses its cookie until `expiry`."""

    expiry: int  # the session's, in wall-clock seconds: its id is forgotten after that
    by: str = ""


encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(Batch)
