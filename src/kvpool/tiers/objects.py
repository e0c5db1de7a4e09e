"""The shared object-store tier: blocks that left the nodes' disks, in one S3 bucket that
every node of the cluster reads.

Layout under ``s3://BUCKET/PREFIX``::

    packs/<writer>-<segment>.kvs    a disk segment, uploaded as it was when the disk evicted it
    index/<writer>-<segment>.idx    its index: the live blocks (key, offset, size, checksum)

- **Writes.**  The disk tier hands over each segment it evicts (a hard link to the file, so
  the disk's writer never waits and the bytes are not copied); one uploader thread PUTs the
  pack, then its index.  S3 PUTs are atomic and the index goes second, so an index never
  names a pack that is not whole.  At most ``MAX_STAGED_SEGMENTS`` segments wait for
  upload; past that, and on any upload failure, a segment is dropped (counted): the disk
  never waits for the object store.
- **Lookups** read an in-memory index of every pack in the bucket; no request is made on
  the lookup path.  One thread refreshes it every ``refresh_s``: a LIST of ``index/`` and
  a GET of each index it has not seen.  Staleness: a block another node uploaded is found
  here at most ``refresh_s`` after its upload (its writer finds it at once); a pack that
  was deleted stays listed here until the next refresh, and reading it is a miss that
  forgets it at once.
- **Reads** are ranged GETs of the payloads, coalesced per pack, each verified against the
  checksum in the index (xxh3-64, the one the DRAM and disk tiers keep) after it is copied
  into its destination.  A corrupt, short or missing block is never served: it is dropped
  from this node's index and counted.
- **Space: a capacity with eviction, oldest pack first.**  After each refresh, while the
  packs listed hold more than ``capacity`` bytes, the oldest goes (index, then pack).  Why
  not LRU: a read would have to write to the bucket to record itself; why not a bucket
  lifecycle rule: it counts days, not bytes, and not every S3 server runs one.  Every node
  applies the same rule to nearly the same listing, and deletes are idempotent, so two
  nodes deleting one pack is harmless.  An orphan pack (its writer died between the two
  PUTs) is deleted once older than ``ORPHAN_AGE_S``.  So the bucket holds at most
  ``capacity`` bytes (plus what was uploaded since the last refresh) in at most
  ``capacity / segment size`` packs.
- **Deletes last.**  Once a delete returns, no node serves its keys again, whatever upload
  was in flight, and after restarts too:
  - it forgets the keys here at once, drops them from the segments still waiting for
    upload, and from the segment being uploaded: before its index is PUT, they are left out
    of it (no node ever sees them);
  - keys the bucket may list (this node's index held them, or the index of the segment in
    flight was PUT already) get a delete object (``deletes/<writer>-<n>.del``), PUT before
    the delete returns (or, if the store does not take it, by the uploader before its next
    pack): every node's refresh reads it and hides its keys in every pack uploaded before
    it, and a node that starts later reads it too;
  - every key it names is remembered here as deleted, found or not, for some minutes
    (``TOMBSTONE_MIN_S`` at least: past the longest its PUTs may take, and two refreshes):
    a pack of another node in flight meanwhile (a cluster's client deletes on every node)
    is read by a refresh without them, until its writer's delete object is seen.
  A delete object goes once no pack older than it is left.  One this node cannot read
  (garbled, or of a format this release does not read: another node's, of another
  release) hides every pack written before it was (its listing's time): a deleted block
  never comes back.
- **Formats** (:mod:`kvpool.formats`): an index of a format this release does not read, or
  naming a pack of one, is not read (logged, counted as ``unreadable``); the bucket is
  shared by nodes of two releases during a rolling upgrade, so each reads what it can.
- **Tenants** (:meth:`ObjectTier.recount_quotas`: the tenant ledger's ``OBJECT_BYTES``,
  counted again at every refresh): a pack is one disk segment, so one tenant's
  blocks (the disk writes each tenant's segments apart).  A tenant past its share of the
  bucket loses its own oldest packs first, and capacity evicts only packs of nobody or of
  tenants past their share, never those of a tenant within its share.
- **Failures.**  Reads have the read timeout and no retry; uploads, listings and deletes
  have a longer timeout and a few retries.  An unreachable or frozen store turns reads
  into misses within the caller's deadline (the node bounds its wait) and uploads into
  drops; lookups never notice.  A dropped segment's blocks are gone: each drop is logged,
  counted (``dropped_segments``, ``dropped_blocks``) and reported to whoever asks
  :meth:`ObjectTier.take_dropped` (the node tells the writers of its tenant).

Threads: ``contains`` and ``location`` are cheap and may come from the event loop;
``read_many`` blocks and comes from a worker thread.  One lock guards the index, and is
never held during I/O.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import obstore

from kvpool.buffers import copy_with_checksum
from kvpool.errors import ConfigError, FormatError
from kvpool.formats import DELETE_OBJECT, RELEASE
from kvpool.stats import TIER_OBJECT, TierStats
from kvpool.store.accounts import Accounts, Resource
from kvpool.store.quotas import Quotas, stored_bytes
from kvpool.tiers.bucket import (
    DELETES,
    INDEX_VERSION,
    INDEXES,
    MAX_INDEX_BYTES,
    NOT_FOUND,
    PACKS,
    REFUSED,
    STORE_ERRORS,
    DeleteList,
    ObjectStoreConfig,
    PackIndex,
    decode_deletes,
    decode_index,
    encode_index,
    index_name,
    open_store,
)
from kvpool.tiers.disk import segment_version
from kvpool.tiers.tier import KeyIndex, SegmentBlocks

log = logging.getLogger("kvpool.objects")

MAX_STAGED_SEGMENTS = 4
ORPHAN_AGE_S = 600.0
ORPHAN_SWEEP_EVERY = 20  # refreshes
WRITE_TIMEOUT_S = 30.0
WRITE_RETRIES = 3
UPLOAD_CHUNK_BYTES = 8 << 20
READ_COALESCE_BYTES = 64 << 10
READ_RUN_BYTES = 16 << 20  # blocks fetched together: one ranged GET (coalesced)
READ_PARALLELISM = 8  # runs fetched at once
# Keys per delete object: well within what every node reads (MAX_INDEX_BYTES, 80-byte keys).
DELETE_OBJECT_KEYS = 100_000
# How long a deleted key is hidden from packs read meanwhile (another node's upload in
# flight, whose delete object follows it): its PUTs' longest wait, and two refreshes.
TOMBSTONE_MIN_S = 300.0
MAX_TOMBSTONES = 200_000  # about 30 MB; past it the oldest go first (counted)


@dataclass(slots=True, frozen=True)
class ObjectLocation:
    pack: str
    offset: int
    size: int
    checksum: int


@dataclass(slots=True)
class _Pack:
    name: str
    num_bytes: int
    written_at: float
    keys: list[bytes]


@dataclass(slots=True)
class _Upload:
    """The segment the uploader is sending: its blocks (a delete leaves keys out until the
    index is PUT), and once it is, the keys deleted since (kept out of this node's index)."""

    staged: Path
    blocks: SegmentBlocks
    index_sent: bool = False
    deleted: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class ObjectCounters:
    uploads: int = 0  # packs uploaded
    uploaded_blocks: int = 0
    uploaded_bytes: int = 0
    dropped_segments: int = 0  # not uploaded: staging full, or the upload failed
    dropped_blocks: int = 0  # the blocks of those segments: gone
    reads: int = 0  # blocks read and verified
    read_bytes: int = 0
    read_errors: int = 0  # blocks not read: the store did not answer in time, or failed
    corrupt: int = 0  # blocks that did not match their checksum (never served)
    refreshes: int = 0
    refresh_errors: int = 0
    deleted_packs: int = 0  # packs removed to keep the bucket within its capacity
    deletes_sent: int = 0  # delete objects uploaded
    unreadable: int = 0  # index and delete objects not read: garbled, or of another format
    tombstones_dropped: int = 0  # recent deletes forgotten early: past MAX_TOMBSTONES


class ObjectTier(KeyIndex[ObjectLocation]):
    """Blocks in the shared bucket, found by key (a :class:`~kvpool.tiers.tier.Tier` and
    the disk's :class:`~kvpool.tiers.tier.SegmentSink`); see the module docstring for the
    rules.  It reports no KV events: the bucket is shared, and every node would announce
    the same blocks."""

    tier_id = TIER_OBJECT
    medium = "OBJECT"  # it reports no KV events (see above)
    resource = Resource.OBJECT_BYTES

    def __init__(self, config: ObjectStoreConfig, staging: Path, writer: str):
        super().__init__()
        self.config = config
        self.capacity = config.capacity
        self.counters = ObjectCounters()
        self.writer = f"{writer}-{secrets.token_hex(4)}"  # unique across restarts
        self._reader = open_store(config, timeout_s=config.read_timeout_s, retries=0)
        self._fetcher = ThreadPoolExecutor(READ_PARALLELISM, thread_name_prefix="kvpool-object-get")
        self._store = open_store(config, timeout_s=WRITE_TIMEOUT_S, retries=WRITE_RETRIES)
        self._staging = staging
        self._packs: dict[str, _Pack] = {}
        self._queue: deque[tuple[Path, SegmentBlocks]] = deque()
        self._uploading: _Upload | None = None
        self._deletes: list[bytes] = []  # keys deleted here, for the next delete object
        # Keys deleted here, and when: hidden from packs written before then, for a while
        # (the tombstones, oldest first), whether or not a delete object names them.
        self._recent: dict[bytes, float] = {}
        self._tombstones: deque[tuple[float, bytes]] = deque()
        self._tombstone_s = max(
            TOMBSTONE_MIN_S, WRITE_TIMEOUT_S * (WRITE_RETRIES + 1) + 2 * config.refresh_s
        )
        # Blocks of dropped segments not yet reported, by the segment's first key (its
        # tenant's): the node tells that tenant's writers (take_dropped).
        self._dropped: dict[bytes, int] = {}
        self._num_deletes = 0
        # Keys deleted (by any node), and when: hidden in packs written before then.
        self._deleted: dict[bytes, float] = {}
        # Every pack written before this is hidden: a delete object could not be read.
        self._hidden_before = 0.0
        self._delete_lists: dict[str, tuple[float, list[bytes]]] = {}  # name -> (when, keys)
        self.quotas: Quotas | None = None  # tenants' shares of the bucket, when it has tenants
        self._cond = threading.Condition(self._lock)
        self._stopping = False
        self._checked = False
        self._threads: list[threading.Thread] = []
        self._wake = threading.Event()

    # -- life -----------------------------------------------------------------------------

    def check(self) -> None:
        """Check that the bucket can be listed: one that refuses us is a configuration
        error; one that does not answer is retried by the refresher once started.  Nothing
        is written."""
        self._checked = True
        try:
            next(iter(obstore.list(self._reader, INDEXES, chunk_size=1)), None)
        except STORE_ERRORS as exc:
            # A listing's errors come back generic: the status is only in the message.
            text = str(exc)
            if isinstance(exc, REFUSED) or "403 Forbidden" in text:
                reason = "access refused (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
                raise ConfigError(f"object store {self.config.url}: {reason}") from exc
            if isinstance(exc, NOT_FOUND) or "NoSuchBucket" in text:
                raise ConfigError(f"object store {self.config.url}: no such bucket") from exc
            self.counters.refresh_errors += 1
            log.warning("object store %s: not reachable yet: %s", self.config.url, exc)

    def start(self) -> None:
        """Run (checked first, unless :meth:`check` was called): the first refresh follows
        at once, on the refresher's thread.  The staging directory is emptied first
        (leftovers of a crash: just cache): the disk tier that holds it is open, and so
        locked, by then."""
        if not self._checked:
            self.check()
        shutil.rmtree(self._staging, ignore_errors=True)
        self._staging.mkdir(mode=0o700, exist_ok=True)
        for target, name in ((self._upload_loop, "upload"), (self._refresh_loop, "refresh")):
            thread = threading.Thread(target=target, name=f"kvpool-object-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop both threads; segments still waiting for upload are dropped (cache)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._fetcher.shutdown(wait=True)
        shutil.rmtree(self._staging, ignore_errors=True)

    # -- lookups --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(p.num_bytes for p in self._packs.values())

    @property
    def num_packs(self) -> int:
        return len(self._packs)

    def stats(self) -> TierStats:
        counters = self.counters
        return self._stats(
            "object",
            self.capacity,
            self.used_bytes,
            reads=counters.reads,
            writes=counters.uploaded_blocks,
            dropped=counters.dropped_blocks,
            evictions=counters.deleted_packs,
            corrupt=counters.corrupt,
            errors=counters.read_errors + counters.refresh_errors,
        )

    # -- writes ---------------------------------------------------------------------------

    def offer_segment(self, path: Path, blocks: SegmentBlocks) -> bool:
        """The disk evicts the segment at ``path`` holding ``(key, offset, size, checksum)``
        blocks: keep a link to it for upload, or drop it.  Called by the disk's writer,
        under its lock: it only links the file and queues it."""
        if not blocks:
            return False
        with self._cond:
            if self._stopping:
                self._drop(path.name, blocks, "the node is stopping")
                return False
            if len(self._queue) >= MAX_STAGED_SEGMENTS:
                self._drop(path.name, blocks, f"{MAX_STAGED_SEGMENTS} segments wait for upload")
                return False
        staged = self._staging / f"{self.writer}-{path.stem}.kvs"
        try:
            os.link(path, staged)
        except OSError as exc:
            with self._cond:
                self._drop(path.name, blocks, f"cannot stage it: {exc}")
            return False
        with self._cond:
            self._queue.append((staged, blocks))
            self._cond.notify()
        return True

    def _drop(self, name: str, blocks: SegmentBlocks, why: str) -> None:
        """A segment the bucket will not get (under the lock): its blocks are gone, which the
        log, the counters and the writers of its tenant are told."""
        self.counters.dropped_segments += 1
        self.counters.dropped_blocks += len(blocks)
        owner = blocks[0][0] if blocks else b""
        self._dropped[owner] = self._dropped.get(owner, 0) + len(blocks)
        log.warning("object store: segment %s (%d blocks) dropped: %s", name, len(blocks), why)

    def take_dropped(self) -> dict[bytes, int]:
        """Blocks of dropped segments since the last call, by each segment's first key (its
        tenant's, where the node has tenants)."""
        with self._cond:
            dropped, self._dropped = self._dropped, {}
        return dropped

    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._deletes and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                deletes = self._deletes[:DELETE_OBJECT_KEYS]
                del self._deletes[:DELETE_OBJECT_KEYS]
                if deletes:
                    self._num_deletes += 1
                    number = self._num_deletes
            if deletes:  # before any pack: a pack uploaded later cannot hold them
                try:
                    self._send_deletes(deletes, number)
                except STORE_ERRORS as exc:
                    log.warning(
                        "delete of %d blocks from the object store failed: %s", len(deletes), exc
                    )
                continue
            with self._cond:
                if not self._queue:
                    continue
                upload = self._uploading = _Upload(*self._queue.popleft())
            try:
                self._upload(upload)
            except (*STORE_ERRORS, FormatError) as exc:  # a segment's stamp damaged meanwhile
                with self._cond:
                    self._drop(upload.staged.name, upload.blocks, f"upload failed: {exc}")
            finally:
                with self._cond:
                    self._uploading = None
                upload.staged.unlink(missing_ok=True)

    def _upload(self, upload: _Upload) -> None:
        staged = upload.staged
        name = staged.name
        num_bytes = staged.stat().st_size
        obstore.put(
            self._store, PACKS + name, staged, chunk_size=UPLOAD_CHUNK_BYTES, max_concurrency=4
        )
        with self._lock:  # from here a delete of these blocks needs a delete object
            upload.index_sent = True
            blocks = list(upload.blocks)
        if not blocks:
            return  # every block was deleted meanwhile: an orphan pack, swept later
        index = PackIndex(
            version=INDEX_VERSION,
            kvpool_version=RELEASE,
            pack_format=segment_version(staged),
            pack=name,
            pack_bytes=num_bytes,
            written_at=time.time(),
            writer=self.writer,
            keys=[b[0] for b in blocks],
            offsets=[b[1] for b in blocks],
            sizes=[b[2] for b in blocks],
            checksums=[b[3] for b in blocks],
        )
        obstore.put(self._store, INDEXES + index_name(name), encode_index(index))
        with self._lock:
            self._add(index, hidden=upload.deleted)
        self.counters.uploads += 1
        self.counters.uploaded_blocks += len(blocks)
        self.counters.uploaded_bytes += num_bytes

    def _send_deletes(self, keys: list[bytes], number: int) -> None:
        name = f"{self.writer}-{number:08d}.del"
        deletes = DeleteList(
            version=DELETE_OBJECT.version,
            kvpool_version=RELEASE,
            written_at=time.time(),
            writer=self.writer,
            keys=keys,
        )
        obstore.put(self._store, DELETES + name, msgspec.msgpack.encode(deletes))
        with self._lock:
            self._apply_deletes(name, deletes)
        self.counters.deletes_sent += 1

    # -- the shared index -----------------------------------------------------------------

    def _refresh_loop(self) -> None:
        refreshes = 0
        wait = 0.0
        while not self._wake.wait(wait):
            wait = self.config.refresh_s
            refreshes += 1
            try:
                self.refresh()
                if refreshes % ORPHAN_SWEEP_EVERY == 0:
                    self._sweep_orphans()
            except STORE_ERRORS as exc:
                self.counters.refresh_errors += 1
                log.info("object store index refresh failed: %s", exc)

    def refresh(self) -> None:
        """Bring the index up to the bucket's: read new index objects, forget gone ones,
        then keep the bucket within its capacity."""
        listed: dict[str, int] = {}
        for chunk in obstore.list(self._store, INDEXES, chunk_size=1000):
            for meta in chunk:
                name = meta["path"].rsplit("/", 1)[-1]
                if name.endswith(".idx"):
                    listed[name[: -len(".idx")] + ".kvs"] = meta["size"]
        deletes: dict[str, tuple[int, float]] = {}  # name -> size, when it was written
        for chunk in obstore.list(self._store, DELETES, chunk_size=1000):
            for meta in chunk:
                when = meta["last_modified"].timestamp()
                deletes[meta["path"].rsplit("/", 1)[-1]] = meta["size"], when
        with self._lock:
            for gone in [p for p in self._packs if p not in listed]:
                self._forget_pack(gone)
            new = [p for p in listed if p not in self._packs]
            new_deletes = [d for d in deletes if d not in self._delete_lists]
        for name in new_deletes:  # first: a pack read below then hides what they delete
            size, when = deletes[name]
            try:
                if size > MAX_INDEX_BYTES:
                    raise ValueError(f"{size} bytes")
                data = obstore.get(self._store, DELETES + name).bytes()
                delete_list = decode_deletes(memoryview(data))
                delete_list.check()
            except NOT_FOUND:
                continue
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning(
                    "delete object %s is unreadable (%s): every pack written before it is hidden",
                    name,
                    exc,
                )
                self.counters.unreadable += 1
                delete_list = DeleteList(version=0, written_at=when, writer="", keys=[])
                with self._lock:
                    self._hide_before(when)
            with self._lock:
                self._apply_deletes(name, delete_list)
        for name in new:
            if listed[name] > MAX_INDEX_BYTES:
                log.warning("index of %s is %d bytes: ignored", name, listed[name])
                continue
            try:
                data = obstore.get(self._store, INDEXES + index_name(name)).bytes()
                index = decode_index(memoryview(data))
                index.check()
                if index.pack != name:
                    raise ValueError(f"index names pack {index.pack}")
            except NOT_FOUND:
                continue  # deleted meanwhile
            except (msgspec.DecodeError, ValueError) as exc:
                log.warning("index of %s is unreadable: %s", name, exc)
                self.counters.unreadable += 1
                continue
            with self._lock:
                self._add(index)
        self.counters.refreshes += 1
        with self._lock:
            self._forget_tombstones(time.time())
        self._keep_within_capacity()
        self._drop_old_deletes()

    def _apply_deletes(self, name: str, deletes: DeleteList) -> None:
        """Hide ``deletes.keys`` in every pack written before it (under the lock)."""
        when = deletes.written_at
        self._delete_lists[name] = (when, list(deletes.keys))
        for key in deletes.keys:
            self._deleted[key] = max(when, self._deleted.get(key, when))
            location = self._index.get(key)
            if location is not None and self._packs[location.pack].written_at < when:
                del self._index[key]

    def _hide_before(self, when: float) -> None:
        """Hide every pack written before ``when`` (under the lock)."""
        self._hidden_before = max(self._hidden_before, when)
        for pack in self._packs.values():
            if pack.written_at < when:
                for key in pack.keys:
                    location = self._index.get(key)
                    if location is not None and location.pack == pack.name:
                        del self._index[key]

    def _drop_old_deletes(self) -> None:
        """Delete objects older than every pack left hide nothing more: they go."""
        with self._lock:
            oldest = min((p.written_at for p in self._packs.values()), default=time.time())
            done = [n for n, (when, _) in self._delete_lists.items() if when < oldest]
            for name in done:
                when, keys = self._delete_lists.pop(name)
                for key in keys:
                    if self._deleted.get(key, when + 1) <= when:
                        del self._deleted[key]
        for name in done:
            obstore.delete(self._store, DELETES + name)

    def _add(self, index: PackIndex, hidden: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """A pack the bucket holds, into the index (under the lock): its blocks but those
        deleted since it was written, and ``hidden``."""
        if index.pack in self._packs:
            return
        self._packs[index.pack] = _Pack(
            index.pack, index.pack_bytes, index.written_at, list(index.keys)
        )
        if index.written_at < self._hidden_before:
            return  # an unreadable delete object may name its blocks
        for key, offset, size, checksum in zip(
            index.keys, index.offsets, index.sizes, index.checksums, strict=True
        ):
            deleted_at = max(self._deleted.get(key, 0.0), self._recent.get(key, 0.0))
            if deleted_at > index.written_at or key in hidden:
                continue  # deleted after this pack was written
            self._index[key] = ObjectLocation(index.pack, offset, size, checksum)

    def _forget_pack(self, name: str) -> None:
        pack = self._packs.pop(name, None)
        if pack is None:
            return
        for key in pack.keys:
            location = self._index.get(key)
            if location is not None and location.pack == name:
                del self._index[key]

    def recount_quotas(self, accounts: Accounts) -> None:
        """Tenants' shares of the bucket: ``accounts``' ``OBJECT_BYTES`` limits (none: no
        tenants); what each holds is counted again from the packs, into that ledger, and
        the shares are applied at the next refresh."""
        with self._lock:
            if not accounts.metered(self.resource).limits:
                self.quotas = None
                return
            quotas = Quotas(accounts, self.resource, stored_bytes)
            quotas.recount((p.keys[0], p.num_bytes) for p in self._packs.values() if p.keys)
            self.quotas = quotas

    def _keep_within_capacity(self) -> None:
        """Oldest packs first: those of a tenant past its share, then, while the bucket is
        past its capacity, those of nobody (no tenant) -- never a pack of a tenant within
        its share.  A pack is one disk segment: one tenant's blocks."""
        with self._lock:
            packs = sorted(self._packs.values(), key=lambda p: (p.written_at, p.name))
            total = sum(p.num_bytes for p in packs)
            quotas = self.quotas
            if quotas is not None:  # the packs the refresh found, every node's
                quotas.recount((p.keys[0], p.num_bytes) for p in packs if p.keys)
            victims = []
            for pack in packs:
                owner = pack.keys[0] if pack.keys else b""
                if quotas is None:
                    if total <= self.capacity:
                        break
                elif not quotas.room(owner, 0) and (
                    total <= self.capacity or not quotas.may_evict(owner, None)
                ):
                    continue
                victims.append(pack.name)
                total -= pack.num_bytes
                if quotas is not None:
                    quotas.removed(owner, pack.num_bytes)
                self._forget_pack(pack.name)
        for name in victims:
            obstore.delete(self._store, INDEXES + index_name(name))
            obstore.delete(self._store, PACKS + name)
            self.counters.deleted_packs += 1

    def _sweep_orphans(self) -> None:
        now = time.time()
        with self._lock:
            known = set(self._packs)
        for chunk in obstore.list(self._store, PACKS, chunk_size=1000):
            for meta in chunk:
                name = meta["path"].rsplit("/", 1)[-1]
                age = now - meta["last_modified"].timestamp()
                if name not in known and age > ORPHAN_AGE_S:
                    obstore.delete(self._store, PACKS + name)

    # -- reads ----------------------------------------------------------------------------

    def read_many(self, jobs: Sequence[tuple[bytes, memoryview]]) -> list[int | None]:
        """Read each block into its destination (at least its size) and verify it: its
        checksum, or ``None`` where it is not in the bucket, could not be read in time, or
        failed verification (then it is forgotten and counted).

        Blocks are grouped into runs (one pack, up to ``READ_RUN_BYTES``), fetched in
        parallel; each run is copied and verified as soon as it arrives, while the
        others are still on the wire."""
        results: list[int | None] = [None] * len(jobs)
        runs: list[tuple[str, list[tuple[int, ObjectLocation]]]] = []
        with self._lock:
            for i, (key, dst) in enumerate(jobs):
                location = self._index.get(key)
                if location is None or len(dst) < location.size:
                    continue
                last = runs[-1] if runs else None
                if (
                    last is not None
                    and last[0] == location.pack
                    and sum(loc.size for _, loc in last[1]) + location.size <= READ_RUN_BYTES
                ):
                    last[1].append((i, location))
                else:
                    runs.append((location.pack, [(i, location)]))
        fetches = {self._fetcher.submit(self._fetch, pack, run): (pack, run) for pack, run in runs}
        for done in as_completed(fetches):
            pack, run = fetches[done]
            try:
                parts = done.result()
            except NOT_FOUND:
                with self._lock:
                    self._forget_pack(pack)
                self.counters.read_errors += len(run)
                continue
            except STORE_ERRORS as exc:
                log.info("object store read of %d block(s) failed: %s", len(run), exc)
                self.counters.read_errors += len(run)
                continue
            for (i, location), data in zip(run, parts, strict=True):
                results[i] = self._verify(jobs[i], location, memoryview(data))
        return results

    def _fetch(self, pack: str, run: list[tuple[int, ObjectLocation]]) -> list[Any]:
        return obstore.get_ranges(
            self._reader,
            PACKS + pack,
            starts=[loc.offset for _, loc in run],
            lengths=[loc.size for _, loc in run],
            coalesce=READ_COALESCE_BYTES,
        )

    def _verify(
        self, job: tuple[bytes, memoryview], location: ObjectLocation, data: memoryview
    ) -> int | None:
        key, dst = job
        target = dst[: location.size]
        # The checksum of the copy, not of obstore's buffer: what is served is what was
        # verified.
        if len(data) == location.size and copy_with_checksum(target, data) == location.checksum:
            self.counters.reads += 1
            self.counters.read_bytes += location.size
            return location.checksum
        self.counters.corrupt += 1
        log.warning(
            "object store block %s of %s is corrupt: dropped", key.hex()[:16], location.pack
        )
        with self._lock:
            if self._index.get(key) == location:
                del self._index[key]
        return None

    def may_hold(self, keys: Sequence[bytes]) -> bool:
        """Known in the bucket, or possibly in a segment waiting for upload or being sent."""
        with self._cond:
            if self._queue or self._uploading is not None:
                return True
            return any(key in self._index for key in keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete these blocks for good (see the module docstring): forgotten here at once,
        left out of the segments waiting for upload and of the one being sent, and for
        those the bucket may list a delete object, PUT before this returns where the store
        takes it.  Their bytes go when their pack ages out.  How many were found here (in
        the index, or on their way into the bucket)."""
        wanted = set(keys)
        now = time.time()
        with self._cond:
            # What the bucket lists (this node's index covers every node's packs, up to one
            # refresh; the node that uploaded a newer one is asked too): a delete object.
            listed = [k for k in keys if self._index.pop(k, None) is not None]
            found = set(listed)
            for n, (staged, blocks) in enumerate(self._queue):
                found.update(b[0] for b in blocks if b[0] in wanted)
                self._queue[n] = (staged, [b for b in blocks if b[0] not in wanted])
            upload = self._uploading
            if upload is not None:
                sending = [b[0] for b in upload.blocks if b[0] in wanted]
                found.update(sending)
                if upload.index_sent:  # the bucket may list them: a delete object too
                    upload.deleted.update(sending)
                    listed.extend(sending)
                else:  # left out of its index: no node will see them
                    upload.blocks = [b for b in upload.blocks if b[0] not in wanted]
            for key in wanted:  # hidden from any pack written before now
                self._recent[key] = now
                self._tombstones.append((now, key))
            self._forget_tombstones(now)
        listed = list(dict.fromkeys(listed))
        if listed and not self._stopping:
            self._delete_now(listed)
        return len(found)

    def _delete_now(self, keys: list[bytes]) -> None:
        """A delete object for ``keys``, PUT now (on the caller's thread); if the store does
        not take it, the uploader sends it ahead of its next pack."""
        with self._cond:
            self._num_deletes += 1
            number = self._num_deletes
        try:
            self._send_deletes(keys, number)
        except STORE_ERRORS as exc:
            log.warning(
                "delete object for %d blocks not written (%s): the uploader sends it next",
                len(keys),
                exc,
            )
            with self._cond:
                self._deletes.extend(keys)
                self._cond.notify()

    def _forget_tombstones(self, now: float) -> None:
        """Keys deleted here longer ago than the tombstone time, or past ``MAX_TOMBSTONES``,
        are no longer hidden from packs read later but by the delete objects that name them
        (under the lock)."""
        tombstones = self._tombstones
        expired = now - self._tombstone_s
        while tombstones and (tombstones[0][0] < expired or len(tombstones) > MAX_TOMBSTONES):
            when, key = tombstones.popleft()
            if when >= expired:
                self.counters.tombstones_dropped += 1
            if self._recent.get(key) == when:
                del self._recent[key]
