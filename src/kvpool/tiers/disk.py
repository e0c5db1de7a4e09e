"""The local disk tier: blocks evicted from DRAM, in append-only segment files.

Layout (log-structured, as caches on flash are: large sequential writes, no per-block
files, no in-place updates)::

    PATH/kvpool-disk.id          the tier's identity (so that a wrong PATH is refused) and
                                 format, and the release that opened it last
    PATH/seg-00000001.kvs        segment files, up to ``segment_bytes`` each:
        stamp                    the segment's format and the release that wrote it
        record*                  header (key, size, checksum, header checksum) + payload
        [footer, trailer]        once sealed: every record's header again, in one piece

- Writes append whole records to the open segment (one ``pwritev`` per batch); a full
  segment is sealed with a footer that lists its records, so that a start reads one footer
  per sealed segment instead of every header.  Only the open segment is scanned at start,
  header by header, up to the first torn or garbled one.
- Every read is verified against the block's checksum (xxh3-64, the same the DRAM tier
  keeps): a payload torn by power loss, garbled or truncated on disk is detected, never
  served, dropped from the index and counted.
- Space: when the segments would pass the tier's capacity, the least recently used sealed
  segment goes (its file is deleted, with every block in it): LRU at segment granularity,
  which keeps writes sequential and needs no compaction.  A block read from a segment
  makes that segment recent again.
- Tenants (:meth:`DiskTier.recount_quotas`: a :class:`~kvpool.store.quotas.Quotas` of the
  tenant ledger's ``DISK_BYTES``, counting the bytes segments take): each tenant writes
  its own segments, so that evicting one never takes another tenant's blocks.  A tenant
  past its share of the disk evicts its own least recently used segments first, and a
  segment is evicted for a write only if it is the writer's, nobody's, or a tenant's past
  its share; a write that finds no such room is dropped (the disk is a cache).  A tenant
  holds at most its share and one open segment.
- The index lives in memory and is rebuilt at start from the files: a host that lost
  /dev/shm (a reboot) finds its disk blocks again.
- A delete lasts: it appends a tombstone record (a header with ``FLAG_TOMBSTONE`` and no
  payload), which hides every earlier record of its key when the index is rebuilt.  A
  tombstone is needed while the segment of the record it hides is on disk: when its own
  segment is evicted first, it is written again, with the next write (or at close).
- The directory is the daemon's alone: created ``0o700``, refused if another user owns it
  or its group or others may write in it, or if anyone else could swap it (a directory
  above it they own or may write in: :func:`kvpool.dirs.check_owned`), and locked
  (``flock``) for the tier's life, so that a second daemon given it refuses to start
  instead of deleting or overwriting the first one's segments.  Its files are opened
  relative to the directory's descriptor, never through a symbolic link: a directory
  renamed under the daemon keeps its segments, and none go to one put in its place.  A
  new segment never replaces an existing file (``O_EXCL``).

- Formats (:mod:`kvpool.formats`): the identity file names the tier's format; one of a
  format this release does not read, or that fails its checksum, is refused at start.
  Format 1 (0.1.0's: the identity alone, segments without a stamp) is adopted as it is:
  the identity file is rewritten at start, old segments are read as they are until they
  go (a segment is never rewritten), new ones are written in this release's format.  A
  segment whose stamp is damaged, or of a format this release does not read, is not
  adopted: it is deleted and counted (``unreadable_segments``).

Events: the blocks a write places are reported stored, and the blocks an evicted segment
or a delete takes away removed, to the :class:`~kvpool.tiers.tier.TierEvents` the tier was
built with, medium ``STORAGE``.  A segment it evicts is first handed to the tier below
(``below``: the object store), which links the file before it is deleted.

Threads: lookups (``contains``) are cheap and may come from the event loop; reads and
writes do blocking I/O and come from worker threads.  One lock guards the index and the
segment table, and is never held during I/O: a writer reserves its place in the open
segment, writes, then publishes the keys; a reader takes a reference on the segment, so
that evicting it meanwhile defers closing its file.  There is one writer at a time
(``_writer``): the write-back's thread, or a delete's tombstones.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvpool.dirs import DirLock, check_owned, make_dir, open_in
from kvpool.errors import ConfigError, FormatError
from kvpool.formats import (
    DISK_SEGMENT,
    DISK_TIER,
    RELEASE,
    STAMP_BYTES,
    Stamp,
    has_magic,
    pack_stamp,
    unpack_stamp,
)
from kvpool.keys import BlockOrigin
from kvpool.stats import TIER_DISK, TierStats
from kvpool.store.accounts import Accounts, Resource
from kvpool.store.quotas import Quotas, stored_bytes
from kvpool.tenants import TAG_BYTES
from kvpool.tiers.tier import MEDIUM_STORAGE, KeyIndex, SegmentSink, TierEvents

RECORD_MAGIC = b"KVDR"
# magic, key length, flags, size, checksum (payload), written at (ns), header checksum
RECORD = struct.Struct("<4sBBHQQQ")
RECORD_TAIL = struct.Struct("<Q")
FOOTER_MAGIC = b"KVDFOOT1"
TRAILER = struct.Struct("<8sQQ")  # magic, footer offset, footer checksum
FOOTER_CHUNK_BYTES = 1 << 20  # a footer is read and parsed this much at a time
ID_FILE = "kvpool-disk.id"
ID_PREFIX = "kvpool-disk"  # format 2 on: "kvpool-disk format=N kvpool=R id=HEX check=HEX"
ID_V1 = re.compile(r"^[0-9a-f]{32}$")  # format 1: the id alone
ID_LINE = re.compile(
    r"^kvpool-disk format=(\d+) kvpool=(\S*) id=([0-9a-f]{32}) check=([0-9a-f]{16})$"
)
MAX_ID_FILE_BYTES = 4096
SEGMENT_MAGIC = b"KVPOOLS\0"
SEGMENT_RE = re.compile(r"^seg-(\d{8})\.kvs$")
DEFAULT_SEGMENT_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 4 << 20
MAX_KEY_BYTES = 255
# A footer entry: a record's header (with the longest key) and its payload's offset.
FOOTER_ENTRY_MAX_BYTES = RECORD.size + MAX_KEY_BYTES + RECORD_TAIL.size + 8
FLAG_TOMBSTONE = 1  # a record that deletes its key: no payload
DIR_MODE = 0o700
OUTGOING_DIR = "outgoing"  # segments waiting for upload to the object store

# A record to append: (key, payload, checksum, flags).
_Record = tuple[bytes, memoryview | bytes, int, int]


def _header(key: bytes, size: int, checksum: int, flags: int = 0) -> bytes:
    body = RECORD.pack(RECORD_MAGIC, len(key), flags, 0, size, checksum, time.time_ns()) + key
    return body + RECORD_TAIL.pack(xxhash.xxh3_64_intdigest(body))


def header_bytes(key: bytes) -> int:
    return RECORD.size + len(key) + RECORD_TAIL.size


@dataclass(slots=True)
class Location:
    segment_id: int
    offset: int  # of the payload
    size: int
    checksum: int


@dataclass(slots=True)
class Segment:
    segment_id: int
    path: Path
    num_bytes: int = 0
    version: int = DISK_SEGMENT.version  # its format: where its records start
    last_used: float = 0.0
    sealed: bool = False
    keys: set[bytes] = field(default_factory=set)
    first_key: bytes = b""  # whose segment it is (the tenant's tag leads the key)
    tombstones: set[bytes] = field(default_factory=set)  # keys deleted by records here
    buried: set[bytes] = field(default_factory=set)  # keys of records here a tombstone hides
    headers: list[bytes] = field(default_factory=list)  # for the footer, while open
    readers: int = 0
    dropped: bool = False


@dataclass(slots=True)
class DiskCounters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    written_bytes: int = 0
    evicted_blocks: int = 0
    evicted_segments: int = 0
    corrupt: int = 0
    recovered: int = 0
    torn_records: int = 0
    over_share: int = 0  # blocks not written: their tenant had no room within its share
    unreadable_segments: int = 0  # a damaged stamp, or a format not read: deleted at start


class DiskTier(KeyIndex[Location]):
    """Blocks on local disk, found by key (a :class:`~kvpool.tiers.tier.Tier`); see the
    module docstring for the rules.

    Why so many methods (34): the :class:`~kvpool.tiers.tier.Tier` interface and the
    write-back's intake are a dozen of them (``contains``, ``may_hold``, ``size_of``,
    ``stored``, ``read_many``, ``delete``, ``recount_quotas``, ``stats``, ``close``; the
    key index's lookups; ``write``, ``sync``), and a tier
    that owns its files must also recover them at a start (``_recover``, ``_scan``, the
    footer and header parsers) and lay them out (segments: append, grow, roll, finish,
    drop, make room).  Each private method is one of those steps on the same open
    segment files and the same index, under one lock.
    """

    tier_id = TIER_DISK
    medium = MEDIUM_STORAGE
    resource = Resource.DISK_BYTES

    def __init__(
        self,
        path: Path,
        capacity: int,
        *,
        segment_bytes: int = 0,
        below: SegmentSink | None = None,
        events: TierEvents | None = None,
        fresh: bool = False,
        deferred: bool = False,
    ):
        """Open the tier in ``path`` (created ``0o700``; refused if another user owns it,
        it is group- or world-writable, or another daemon holds it) and re-index what it
        holds; with ``fresh``, its files are removed first.  With ``deferred`` (a node's
        start), nothing is written until :meth:`commit`: not the identity file, nor the
        removals (``fresh``, unreadable segments, what is past the capacity)."""
        super().__init__()
        self.path = Path(path)
        self.capacity = capacity
        self.segment_bytes = segment_bytes or max(
            MIN_SEGMENT_BYTES, min(DEFAULT_SEGMENT_BYTES, capacity // 8)
        )
        if capacity < 2 * self.segment_bytes:
            raise ConfigError(
                f"--disk-size must be at least {2 * self.segment_bytes >> 20} MiB (two segments)"
            )
        self.counters = DiskCounters()
        self._below: SegmentSink | None = None
        self._events: TierEvents | None = None
        self._segments: dict[int, Segment] = {}
        self._open: dict[bytes, Segment] = {}  # by owner (see _owner)
        self.quotas: Quotas | None = None  # tenants' shares of the disk, when it has tenants
        self._fds: dict[int, int] = {}
        self._clock = itertools.count(1)
        self._writer = threading.Lock()  # one writer at a time: appends and tombstones
        # Key -> the segment of the record its tombstone hides (while that segment exists).
        self._graves: dict[bytes, int] = {}
        self._carried: list[bytes] = []  # tombstones to write again (their segment went)
        self._in_flight: set[bytes] = set()  # the keys a write is appending now
        self._last_segment_id = 0  # segment ids are never reused
        # The tier's format and the release that opened it last, as found (None: new).
        self.found: Stamp | None = None
        self._tier_id = ""
        self._fresh = fresh
        self._unreadable: list[str] = []  # segments recovery could not read: removed
        self._dir_lock = lock_disk_dir(self.path)
        self._dir_fd = self._dir_lock.fd  # every file of the tier is opened relative to it
        try:
            if fresh:  # its files go at commit(), before anything is written
                self._tier_id = secrets.token_hex(16)
            else:
                self._check_identity()
                self._recover()
            if not deferred:
                self.commit()
        except BaseException:
            self._dir_lock.release()
            raise
        # Set after re-indexing: segments a start drops to fit its capacity are neither
        # handed below nor reported.
        self._below = below
        self._events = events

    def commit(self) -> None:
        """What opening the tier writes, once every check of the start has passed: with
        ``fresh`` the old files go; segments recovery could not read go; the identity file
        is stamped with this release's format; what is past the capacity goes (least
        recently used first)."""
        if self._fresh:
            _remove_files(self._dir_fd)
            self._fresh = False
        for name in self._unreadable:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._dir_fd)
        self._unreadable = []
        self.stamp()
        with self._lock:
            self._make_room(0)

    # -- start ----------------------------------------------------------------------------

    def _open_file(self, name: str, flags: int) -> int:
        return open_in(self._dir_fd, name, flags)

    def _check_identity(self) -> None:
        """Read the identity file (a new tier: write one), refusing a format this release
        does not read; then stamp it with this release's format."""
        marker = self.path / ID_FILE
        try:
            with os.fdopen(self._open_file(ID_FILE, os.O_RDONLY), "rb") as f:
                text = f.read(MAX_ID_FILE_BYTES).decode("ascii", "replace")
        except FileNotFoundError:
            if any(SEGMENT_RE.match(name) for name in os.listdir(self._dir_fd)):
                raise ConfigError(f"{self.path} holds segments but no {ID_FILE}") from None
            tier_id = secrets.token_hex(16)
        else:
            self.found, tier_id = parse_identity(text, marker)
        self._tier_id = tier_id

    def stamp(self) -> None:
        """Stamp the identity file with this release's format (migrating the tier in place;
        :meth:`commit` calls it once every check of the start has passed)."""
        if self.found != Stamp(DISK_TIER.version, RELEASE):
            temporary = ID_FILE + ".new"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=self._dir_fd)
            fd = self._open_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                _pwritev_all(fd, [(identity_line(self._tier_id) + "\n").encode()], 0)
            finally:
                os.close(fd)
            os.replace(temporary, ID_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _recover(self) -> None:
        for name in sorted(os.listdir(self._dir_fd)):
            match = SEGMENT_RE.match(name)
            if match is None:
                continue
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue  # a segment is a file: never followed elsewhere
            segment = Segment(int(match.group(1)), self.path / name)
            segment.num_bytes = st.st_size
            segment.last_used = next(self._clock)
            try:
                with os.fdopen(self._open_file(name, os.O_RDONLY), "rb") as f:
                    segment.version = stamped_version(f.read(STAMP_BYTES), segment.path)
            except FormatError:
                self.counters.unreadable_segments += 1
                self._last_segment_id = max(self._last_segment_id, segment.segment_id)
                self._unreadable.append(name)  # removed by commit()
                continue
            self._segments[segment.segment_id] = segment
            trailer = self._trailer(segment)
            records = self._read_footer(segment, *trailer) if trailer is not None else None
            if records is None:
                # Header by header, up to its footer if it has one (whose entries look like
                # records): counted as far as its records go.  Past them is a torn tail, or
                # bytes a file claims (a sparse one) that were never written.
                end = trailer[0] if trailer is not None else segment.num_bytes
                records, segment.num_bytes = self._scan(segment, end)
            else:
                segment.sealed = True
            for key, location, flags in records:
                if flags & FLAG_TOMBSTONE:
                    self._bury(key, segment)
                else:
                    self._place(key, location, segment)
        self._last_segment_id = max(self._last_segment_id, *self._segments, 0)
        # Appends go to a new segment: the last one may end in a torn record.
        for segment in self._segments.values():
            segment.sealed = True
        self.counters.recovered = len(self._index)

    def _trailer(self, segment: Segment) -> tuple[int, int] | None:
        """Where a sealed segment's footer starts and its checksum, from its trailer; None
        if it has none."""
        if segment.num_bytes < TRAILER.size:
            return None
        with os.fdopen(self._open_file(segment.path.name, os.O_RDONLY), "rb") as f:
            f.seek(segment.num_bytes - TRAILER.size)
            magic, footer_at, footer_checksum = TRAILER.unpack(f.read(TRAILER.size))
        if magic != FOOTER_MAGIC or not records_start(segment.version) <= footer_at:
            return None
        if footer_at > segment.num_bytes - TRAILER.size:
            return None
        return footer_at, footer_checksum

    def _read_footer(
        self, segment: Segment, footer_at: int, footer_checksum: int
    ) -> list[tuple[bytes, Location, int]] | None:
        """A sealed segment's records, from its footer; None if it does not check out.

        The footer is read and parsed a chunk at a time, and given up at its first entry
        that does not parse: what a start allocates for a segment is bounded by the entries
        really written there, never by the size a trailer claims (a sparse file of 1 GiB
        that says its footer spans it all costs one chunk)."""
        with os.fdopen(self._open_file(segment.path.name, os.O_RDONLY), "rb") as f:
            f.seek(footer_at)
            left = segment.num_bytes - TRAILER.size - footer_at
            hasher = xxhash.xxh3_64()
            records: list[tuple[bytes, Location, int]] = []
            pending = b""
            while left > 0:
                chunk = f.read(min(FOOTER_CHUNK_BYTES, left))
                if not chunk:
                    return None  # shorter than it says
                left -= len(chunk)
                hasher.update(chunk)
                data = pending + chunk
                position = 0
                while position < len(data):
                    parsed = self._parse_header(data, position)
                    if parsed is None:
                        if left and len(data) - position < FOOTER_ENTRY_MAX_BYTES:
                            break  # an entry cut by the chunk: finished with the next one
                        return None
                    key, size, checksum, flags, end, payload_at = parsed
                    location = Location(segment.segment_id, payload_at, size, checksum)
                    records.append((key, location, flags))
                    position = end
                pending = data[position:]
        if pending or hasher.intdigest() != footer_checksum:
            return None
        return records

    @staticmethod
    def _parse_header(data: bytes, position: int) -> tuple[bytes, int, int, int, int, int] | None:
        """(key, size, checksum, flags, end of this entry in ``data``, payload offset in the
        file) of a footer entry, which is a record header followed by its payload's offset."""
        if position + RECORD.size > len(data):
            return None
        magic, key_len, flags, _, size, checksum, _ = RECORD.unpack_from(data, position)
        end = position + RECORD.size + key_len
        if magic != RECORD_MAGIC or end + RECORD_TAIL.size + 8 > len(data):
            return None
        (expected,) = RECORD_TAIL.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(data[position:end]) != expected:
            return None
        (payload_at,) = struct.unpack_from("<Q", data, end + RECORD_TAIL.size)
        key = data[position + RECORD.size : end]
        return key, size, checksum, flags, end + RECORD_TAIL.size + 8, payload_at

    def _scan(self, segment: Segment, end: int) -> tuple[list[tuple[bytes, Location, int]], int]:
        """The records of an unsealed segment, header by header, up to the first that is
        torn or garbled (what a crash or power loss left at the tail) or ``end``, and where
        they end."""
        records = []
        position = records_start(segment.version)
        with os.fdopen(self._open_file(segment.path.name, os.O_RDONLY), "rb") as f:
            while position + RECORD.size <= end:
                f.seek(position)
                head = f.read(RECORD.size + MAX_KEY_BYTES + RECORD_TAIL.size)
                magic, key_len, flags, _, size, checksum, _ = RECORD.unpack_from(head)
                header_end = RECORD.size + key_len
                if magic != RECORD_MAGIC or header_end + RECORD_TAIL.size > len(head):
                    break
                (expected,) = RECORD_TAIL.unpack_from(head, header_end)
                if xxhash.xxh3_64_intdigest(head[:header_end]) != expected:
                    break
                payload_at = position + header_end + RECORD_TAIL.size
                if payload_at + size > end:
                    break  # the payload was cut short
                records.append(
                    (
                        head[RECORD.size : header_end],
                        Location(segment.segment_id, payload_at, size, checksum),
                        flags,
                    )
                )
                position = payload_at + size
        if position < segment.num_bytes:
            self.counters.torn_records += 1
        return records, position

    def _place(self, key: bytes, location: Location, segment: Segment) -> None:
        old = self._index.get(key)
        if old is not None:
            previous = self._segments.get(old.segment_id)
            if previous is not None:
                previous.keys.discard(key)
        self._index[key] = location
        segment.keys.add(key)
        segment.first_key = segment.first_key or key
        self._graves.pop(key, None)  # written again after its delete: nothing to hide

    def _bury(self, key: bytes, tombstone_at: Segment | None) -> bool:
        """A tombstone in ``tombstone_at`` (None: one about to be written) deletes ``key``:
        it leaves the index, and the tombstone is kept while the segment of the record it
        hides is on disk.  Whether the key was here."""
        if tombstone_at is not None:
            tombstone_at.tombstones.add(key)
        location = self._index.pop(key, None)
        if location is None:
            return False
        hidden = self._segments.get(location.segment_id)
        if hidden is not None:
            hidden.keys.discard(key)
            hidden.buried.add(key)
            self._graves[key] = hidden.segment_id
        return True

    # -- lookups --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.num_bytes for s in self._segments.values())

    def stats(self) -> TierStats:
        counters = self.counters
        return self._stats(
            "disk",
            self.capacity,
            self.used_bytes,
            reads=counters.hits,
            writes=counters.writes,
            evictions=counters.evicted_blocks,
            corrupt=counters.corrupt,
            recovered=counters.recovered,
        )

    def segment_versions(self) -> dict[int, int]:
        """How many segments there are of each format (old ones stay until they go)."""
        with self._lock:
            return dict(Counter(s.version for s in self._segments.values()))

    # -- writes ---------------------------------------------------------------------------

    def recount_quotas(self, accounts: Accounts) -> None:
        """Tenants' shares of the disk: ``accounts``' ``DISK_BYTES`` limits (none: no
        tenants); what each holds is counted again from the segments, into that ledger."""
        with self._lock:
            if not accounts.metered(self.resource).limits:
                self.quotas = None
                return
            quotas = Quotas(accounts, self.resource, stored_bytes)
            quotas.recount((s.first_key, s.num_bytes) for s in self._segments.values())
            self.quotas = quotas

    def _owner(self, key: bytes) -> bytes:
        """The open segment a key's records go to: its tenant's (its tag), else nobody's."""
        quotas = self.quotas
        tag = key[:TAG_BYTES]
        return tag if quotas is not None and tag in quotas.limits else b""

    def write(
        self,
        blocks: Sequence[tuple[bytes, memoryview, int]],
        origins: Mapping[bytes, BlockOrigin] | None = None,
        keep: Callable[[bytes], bool] | None = None,
    ) -> int:
        """Append ``(key, bytes, checksum)`` blocks as records; returns how many were
        written (all but those larger than a segment, or past their tenant's share).  One
        ``pwritev`` per segment touched: large sequential writes.  The keys become visible
        once their bytes are written, and are reported stored with what ``origins`` says
        they were computed from.  ``keep``, asked once the write holds the tier's one
        writer, says which blocks are still wanted: one deleted since it was handed over
        is not written after its tombstone (a delete lasts)."""
        with self._writer:
            with self._lock:  # with the keys in flight, one step for a delete to see
                records: list[_Record] = [
                    (key, data, checksum, 0)
                    for key, data, checksum in blocks
                    if keep is None or keep(key)
                ]
                self._in_flight = {record[0] for record in records}
            try:
                return self._write_records(records, origins or {})
            finally:
                with self._lock:
                    self._in_flight = set()

    def _write_records(self, records: list[_Record], origins: Mapping[bytes, BlockOrigin]) -> int:
        """Append ``records``, each to its owner's open segment (the caller holds
        ``_writer``); how many blocks were written."""
        by_owner: dict[bytes, list[_Record]] = {}
        for record in records:
            by_owner.setdefault(self._owner(record[0]), []).append(record)
        if not by_owner and self._carried:
            by_owner[b""] = []
        return sum(self._write_owned(owner, owned, origins) for owner, owned in by_owner.items())

    def _write_owned(
        self, owner: bytes, records: list[_Record], origins: Mapping[bytes, BlockOrigin]
    ) -> int:
        """Append one owner's records, after the tombstones to write again."""
        written = 0
        batch: list[_Record] = []
        segment = self._open.get(owner)
        room = segment.num_bytes if segment is not None else self.segment_bytes
        pending = list(records)
        pending.reverse()
        while pending or self._carried:
            if self._carried:  # tombstones whose segment went: before anything else
                with self._lock:
                    carried, self._carried = self._carried, []
                pending += [(key, b"", 0, FLAG_TOMBSTONE) for key in reversed(carried)]
            record = pending.pop()
            key, data, _, _ = record
            need = header_bytes(key) + len(data)
            if len(key) > MAX_KEY_BYTES or need > self.segment_bytes:
                continue
            if room + need > self.segment_bytes:
                written += self._append(owner, batch, origins)
                batch = []
                # May evict segments, and so carry their tombstones.
                if not self._roll(owner, key):
                    with self._lock:
                        self.counters.over_share += 1 + len(pending)
                    return written
                room = records_start(DISK_SEGMENT.version)
            batch.append(record)
            room += need
        return written + self._append(owner, batch, origins)

    def _append(
        self, owner: bytes, records: list[_Record], origins: Mapping[bytes, BlockOrigin]
    ) -> int:
        segment = self._open.get(owner)
        if not records or segment is None:
            return 0
        parts: list[bytes | memoryview] = []
        start = position = segment.num_bytes
        placed = []
        buried = []
        headers = []
        for key, data, checksum, flags in records:
            header = _header(key, len(data), checksum, flags)
            parts += [header, data]
            payload_at = position + len(header)
            if flags & FLAG_TOMBSTONE:
                buried.append(key)
            else:
                placed.append((key, Location(segment.segment_id, payload_at, len(data), checksum)))
            headers.append(header + struct.pack("<Q", payload_at))
            position = payload_at + len(data)
        with self._lock:
            fd = self._fd(segment.segment_id)
        _pwritev_all(fd, parts, start)
        with self._lock:
            self._grow(segment, position - start)
            segment.headers += headers
            segment.last_used = next(self._clock)
            stored = [] if segment.dropped else placed
            for key, location in stored:
                self._place(key, location, segment)
            if not segment.dropped:
                segment.tombstones.update(buried)
            self.counters.writes += len(placed)
            self.counters.written_bytes += position - start
        if self._events is not None:
            for key, _ in stored:
                self._events.stored_key(key, origins.get(key), self.medium)
        return len(placed)

    def _grow(self, segment: Segment, num_bytes: int) -> None:
        """``num_bytes`` more of ``segment`` on disk, counted for its owner."""
        segment.num_bytes += num_bytes
        if self.quotas is not None and segment.first_key and not segment.dropped:
            self.quotas.added(segment.first_key, num_bytes)

    def _roll(self, owner: bytes, key: bytes) -> bool:
        """Seal the owner's open segment and open a new one, making room for it first
        (``key``: the record that needs it); False if there is no room it may take."""
        sealed = self._open.get(owner)
        if sealed is not None:
            self._finish_segment(sealed)
        with self._lock:
            if not self._make_room(self.segment_bytes, key):
                return False
            # Never an id used before, even if its segment just went: the tier below
            # names its packs by it.
            segment_id = self._last_segment_id = self._last_segment_id + 1
            path = self.path / f"seg-{segment_id:08d}.kvs"
            # Never over an existing file: the directory is locked, so one is not ours.
            fd = self._fds[segment_id] = self._open_file(
                path.name, os.O_RDWR | os.O_CREAT | os.O_EXCL
            )
            segment = Segment(segment_id, path, last_used=next(self._clock), first_key=key)
            self._segments[segment_id] = segment
            self._open[owner] = segment
        _pwritev_all(fd, [pack_stamp(SEGMENT_MAGIC, DISK_SEGMENT.version)], 0)
        with self._lock:
            self._grow(segment, STAMP_BYTES)
        return True

    def _finish_segment(self, segment: Segment) -> None:
        with self._lock:
            footer = b"".join(segment.headers)
            fd = self._fd(segment.segment_id)
            at = segment.num_bytes
        trailer = TRAILER.pack(FOOTER_MAGIC, at, xxhash.xxh3_64_intdigest(footer))
        _pwritev_all(fd, [footer, trailer], at)
        with self._lock:
            self._grow(segment, len(footer) + len(trailer))
            segment.sealed = True
            segment.headers = []
            for owner, open_segment in list(self._open.items()):
                if open_segment is segment:
                    del self._open[owner]

    def _make_room(self, num_bytes: int, for_key: bytes | None = None) -> bool:
        """Delete least recently used sealed segments until ``num_bytes`` more fit: first
        the writer's own while its tenant is past its share, then only those a write of
        ``for_key`` may evict (None: any).  Whether the room was found."""
        quotas = self.quotas
        sealed = [s for s in self._segments.values() if s.sealed]
        if quotas is not None and for_key is not None:
            group = quotas.group_of(for_key)
            own = sorted(
                (s for s in sealed if group is not None and quotas.group_of(s.first_key) == group),
                key=lambda s: s.last_used,
            )
            while own and quotas.room(for_key, num_bytes):
                self._drop_segment(own.pop(0))
            tag = for_key[:TAG_BYTES]
            if tag in quotas.limits and quotas.used[tag] >= quotas.limits[tag]:
                return False  # past its share with nothing of its own left to evict
        victims = sorted(
            (
                s
                for s in self._segments.values()
                if s.sealed
                and (quotas is None or for_key is None or quotas.may_evict(s.first_key, for_key))
            ),
            key=lambda s: s.last_used,
        )
        while sum(s.num_bytes for s in self._segments.values()) + num_bytes > self.capacity:
            if not victims:
                return quotas is None  # without tenants, a write goes on (as it always did)
            self._drop_segment(victims.pop(0))
        return True

    def _drop_segment(self, segment: Segment) -> None:
        evicted = []
        live = []
        for key in segment.keys:
            location = self._index.get(key)
            if location is not None and location.segment_id == segment.segment_id:
                del self._index[key]
                self.counters.evicted_blocks += 1
                evicted.append(key)
                live.append((key, location.offset, location.size, location.checksum))
        for key in segment.buried:  # the records those tombstones hid are gone too
            if self._graves.get(key) == segment.segment_id:
                del self._graves[key]
        for key in segment.tombstones:  # still hiding a record elsewhere: written again
            if self._graves.get(key, segment.segment_id) != segment.segment_id:
                self._carried.append(key)
        if self.quotas is not None and segment.first_key:
            self.quotas.removed(segment.first_key, segment.num_bytes)
        if live and self._below is not None:
            self._below.offer_segment(segment.path, live)
        if evicted and self._events is not None:
            self._events.removed_keys(evicted, self.medium)
        self.counters.evicted_segments += 1
        segment.dropped = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path.name, dir_fd=self._dir_fd)
        del self._segments[segment.segment_id]
        if not segment.readers:
            self._close_fd(segment.segment_id)

    def _close_fd(self, segment_id: int) -> None:
        fd = self._fds.pop(segment_id, None)
        if fd is not None:
            os.close(fd)

    def _fd(self, segment_id: int) -> int:
        fd = self._fds.get(segment_id)
        if fd is None:
            fd = self._fds[segment_id] = self._open_file(
                self._segments[segment_id].path.name, os.O_RDWR
            )
        return fd

    # -- reads ----------------------------------------------------------------------------

    def read_many(self, jobs: Sequence[tuple[bytes, memoryview]]) -> list[int | None]:
        """Each ``(key, destination)`` read with :meth:`read_into`, in order."""
        return [self.read_into(key, dst) for key, dst in jobs]

    def read_into(self, key: bytes, dst: memoryview) -> int | None:
        """Read the block into ``dst`` (at least its size) and verify it: its checksum, or
        ``None`` if it is not on disk, could not be read whole, or failed verification
        (then it is dropped and counted as corrupt)."""
        with self._lock:
            location = self._index.get(key)
            if location is None or len(dst) < location.size:
                self.counters.misses += 1
                return None
            segment = self._segments[location.segment_id]
            segment.last_used = next(self._clock)
            segment.readers += 1
            fd = self._fd(location.segment_id)
        target = dst[: location.size]
        try:
            num_read = os.preadv(fd, [target], location.offset)
        except OSError:
            num_read = -1
        finally:
            with self._lock:
                segment.readers -= 1
                if segment.dropped and not segment.readers:
                    self._close_fd(segment.segment_id)
        if num_read == location.size and xxhash.xxh3_64_intdigest(target) == location.checksum:
            with self._lock:
                self.counters.hits += 1
            return location.checksum
        with self._lock:
            self.counters.corrupt += 1
            if self._index.get(key) == location:
                del self._index[key]
                segment.keys.discard(key)
        return None

    def may_hold(self, keys: Sequence[bytes]) -> bool:
        with self._lock:
            return any(key in self._index or key in self._in_flight for key in keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete these blocks for good: they leave the index at once, and a tombstone
        record per block is appended (blocking I/O: from a worker thread), so that a
        restart does not bring them back.  Their space returns when their segment goes.
        Keys that are neither here nor being written cost no wait for the tier's writer
        (a block still on its way is the write-back's to skip: ``write``'s ``keep``)."""
        with self._lock:
            if not any(key in self._index or key in self._in_flight for key in keys):
                return 0  # nothing here, nor on its way: no wait for the writer
        with self._writer:
            with self._lock:
                gone = [key for key in keys if self._bury(key, None)]
            if gone:
                self._write_records([(key, b"", 0, FLAG_TOMBSTONE) for key in gone], {})
        if gone and self._events is not None:
            self._events.removed_keys(gone, self.medium)
        return len(gone)

    def sync(self) -> None:
        """Flush every segment to the device (for measurements; the tier never needs to)."""
        with self._lock:
            fds = list(self._fds.values())
        for fd in fds:
            os.fsync(fd)

    def close(self) -> None:
        """Write the tombstones still to carry, seal the open segment (a clean start reads
        its footer), close the files and release the directory."""
        with self._writer:
            if self._carried:
                self._write_records([], {})
            for segment in list(self._open.values()):
                self._finish_segment(segment)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._dir_lock.release()


def identity_line(tier_id: str) -> str:
    """The identity file's line in this release's format (rule: :mod:`kvpool.formats`)."""
    body = f"{ID_PREFIX} format={DISK_TIER.version} kvpool={RELEASE} id={tier_id}"
    return f"{body} check={xxhash.xxh3_64_intdigest(body.encode()):016x}"


def parse_identity(text: str, where: object) -> tuple[Stamp, str]:
    """The format stamp and the id of an identity file's ``text``: format 1's bare id, or a
    stamped line; a damaged one, or one of a format this release does not read, is
    refused."""
    line = text.strip()
    if ID_V1.match(line):
        return Stamp(1, ""), line
    match = ID_LINE.match(line)
    if match is None:
        raise DISK_TIER.damaged(where, "identity file")
    body = line[: line.rindex(" check=")]
    if f"{xxhash.xxh3_64_intdigest(body.encode()):016x}" != match.group(4):
        raise DISK_TIER.damaged(where, "identity file")
    stamp = Stamp(int(match.group(1)), match.group(2))
    DISK_TIER.check(stamp.version, stamp.writer, where)
    return stamp, match.group(3)


def segment_version(path: Path) -> int:
    """The format of the segment (or pack) file at ``path``: see :func:`stamped_version`."""
    with open(path, "rb") as f:
        return stamped_version(f.read(STAMP_BYTES), path)


def stamped_version(head: bytes, where: object) -> int:
    """The format of a segment (or pack) that begins with ``head``: its stamp's, or 1 where
    it has none (0.1.0's segments begin with a record); a damaged stamp or a format this
    release does not read raises :class:`~kvpool.errors.FormatError`."""
    if not has_magic(head, SEGMENT_MAGIC):
        return 1
    return unpack_stamp(head, SEGMENT_MAGIC, DISK_SEGMENT, where).version


def records_start(version: int) -> int:
    """Where a segment of ``version`` has its first record."""
    return 0 if version == 1 else STAMP_BYTES


def lock_disk_dir(path: Path) -> DirLock:
    """Create the disk tier's directory (``0o700``), check that it is this user's alone, and
    lock it: a second daemon given the same directory is refused."""
    make_dir(path, DIR_MODE, "the disk tier's directory")
    check_owned(path, private=True)
    return DirLock(
        path,
        f"another kvpool daemon uses the disk directory {path}; stop it, or give this one "
        "another --disk",
    )


def empty_disk_dir(path: Path) -> bool:
    """Remove the disk tier's files (only kvpool's: segments, the identity file, and the
    segments waiting for upload), if no daemon holds the directory; whether they went."""
    if not path.is_dir():
        return True
    try:
        lock = lock_disk_dir(path)
    except ConfigError:
        return False
    try:
        _remove_files(lock.fd)
    finally:
        lock.release()
    return True


def _remove_files(dir_fd: int) -> None:
    """Remove kvpool's files from the directory open at ``dir_fd``."""
    shutil.rmtree(OUTGOING_DIR, ignore_errors=True, dir_fd=dir_fd)
    for name in os.listdir(dir_fd):
        if name == ID_FILE or SEGMENT_RE.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)


def _pwritev_all(fd: int, parts: list[bytes | memoryview], offset: int) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.pwritev(fd, views[:512], offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
