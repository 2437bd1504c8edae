"""The fleet and the admin state, shared in JetStream KV: one truth for every replica.

Three buckets under the subject prefix:
- `<prefix>_fleet`: one key per worker (`w.<base64url of its id>`), a `WorkerRecord` in JSON:
  its config, whether it is drained, or that it was removed, and the worker as the config file
  last written into the fleet named it. Every replica seeds the workers of its own config file
  with a create-if-absent, so replicas starting at once against an empty cluster agree (the
  union of their configs), and an admin change (a removal, kept as a record, a drain, a worker
  added again with other settings) is not undone by a replica restarting with the worker in
  its file. A file whose entry for a worker differs both from the record and from the file the
  record came from was edited since: a replica starting with it writes its entry, as a reload
  does, when its file is the newer of the two, and every replica applies it (`seed`). Before,
  the record always won, silently: a worker moved to another server in the file kept its old
  URL on every replica, restarted or reloaded, for as long as the cluster kept its record. A
  record that wins over the file is said in one WARNING line (at start, and at each reload:
  `router.http.reload`).
- `<prefix>_evictions`: namespaces evicted by an operator (random keys: the key shows nothing
  of the namespace), kept a day; a starting replica applies those newer than its index (its
  snapshot's, or, cold, its own start: `ClusterService._sync_once`).
- `<prefix>_sessions`: the dashboard sessions logged out (`s.<session id>`, a `LogoutRecord`
  with the session's expiry), kept a session's lifetime: every replica refuses their cookies
  (`SessionBook`, the dashboard's `DashboardSession`), one started later too. A session id
  opens nothing without the cookie's MAC (the admin token's), and is still never logged.

`/admin` on any replica writes here after changing its own state; every replica (itself too)
applies what it reads to its pool, so applying is idempotent. A write made while NATS is away is
kept (the latest per key) and written when it returns, before the buckets are read again: in
this process's memory only, so it is lost if the replica stops first (its admin answer said
`"cluster": "pending"`, and stopping says what was lost). A kept worker change is written only
over the record it was made against (the revision this replica had read of that key): one
another replica changed meanwhile keeps that replica's change, and the kept one is dropped and
said. Before, it was written over whatever was there, so the replica that came back last undid
changes the others had made, and answered `"shared"`, during its absence (a removed worker back,
draining; an undrain undone).

Changes of one worker made on several replicas while NATS hung on them (or on one replica's
link) reach the bucket in any order: each record names the revision its replica had read
(`seen`), a change that saw another stands over it, and of two that did not see each other the
later by `at` is written again over the earlier wherever NATS stored them (`newer_than`).

A resync after the first (NATS came back) seeds the fleet bucket from this replica's pool, not
from its config file: a bucket found empty (a server that lost its store) gets the fleet as the
replicas ran it, drains, admin adds and removals included, instead of the files' workers.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from indexer.namespace import Namespace
from indexer.service import IndexerService
from router.cluster.wire import EvictionRecord, LogoutRecord, WorkerRecord
from router.config import WorkerConfig, shown_worker_id, worker_id_problem
from router.config_diff import worker_settings
from router.errors import NotFoundError
from router.fleet.change import FleetChange
from router.fleet.supervisor import Supervisor
from router.routing.pool import WorkerPool

__all__ = ["EVICTION_TTL_S", "LOGOUT_TTL_S", "FleetState", "SessionBook", "worker_key"]

log = logging.getLogger(__name__)

EVICTION_TTL_S = 24 * 3600.0
# a logout record outlives its session: the dashboard's session lifetime
# (`router.http.dashboard.session.SESSION_S`, which a test holds this to)
LOGOUT_TTL_S = 12 * 3600.0
# what a kept worker write was made against, besides a revision (`FleetState.flush`)
_NO_RECORD = 0  # no record of the key was read (revisions start at 1)
_NOT_READ = -1  # the bucket was not read yet by this process
_LOGOUT = "s."  # the key prefix of a logout record, before the session id
_worker_decoder = msgspec.json.Decoder(WorkerRecord)
_eviction_decoder = msgspec.json.Decoder(EvictionRecord)
_logout_decoder = msgspec.json.Decoder(LogoutRecord)
_json = msgspec.json.Encoder()


class _Change:
    """This replica's last operator change of one worker record, as sent to NATS: its `at`,
    its JSON, and the revision NATS stored it at (None: not known yet, its write unanswered)."""

    __slots__ = ("at", "revision", "value")

    def __init__(self, at: float, value: bytes, revision: int | None = None) -> None:
        self.at = at
        self.value = value
        self.revision = revision


def worker_key(worker_id: str) -> str:
    """The KV key of a worker (ids are URLs; keys take only [-/_=.a-zA-Z0-9])."""
    return "w." + base64.urlsafe_b64encode(worker_id.encode()).decode().rstrip("=")


class SessionBook(Protocol):
    """Where the dashboard's logouts apply (`router.http.dashboard.session.DashboardSession`)."""

    def revoke(self, sid: str, expiry: int) -> None:
        """Refuse the session `sid` until `expiry`."""

    def ended(self) -> dict[str, int]:
        """The sessions ended and not expired: id -> expiry."""

    def expect_revocations(self) -> None:
        """Accept only the sessions started here until `revocations_known`."""

    def revocations_known(self) -> None:
        """The logouts of every replica are read: accept every session not ended."""


class FleetState:
    """Reads and writes the shared fleet and evictions, and applies them to this replica."""

    def __init__(
        self,
        replica: str,
        supervisor: Supervisor,
        pool: WorkerPool,
        indexer: IndexerService,
        change: FleetChange | None = None,
    ) -> None:
        self._replica = replica
        # the records' removals and adds, waited out by the requests they leave no worker
        # (the reloader's, shared by the app: one change for the proxy to wait on)
        self.change = change or FleetChange()
        self._supervisor = supervisor
        self._pool = pool
        self._indexer = indexer
        # writes NATS did not take yet: (bucket, key) -> value, the latest per key
        self.unsent: dict[tuple[str, str], bytes] = {}
        # the revision of each fleet record as this replica last read it: what a kept write
        # was made against (absent: no record of that key was read)
        self.revisions: dict[str, int] = {}
        # of each kept worker write, the revision its key had here when it was first kept
        # (revisions start at 1: `_NO_RECORD` none, `_NOT_READ` the bucket not read yet by
        # this process, started while NATS was away: it knows no revision to write over)
        self._unsent_over: dict[tuple[str, str], int] = {}
        self.fleet_read = False  # the fleet bucket was read once since this process started
        # the keys of the worker records this replica could not read, as they are now: an
        # older version's record of an id this one refuses (a control character in it) is in
        # no pool here, and is removed through this replica's admin API all the same
        # (`unread_worker`)
        self._unread: set[str] = set()
        # of each worker record, this replica's last operator change sent to NATS (`sending`,
        # `wrote`): NATS takes the writes it hung on in any order once it resumes, and the
        # fleet bucket keeps one revision, so another replica's change made without seeing
        # this one (`WorkerRecord.seen`) may land after it; read, the later of the two by
        # `at` is written over it again (`newer_than`). Before, the change that reached NATS
        # last stood: a removal made after a drain on another replica, both during a NATS
        # stall, ended drained everywhere (QA), and so did one made during a stall shorter
        # than the write deadline, or behind one replica's hung link. Changes that saw each
        # other are never weighed by `at`: replicas' clocks need not agree (QA: a replica 10 s
        # behind undid an undrain made after its drain when every change was weighed so)
        self._mine: dict[str, _Change] = {}
        # of each worker record, this replica's change that gave way to a later one (a
        # concurrent one by `at`, or one made after reading it): should NATS store a write of it
        # after that (its first, unanswered then, or one written again), the change that stands
        # (`_standing`) is written again over it. Before, it stood on every replica when the
        # replica whose change it overwrote had restarted meanwhile (QA: an undrain answered
        # "shared", undone by a drain made before it)
        self._gave_way: dict[str, _Change] = {}
        # of each worker record, the change that stands as read here (`_weigh_standing`): the
        # last one read, unless it is a change made before the one standing and without
        # seeing it (concurrent with it, and landed after it); with the revision it was read
        # at. What a change of this replica's that gave way is written over with, should it
        # land (before, the record it overwrote, which may itself be such an earlier change)
        self._standing: dict[str, tuple[bytes, WorkerRecord, int]] = {}
        # the wall clock an operator's change is stamped with (`WorkerRecord.at`)
        self.clock: Callable[[], float] = time.time
        # the kept writes that went to NATS unanswered (`keep_unsent(sent=True)`), as sent: a
        # change kept while NATS was known away never reached it, and is weighed only at the
        # resync, against the revision it was made against (`flush`)
        self._sent_unanswered: dict[tuple[str, str], bytes] = {}
        self._seen_evictions: set[str] = set()
        self.evictions_applied = 0
        self.sessions: SessionBook | None = None  # the dashboard's, behind an admin token
        # the config file this replica started from (or last reloaded) and its modification
        # time (None: no file, or its time unknown: its entries never win over a record)
        self.file_path = ""
        self.file_at: float | None = None
        # of each worker record as last read or written here, the worker as the file behind it
        # named it, and that file's time (`WorkerRecord.file`): an admin change carries them on
        self._filed: dict[str, tuple[WorkerConfig | None, float]] = {}

    # ------------------------------------------------------------------ writing

    def record_worker(
        self, entry_id: str, config: WorkerConfig | None, *, at: float = 0.0, **flags: bool
    ) -> bytes:
        """The JSON of a worker's record as this replica now holds it; `at`: when an operator
        made the change (0: a seed). The file behind it is the one the record had (`filed`);
        it names the revision of the record this replica knows last (`WorkerRecord.seen`)."""
        key = worker_key(entry_id)
        file, file_at = self._filed.get(key, (None, 0.0))
        record = WorkerRecord(
            id=entry_id,
            config=config,
            by=self._replica,
            at=at,
            seen=self._seen(key),
            file=file,
            file_at=file_at,
            **flags,
        )
        return _json.encode(record)

    def _seen(self, key: str) -> int:
        """The newest revision of the record `key` this replica read or wrote."""
        mine = self._mine.get(key)
        written = mine.revision if mine is not None and mine.revision is not None else 0
        return max(self.revisions.get(key, 0), written)

    def sending(self, key: str, value: bytes) -> None:
        """An operator's change of the worker record `key` goes to NATS now (`value`)."""
        with contextlib.suppress(msgspec.DecodeError):
            at = _worker_decoder.decode(value).at
            if at > 0:
                self._mine[key] = _Change(at, value)
                self._gave_way.pop(key, None)  # a newer change of this replica's

    def wrote(self, key: str, value: bytes, revision: int) -> None:
        """NATS stored `value`, this replica's change of the record `key` (or that change
        written again: `newer_than`), at `revision`."""
        mine = self._mine.get(key)
        if mine is not None and self._same_change(mine, value):
            mine.value, mine.revision = value, revision

    def _sent(self, key: str, value: bytes, revision: int) -> None:
        """A kept change of the worker record `key` written at the resync, at `revision`:
        weighed from now on as a change sent (`newer_than`)."""
        self.sending(key, value)
        self.wrote(key, value, revision)

    def _same_worker_change(self, kept: bytes, value: bytes) -> bool:
        """Whether the worker records `kept` (this replica's) and `value` are one operator
        change of this replica's, as sent or written again."""
        at = self._made_here_at(kept)
        return at is not None and at > 0 and self._made_here_at(value) == at

    def _same_change(self, mine: _Change, value: bytes) -> bool:
        """Whether the worker record `value` is the change `mine`, as sent or written again
        (which names the revision it was written over: `over`)."""
        return value == mine.value or self._made_here_at(value) == mine.at

    def _made_here_at(self, value: bytes) -> float | None:
        """The `at` of the worker record `value` when this replica made it (None: another
        replica's, or unreadable): a change is told by its replica and `at`, whatever
        revisions it names."""
        try:
            record = _worker_decoder.decode(value)
        except msgspec.DecodeError:
            return None
        return record.at if record.by == self._replica else None

    def filed(self, worker_id: str, config: WorkerConfig | None) -> None:
        """The config file (`file_at`'s, reloaded) names `worker_id` as `config` now (None:
        not at all): the records written of it from now on say so."""
        self._filed[worker_key(worker_id)] = (config, self.file_at or 0.0)

    def record_eviction(
        self, namespace: Namespace | None = None, *, cache_salt: str | None = None
    ) -> tuple[str, bytes]:
        """(key, JSON) of an eviction record made now: of `namespace`, or of every namespace of
        `cache_salt` ("" for the unsalted ones)."""
        record = EvictionRecord(
            namespace=namespace, cache_salt=cache_salt, at=time.time(), by=self._replica
        )
        return f"e.{uuid.uuid4().hex}", _json.encode(record)

    def record_logout(self, sid: str, expiry: int) -> tuple[str, bytes]:
        """(key, JSON) of the record of a dashboard session logged out here."""
        return _LOGOUT + sid, _json.encode(LogoutRecord(expiry=expiry, by=self._replica))

    def keep_unsent(self, bucket: str, key: str, value: bytes, *, sent: bool = False) -> None:
        """Keep a write NATS did not take, to make on resync over the record it was made
        against (a worker's: `flush`); `sent`: it went to NATS, which did not answer in time
        and may still take it (`newer_than` weighs it against what NATS takes meanwhile)."""
        if (bucket, key) not in self.unsent:
            over = self.revisions.get(key, _NO_RECORD) if self.fleet_read else _NOT_READ
            self._unsent_over[(bucket, key)] = over
        self.unsent[(bucket, key)] = value
        if sent:
            self._sent_unanswered[(bucket, key)] = value
        elif (mine := self._mine.get(key)) is not None and mine.value != value:
            # a change NATS never saw supersedes the one sent before: the resync weighs it
            # (`flush`), and the older one is not written again over another replica's
            del self._mine[key]

    def written(self, bucket: str, key: str) -> None:
        """A newer change of the record `key` was written: one kept for it is obsolete. Before,
        after NATS hung on a write (kept, yet applied once NATS resumed), the change made
        again as the docs advise was shared while the kept one stayed: counted in
        `kvroute_cluster_unsent_admin_writes`, dropped at the next resync as "another
        replica's change", or said lost at a stop."""
        if self.unsent.pop((bucket, key), None) is not None:
            self._unsent_over.pop((bucket, key), None)
            self._sent_unanswered.pop((bucket, key), None)

    def _landed(self, key: str, value: bytes) -> None:
        """`value`, read back as the record `key`, is a write kept here unsent: NATS took it
        after all (it hung past the write's deadline, then answered), and it is no longer
        kept (`newer_than` weighs it against the changes NATS took around it). Before, it
        stayed: counted in `kvroute_cluster_unsent_admin_writes`, and at the next resync its
        own record, newer than the revision it was made against, was taken for another
        replica's change ("not written", WARNING), or it was said lost at a stop (replica QA:
        NATS SIGSTOPped 2.6 s). A worker record is matched as the change it is, written
        again by another replica too (`_written_over`: its `over` differs): before, only its
        bytes were, and a change read back only so stayed kept (QA: counted unsent for 40 s,
        until the next change of that worker)."""
        landed = [
            slot
            for slot, kept in self.unsent.items()
            if slot[1] == key and (kept == value or self._same_worker_change(kept, value))
        ]
        for slot in landed:
            del self.unsent[slot]
            self._unsent_over.pop(slot, None)
            self._sent_unanswered.pop(slot, None)
            said = self.describe(key, value)  # never a salt or a session id
            log.info("cluster: %s was written after all (NATS answered late)", said)

    async def seed(
        self, fleet: KeyValue, workers: Sequence[WorkerConfig], *, running: bool = False
    ) -> None:
        """Create the record of every worker that has none yet: those of this replica's config
        (`workers`), or, `running` (a resync: the bucket may have lost its records), those of
        its pool as it runs, drains included, and the config's workers it no longer has as
        removed."""
        if not running:
            # the config file's: a worker the cluster has a record of is weighed against it
            for config in workers:
                await self._seed_from_file(fleet, config)
            return
        held = {entry.id for entry in self._pool}
        records = [
            (e.id, self.record_worker(e.id, e.config, draining=e.draining)) for e in self._pool
        ]
        records += [
            (c.worker_id, self.record_worker(c.worker_id, None, removed=True))
            for c in workers
            if c.worker_id not in held
        ]
        for worker_id, value in records:
            # a record already there is the cluster's word on the worker: it wins
            with contextlib.suppress(KeyWrongLastSequenceError):
                await fleet.create(worker_key(worker_id), value)

    async def _seed_from_file(self, fleet: KeyValue, config: WorkerConfig) -> None:
        """Create the record of a worker of this replica's config file, or, where the cluster
        has one saying otherwise, write the file's entry if it is an edit newer than the file
        the record came from (the module docstring), else say that the record wins."""
        worker_id = config.worker_id
        key = worker_key(worker_id)
        file_at = self.file_at or 0.0
        self._filed[key] = (config, file_at)
        for _ in range(3):  # another replica's write between the read and ours: weighed again
            with contextlib.suppress(KeyWrongLastSequenceError):
                await fleet.create(key, self.record_worker(worker_id, config))
                return
            try:
                entry = await fleet.get(key)
                record = _worker_decoder.decode(entry.value or b"")
            except (KeyNotFoundError, msgspec.DecodeError):
                return  # gone again, or unreadable (its read says so: `apply_worker`)
            why = self._record_wins(record, config)
            if why is None:
                return
            if why:
                self._filed[key] = (record.file, record.file_at)
                log.warning(
                    "cluster: worker %s of %s%s is not applied: %s",
                    worker_id,
                    self.file_path or "the config",
                    _settings(config, record.config if not record.removed else None),
                    why,
                )
                return
            # drained: a server's drain goes with the server (as a reload's: `Reloader`)
            drained = record.draining and (
                record.config is not None and record.config.server == config.server
            )
            value = self.record_worker(worker_id, config, at=self.clock(), draining=drained)
            with contextlib.suppress(KeyWrongLastSequenceError):
                await fleet.update(key, value, last=entry.revision)
                log.warning(
                    "cluster: worker %s changed in %s since the cluster's record (%s): written "
                    "to the shared fleet, every replica applies it",
                    worker_id,
                    self.file_path or "the config",
                    _settings(config, None if record.removed else record.config, changed=True),
                )
                return

    def _record_wins(self, record: WorkerRecord, config: WorkerConfig) -> str | None:
        """Why the cluster's `record` of a worker stands over `config`, this replica's file's
        entry for it: None when they agree, "" when the file's entry is to be written."""
        running = None if record.removed else record.config
        if running == config:
            return None
        by = f"replica {record.by}" if record.by else "another replica"
        how = (
            "to use the file's entry, edit it and reload (SIGHUP or POST /admin/reload), or "
            "change the worker through the admin API (DELETE, then POST /admin/workers)"
        )
        change = "removed it" if running is None else "changed it"
        if record.file is not None or record.file_at:  # the file behind the record is known
            if record.file == config:
                return (
                    f"the cluster's record stands: {by} {change} through the admin API after "
                    f"this entry of the file was written into the fleet; {how}"
                )
            if self.file_at is not None and self.file_at > record.file_at:
                return ""
            return (
                f"the cluster's record stands: it came from the config file of {by}, edited "
                f"after this one; bring this file up to date, or, {how}"
            )
        # a record from before the file was kept in it: a seed is some file's, taken over by a
        # file known to be edited (dated); an operator's change (or any removal) stands
        if running is not None and not record.at and self.file_at is not None:
            return ""
        return f"the cluster's record stands ({by} {change}); {how}"

    async def seed_logouts(self, sessions_bucket: KeyValue) -> None:
        """Write back the logouts this replica holds that the bucket has no record of (a
        resync: a server that lost its store lost them, and a replica started after would
        take their cookies again)."""
        if self.sessions is None:
            return
        for sid, expiry in self.sessions.ended().items():
            key, value = self.record_logout(sid, expiry)
            with contextlib.suppress(KeyWrongLastSequenceError):
                await sessions_bucket.create(key, value)

    async def flush(self, buckets: dict[str, KeyValue]) -> None:
        """Write what NATS did not take while it was away (raises on failure, keeps the rest).

        A worker's record is written only over the revision it was made against (none: only if
        there is still no record); where another replica changed it meanwhile, that change
        stands and the one kept here is dropped, in one WARNING line. A record that is no
        operator's change (a seed: the store was lost and a replica wrote its pool back) is
        written over. A change made before this process ever read the bucket (it started
        while NATS was away) has no revision to go by: it is written over an older change
        only (`WorkerRecord.at`). An eviction or a logout is always written (its key is its
        own)."""
        for (bucket, key), value in list(self.unsent.items()):
            kv = buckets[bucket]
            if key.startswith("w."):
                over = self._unsent_over.get((bucket, key), _NOT_READ)
                if over == _NOT_READ:
                    await self._settle(kv, key, value, newer_wins=True)
                else:
                    try:
                        if over == _NO_RECORD:
                            revision = await kv.create(key, value)
                        else:
                            revision = await kv.update(key, value, last=over)
                    except KeyWrongLastSequenceError:
                        await self._settle(kv, key, value, newer_wins=False)
                    else:
                        self._sent(key, value, revision)
            else:
                await kv.put(key, value)
            if self.unsent.get((bucket, key)) is value:
                del self.unsent[(bucket, key)]
                self._unsent_over.pop((bucket, key), None)
                self._sent_unanswered.pop((bucket, key), None)

    async def _settle(self, kv: KeyValue, key: str, value: bytes, *, newer_wins: bool) -> None:
        """Write a kept change the record it was made against is not (or is not known to be)
        under: over no record (the store lost), over a seed, and, `newer_wins`, over a change
        made before it; else it is dropped and said."""
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            with contextlib.suppress(KeyWrongLastSequenceError):
                self._sent(key, value, await kv.create(key, value))
                return
        else:
            if entry.value == value:
                self._landed(key, value)  # this very change: NATS took it late
                return
            mine = _worker_decoder.decode(value)
            try:
                theirs = _worker_decoder.decode(entry.value or b"")
            except msgspec.DecodeError:
                theirs = None  # unreadable: no operator's change this replica can weigh
            if theirs is None or theirs.at == 0.0 or (newer_wins and theirs.at < mine.at):
                with contextlib.suppress(KeyWrongLastSequenceError):
                    self._sent(key, value, await kv.update(key, value, last=entry.revision))
                    return
        self._superseded(value)

    def _superseded(self, value: bytes, *, sent: bool = False) -> None:
        """Say that a kept change gives way to another replica's; `sent`: it went to NATS
        unanswered, and may still land there (then written over: `newer_than`). Before, such
        a change was said "not written" though NATS stored it, to have it written over."""
        said = self._describe(value)
        if sent:
            log.warning(
                "cluster: admin change made here while NATS hung (%s) gives way: another "
                "replica changed that worker later, and its change stands (should NATS store "
                "this one still, that change is written again over it)",
                said,
            )
            return
        log.warning(
            "cluster: admin change made here while NATS was away not written (%s): another "
            "replica changed that worker meanwhile, and its change stands",
            said,
        )

    def describe_unsent(self) -> list[str]:
        """The writes NATS did not take yet, as an operator would make them again ("w4
        drained"; an eviction without its namespace or salt; "a dashboard logout")."""
        return [self.describe(key, value) for (_, key), value in self.unsent.items()]

    def describe(self, key: str, value: bytes) -> str:
        """One write as the operator's change it is, naming no secret (no namespace, no salt,
        no session id)."""
        if key.startswith("w."):
            return self._describe(value)
        if key.startswith(_LOGOUT):
            return "a dashboard logout"
        return "a namespace eviction"

    @staticmethod
    def _describe(value: bytes) -> str:
        """A worker record as the change an operator made ("w4 drained")."""
        try:
            record = _worker_decoder.decode(value)
        except msgspec.DecodeError:
            return "a worker change"
        # an id refused now (an older replica's record, removed here: `unread_worker`) quoted
        shown = record.id if worker_id_problem(record.id) is None else shown_worker_id(record.id)
        if record.removed or record.config is None:
            return f"{shown} removed"
        if record.draining:
            return f"{shown} drained"
        return f"{shown} added or undrained"

    # ----------------------------------------------------------------- applying

    async def apply_worker(
        self, value: bytes, key: str = "", revision: int | None = None
    ) -> bytes | None:
        """Make this replica's pool agree with one worker record; or, when it is an operator's
        change made before the one that stands (this replica's own last change of that worker,
        or another's read before) and without seeing it (`weigh`), leave the pool as it is and
        return the one that stands, for the caller to write over this one (revision
        `revision`).

        Its removals and adds are a change of the fleet (`router.fleet.change`): a request
        that finds no worker for its model meanwhile waits for their end, as during a reload
        here. A worker renamed by another replica's reload (its server under a new id) comes
        as the new id's record, then the old id's removal (`router.http.reload`): the new id
        takes the server from the old one here in one change. Before, the removal came first
        and the new id only once the reloading replica had registered it, and this replica's
        requests of that gap got 404s naming no model, then 503s.
        """
        if key and (newer := self.weigh(key, value, revision)) is not None:
            return newer
        try:
            record = _worker_decoder.decode(value)
            if key:
                self._filed[key] = (record.file, record.file_at)
        except msgspec.DecodeError as exc:
            # the message quotes what it refused with repr: no newline of an id splits it
            log.warning("ignoring an unreadable worker record in the fleet bucket: %s", exc)
            if key:
                self._unread.add(key)
            return None
        adds = not record.removed and record.config is not None
        if adds and (problem := worker_id_problem(record.id)):
            # its config's id is checked as it is read; the record's own is checked here (an
            # older replica's, written before ids were bounded): left out as an unreadable
            # record is, quoted clipped. A removal of such an id removes nothing here, and
            # clears it (the one `DELETE /admin/workers/{id}` writes, read back)
            log.warning(
                "ignoring a worker record in the fleet bucket: its id %s %s",
                shown_worker_id(record.id),
                problem,
            )
            if key:
                self._unread.add(key)
            return None
        self._unread.discard(key)
        with self.change.changing():
            await self._apply(record)
        return None

    def weigh(self, key: str, value: bytes, revision: int | None) -> bytes | None:
        """Take the worker record `key` read at `revision` as read (a write kept here that it
        is, landed), and say what to write over it (`newer_than`; None: apply it)."""
        if revision is not None:
            self.revisions[key] = revision
        self._landed(key, value)
        newer = self.newer_than(key, value, revision)
        if revision is not None and not self._weigh_standing(key, value, revision):
            # a change made before the one that stands, without seeing it, stored over it:
            # written over with that one, by whichever replica reads it so first (before,
            # only by the replica whose change it overwrote, which may have restarted, or
            # skipped it: NATS keeps one revision, and a watch behind skips those written
            # over meanwhile)
            standing = self._standing[key][0]
            newer = newer or self._written_over(standing, revision)
        return newer

    def _weigh_standing(self, key: str, value: bytes, revision: int) -> bool:
        """Whether `value`, read at `revision`, is the change that stands now (`_standing`):
        not when it is a change made before the one standing, without seeing it."""
        try:
            record = _worker_decoder.decode(value)
        except msgspec.DecodeError:
            self._standing.pop(key, None)
            return True
        standing = self._standing.get(key)
        if standing is not None:
            _, was, at_revision = standing
            saw = record.seen >= at_revision or record.over == at_revision
            same = record.by == was.by and record.at == was.at
            if not saw and not same and record.at < was.at:
                return False  # concurrent with the one standing, and made before it
        self._standing[key] = (value, record, revision)
        return True

    def newer_than(self, key: str, value: bytes, revision: int | None = None) -> bytes | None:
        """The record to write over `value`, the worker record `key` read at `revision`, or
        None: this replica's last change of it, when `value` is another replica's change made
        before it without seeing it; or the change that stands (`_standing`), when `value` is
        a change of this replica's that gave way to a later one and that NATS stored after it.

        A change that names as seen (`WorkerRecord.seen`) the revision NATS stored this
        replica's at, or a later one, was made after reading it, and one written over exactly
        that revision (`over`) was weighed against it: either stands, whatever the clocks say.
        One that did neither (NATS hung on both, or on one replica's link, and took them in
        any order) is concurrent with it: the later by `at` stands on every replica, the one
        whose change it is writing it again over the other, naming the revision it overwrote
        (`over`), and nothing goes back and forth. A change of this replica's still
        unanswered cannot have been seen (NATS would have been read to store it first), so it
        is weighed by `at` alone; made before `value`, it gives way (kept, it is dropped, and
        said), and should NATS store it after all, the change that stands is written again
        over it (`_gave_way`): the replica whose change that is may have restarted since,
        knowing nothing of it. A seed (`at` 0) is no operator's change, and an earlier change
        of this replica's is no concurrent one: neither wins nor loses here."""
        gave_way = self._gave_way.get(key)
        if gave_way is not None and self._same_change(gave_way, value):
            del self._gave_way[key]  # landed after the change it gave way to: that again
            standing = self._standing.get(key)
            if standing is None or revision is None:
                return None
            return self._written_over(standing[0], revision)
        mine = self._mine.get(key)
        if mine is None:
            return None
        if self._same_change(mine, value):
            # read back (before its write's answer, perhaps): stored at `revision`
            mine.value = value
            if revision is not None:
                mine.revision = revision
            return None
        try:
            theirs = _worker_decoder.decode(value)
        except msgspec.DecodeError:
            return None
        if theirs.at <= 0 or theirs.by == self._replica:
            # a seed; or an earlier change of this replica's, read after its next was sent (the
            # watch behind the admin API): made before it, here (before, it was taken for a
            # concurrent one, and the next written again over it for nothing)
            return None
        if mine.revision is not None:
            if revision is not None and revision <= mine.revision:
                # stored before this replica's change, which NATS stored over it (its answer
                # came before the watch read this far): a later one, it stands, and this
                # replica's is written over as it is read (`_gave_way`)
                if theirs.at > mine.at:
                    del self._mine[key]
                    self._gave_way[key] = mine
                return None
            if theirs.seen >= mine.revision or theirs.over == mine.revision:
                # made after reading this replica's change: it stands (and over another write
                # of this replica's change NATS may still store: its first, or one again)
                del self._mine[key]
                self._gave_way[key] = mine
                return None
        if theirs.at >= mine.at:
            del self._mine[key]  # made later: it stands
            self._gave_way[key] = mine  # NATS may still store a write of it
            for slot, kept in list(self.unsent.items()):
                if slot[1] == key and self._sent_unanswered.get(slot) == kept:
                    del self.unsent[slot]
                    self._unsent_over.pop(slot, None)
                    self._sent_unanswered.pop(slot, None)
                    self._superseded(kept, sent=True)
            return None
        return None if revision is None else self._written_over(mine.value, revision)

    @staticmethod
    def _written_over(value: bytes, revision: int) -> bytes | None:
        """The worker record `value`, to write over the one at `revision` (`over`)."""
        try:
            record = _worker_decoder.decode(value)
        except msgspec.DecodeError:
            return None
        return _json.encode(msgspec.structs.replace(record, over=revision))

    def unread_worker(self, worker_id: str) -> bool:
        """Whether the fleet bucket holds a record of `worker_id` this replica could not read
        (`apply_worker`): no worker of the id is in its pool, but other replicas (of an older
        version) may have one."""
        return worker_key(worker_id) in self._unread

    async def _apply(self, record: WorkerRecord) -> None:
        entry = self._pool.find(record.id)
        if record.removed or record.config is None:
            if entry is not None:
                log.info("worker %s removed by replica %s", record.id, record.by)
                await self._remove(record.id)
            return
        if entry is None or entry.config != record.config:
            if entry is not None:
                await self._remove(record.id)
            # one server is one worker in the pool: the cluster's word is that it is this id now
            server = record.config.server
            for other in [e for e in self._pool if e.config.server == server]:
                log.info("worker %s renamed %s by replica %s", other.id, record.id, record.by)
                await self._remove(other.id)
            log.info("worker %s added by replica %s", record.id, record.by)
            # routed to once registered and health-checked here too (`Supervisor.add`), and
            # never before its drain applies; waited for a few health timeouts at most: a
            # worker whose HTTP hangs goes on being discovered in the background, and holds
            # neither this replica's reading of the fleet nor the records after it
            entry = await self._supervisor.add(
                record.config, must_register=False, draining=record.draining
            )
        if entry.draining != record.draining:
            log.info(
                "worker %s %s by replica %s",
                record.id,
                "drained" if record.draining else "undrained",
                record.by,
            )
            entry.draining = record.draining

    async def _remove(self, worker_id: str) -> None:
        with contextlib.suppress(NotFoundError):  # removed meanwhile
            await self._supervisor.remove(worker_id)

    def apply_eviction(self, key: str, value: bytes, *, newer_than: float | None) -> None:
        """Evict a namespace an operator evicted on some replica (once per record).

        `newer_than`: apply only a record made after that wall time (a warm start's snapshot
        already lacks older ones); None: apply it if it was never seen here.
        """
        self._landed(key, value)
        if key in self._seen_evictions:
            return
        self._seen_evictions.add(key)
        try:
            record = _eviction_decoder.decode(value)
        except msgspec.DecodeError as exc:
            log.warning("ignoring an unreadable eviction record: %s", exc)
            return
        if newer_than is not None and record.at < newer_than:
            return
        # this process's own are marked seen as it makes them (`mark_evictions_seen`); one made
        # under the same replica id by an earlier process applies like any other's. Before,
        # it was skipped for its id: a replica with a fixed `replica_id` restarted from a
        # snapshot older than its eviction kept the tenant, and spread it in its snapshots
        dropped = 0
        if record.cache_salt is not None:
            # pending marks too, of every extra_key: as the evicting replica drops them
            _, dropped = self._indexer.evict_salt(record.cache_salt or None)
        elif record.namespace is not None:
            dropped = self._indexer.evict_namespace(record.namespace)
        else:
            log.warning("ignoring an eviction record that names no namespace and no salt")
            return
        self.evictions_applied += 1
        # said, without the salt or the namespace: what dropped entries here, when and whose
        log.info(
            "applied an eviction replica %s made %.0f s ago: %d index entries dropped",
            record.by,
            time.time() - record.at,
            dropped,
        )

    def apply_logout(self, key: str, value: bytes) -> None:
        """End on this replica a dashboard session logged out on some replica (idempotent)."""
        self._landed(key, value)
        sessions = self.sessions
        if sessions is None or not key.startswith(_LOGOUT):
            return  # no admin token here: no sessions to end
        try:
            record = _logout_decoder.decode(value)
        except msgspec.DecodeError as exc:
            log.warning("ignoring an unreadable logout record: %s", exc)
            return
        sessions.revoke(key.removeprefix(_LOGOUT), record.expiry)

    def mark_evictions_seen(self, keys: Sequence[str]) -> None:
        """Records that need no applying here (this replica made them: its index has them)."""
        self._seen_evictions.update(keys)


def _settings(mine: WorkerConfig, theirs: WorkerConfig | None, *, changed: bool = False) -> str:
    """How a file's entry (`mine`) differs from the cluster's record (`theirs`; None: removed):
    `" (url X; the cluster's: url Y)"`, or, `changed`, `"url Y -> X"`."""
    if theirs is None:
        return "added back" if changed else ""
    differ = worker_settings(mine, theirs)
    if changed:
        return ", ".join(f"{name} {old} -> {new}" for name, new, old in differ)
    ours = ", ".join(f"{name} {new}" for name, new, _ in differ)
    cluster = ", ".join(f"{name} {old}" for name, _, old in differ)
    return f" ({ours}; the cluster's: {cluster})"
