"""The block journal: what lets the DRAM tier outlive its own process.

The arena is a file under /dev/shm, so its bytes survive the daemon (a crash, ``kill -9``,
the OOM killer, a SIGTERM for an upgrade).  This journal, a file beside it, says which of
those bytes are committed blocks.  Records:

- COMMIT(key, offset, size, checksum): a block became visible;
- FILLED(key, offset, size): a same-host writer filled and committed a block that the node
  has not hashed yet (it is being sealed: :mod:`kvpool.node.sealing`); a COMMIT follows.
  Replay yields it with no checksum, and the restarted daemon hashes it before adopting it;
- REMOVE(key): it left (deleted, evicted, dropped as corrupt);
- LABEL(namespace id, label): a namespace's human-readable label (routers find namespaces
  by it);
- STAMP(release): the kvpool release that wrote the records after it (one per daemon that
  took the journal over, and one at the front of each compaction's snapshot).

Rules (each has a test in tests/store/test_journal.py):
1. A COMMIT or a FILLED is written before the commit is acknowledged: every block a writer
   was told is stored is in the journal.
2. A REMOVE is written before the block's memory can be handed out again, so a block that
   replay adopts was never overwritten by another one while the daemon ran.
3. Reservations are never written: a block being filled when the daemon died is not
   adopted.
4. Every record carries its own checksum; replay stops at the first torn or garbled record
   (the tail a crash cut short) and the journal continues from there.
5. Replay yields the live blocks in commit order, oldest first (the LRU order to restore).
   A restart replays millions of records: runs of records with keys of one length are
   decoded with numpy, which finds each key's last record too, and replay yields columns
   (:class:`Replay`), not an object per block.
6. When the journal holds much more than it describes, in records or in bytes, it is
   compacted: a snapshot of the live records (committed blocks, FILLED blocks not committed
   yet, and one LABEL per labelled namespace: a label is state, not history) is written
   beside it and renamed over it, so a crash mid-way leaves the old journal whole.  The
   snapshot is written a step at a time (``COMPACT_STEP`` records per call of the store
   that appended: a commit, a removal, a label), never in one pass over the whole index:
   while it is under way every record goes to both files, and a block is written into the
   snapshot only if it is still live when its step comes, so the new file describes what
   the old one does when it replaces it.  Counting bytes, not only records, bounds the
   journal whatever its records hold (a label's record is ten times a block's).
7. The header names the arena (device, inode, size): a journal of another arena is
   discarded at start.
8. The header's eighth byte is the format version (:data:`kvpool.formats.JOURNAL`): the
   ``1`` of 0.1.0's ``KVPOOLJ1``, the ``2`` of this release's ``KVPOOLJ2``, which adds the
   STAMP record.  A journal of format 1 is adopted as it is and migrated in place (a STAMP
   appended, then the header rewritten: O(1); :meth:`Journal.stamp`).  A format this
   release does not read, or a header that fails its checksum, is refused at start
   (:class:`~kvpool.errors.FormatError`): never replayed in part, never replaced by an
   empty journal.

Writes go to tmpfs (page cache): they outlive the process at once, with no fsync; a host
reboot loses the arena and the journal together.  Adopted blocks are verified before they
are served like every block, by their readers, against the checksums recorded here.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvpool.dirs import open_in
from kvpool.formats import JOURNAL, RELEASE, Stamp
from kvpool.store.index import rows_as_bytes

FILE_MAGIC_PREFIX = b"KVPOOLJ"  # and the format version, as an ASCII digit from "1" on
FILE_HEADER_BODY = struct.Struct("<8sQQQ")  # magic, dev, ino, arena bytes
FILE_HEADER_BYTES = FILE_HEADER_BODY.size + 8  # and the body's checksum
RECORD_MAGIC = b"KVJR"
RECORD = struct.Struct("<4sBBHQQQ")  # magic, kind, key length, label length, offset, size, checksum
RECORD_CHECKSUM = struct.Struct("<Q")
MAX_KEY_BYTES = 255
MAX_LABEL_BYTES = 1024
COMMIT, REMOVE, LABEL, FILLED, STAMP = 1, 2, 3, 4, 5
# Compact when the journal holds this many times the live records (and is not tiny): what
# a restart replays.  Cheap, now that a compaction is written a step per commit.
COMPACT_RATIO = 2
COMPACT_MIN_RECORDS = 4096
COMPACT_MIN_BYTES = 1 << 20  # and this many bytes (labels are large records)
# Snapshot records a compaction writes per step (per commit): a few milliseconds of work.
COMPACT_STEP = 1024
# Records replay decodes together at most (a bounded batch, however long the journal).
RUN_RECORDS = 1 << 16


class Entry(NamedTuple):
    """A block as the journal records it (what the store appends; a tuple)."""

    key: bytes
    offset: int
    size: int
    checksum: int | None  # None: FILLED, not hashed yet


@dataclass(slots=True)
class Replay:
    """What a journal described: its live blocks as columns, in commit order (oldest
    first), the namespaces' labels, and how much of the file was torn off.

    A restart replays millions of blocks: a column per field, not an object per block.
    """

    keys: list[bytes]
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64
    checksums: np.ndarray  # uint64; 0 where not hashed
    hashed: np.ndarray  # bool: False where the block was FILLED and not hashed yet
    labels: dict[bytes, str]
    # The release that wrote the last records (its STAMP), "" where none says (format 1).
    writer: str = ""
    num_records: int = 0
    num_torn_bytes: int = 0
    # The keys again, a row of bytes each, where they are all of one length (a node's are):
    # the store's index takes them as they are.
    key_rows: np.ndarray | None = None

    @classmethod
    def empty(cls) -> Replay:
        offsets = np.zeros(0, dtype=np.int64)
        return cls([], offsets, offsets.copy(), np.zeros(0, np.uint64), np.zeros(0, bool), {})

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def entries(self) -> list[Entry]:
        """The live blocks as :class:`Entry` tuples, oldest first (for tools and tests)."""
        checksums = [
            checksum if hashed else None
            for checksum, hashed in zip(self.checksums.tolist(), self.hashed.tolist(), strict=True)
        ]
        return list(
            map(
                Entry._make,
                zip(self.keys, self.offsets.tolist(), self.sizes.tolist(), checksums, strict=True),
            )
        )


# A journal's bytes: read (tools) or mapped (the daemon's own).
Data = bytes | mmap.mmap


def _record(
    kind: int, key: bytes, offset: int = 0, size: int = 0, checksum: int = 0, label: bytes = b""
) -> bytes:
    body = (
        RECORD.pack(RECORD_MAGIC, kind, len(key), len(label), offset, size, checksum) + key + label
    )
    return body + RECORD_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def _block_records(
    kind: int, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, checksums: np.ndarray
) -> bytes:
    """The records of blocks whose keys are the rows of ``rows`` (one length), as
    :func:`_record` writes each: built as one array, as replay reads them (rule 5)."""
    count, key_len = rows.shape
    dtype = _run_dtype(key_len)
    records = np.zeros(count, dtype)
    records["magic"] = RECORD_MAGIC
    records["kind"] = kind
    records["key_len"] = key_len
    records["offset"] = offsets
    records["size"] = sizes
    records["checksum"] = checksums
    raw = records.view(np.uint8).reshape(count, dtype.itemsize)
    raw[:, RECORD.size : RECORD.size + key_len] = rows
    bodies = raw[:, : dtype.itemsize - RECORD_CHECKSUM.size]
    hash_ = xxhash.xxh3_64_intdigest
    records["crc"] = np.fromiter(map(hash_, bodies), np.uint64, count)
    return records.tobytes()


def record_bytes(key: bytes, label: bytes = b"") -> int:
    """The bytes of the record of ``key`` (with ``label``: a LABEL record)."""
    return RECORD.size + len(key) + len(label) + RECORD_CHECKSUM.size


def _label(label: str) -> bytes:
    return label.encode()[:MAX_LABEL_BYTES]


def _header(dev: int, ino: int, arena_bytes: int, version: int = JOURNAL.version) -> bytes:
    magic = FILE_MAGIC_PREFIX + bytes([ord("0") + version])
    body = FILE_HEADER_BODY.pack(magic, dev, ino, arena_bytes)
    return body + RECORD_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def _stamp_record() -> bytes:
    return _record(STAMP, b"", label=RELEASE.encode())


@dataclass(frozen=True, slots=True)
class Header:
    """A journal's header: its format version and the arena it describes."""

    version: int
    dev: int
    ino: int
    arena_bytes: int


def read_header(data: Data, where: object) -> Header | None:
    """The header at the start of ``data`` (None: too short to hold one, a journal cut off
    as it was created); a damaged one, or one of a format this release does not read, is
    refused (rule 8)."""
    if len(data) < FILE_HEADER_BYTES:
        return None
    body = bytes(data[: FILE_HEADER_BODY.size])
    (expected,) = RECORD_CHECKSUM.unpack_from(data, FILE_HEADER_BODY.size)
    magic, dev, ino, arena_bytes = FILE_HEADER_BODY.unpack(body)
    if magic[:7] != FILE_MAGIC_PREFIX or xxhash.xxh3_64_intdigest(body) != expected:
        raise JOURNAL.damaged(where, "header")
    version = magic[7] - ord("0")
    JOURNAL.check(version, "", where)
    return Header(version, dev, ino, arena_bytes)


def _run_dtype(key_len: int) -> np.dtype:
    """A record of a block (no label) with a key of ``key_len`` bytes, as numpy reads it."""
    return np.dtype(
        [
            ("magic", "S4"),
            ("kind", "u1"),
            ("key_len", "u1"),
            ("label_len", "<u2"),
            ("offset", "<u8"),
            ("size", "<u8"),
            ("checksum", "<u8"),
            ("key", f"V{key_len}"),
            ("crc", "<u8"),
        ]
    )


def _parse_run(data: Data, position: int, key_len: int) -> np.ndarray:
    """The intact block records from ``position`` on whose keys are all ``key_len`` bytes
    long (nearly every record of a journal), decoded together: a restart replays millions,
    and numpy checks their headers at once; each record's checksum is still verified."""
    dtype = _run_dtype(key_len)
    count = min(RUN_RECORDS, (len(data) - position) // dtype.itemsize)
    records = np.frombuffer(data, dtype, max(count, 0), position)
    kind = records["kind"]
    fits = (
        (records["magic"] == RECORD_MAGIC)
        & (records["key_len"] == key_len)
        & (records["label_len"] == 0)
        & ((kind == COMMIT) | (kind == REMOVE) | (kind == FILLED))
    )
    if not fits.all():
        count = int(np.argmin(fits))
    if count < 2:
        return records[:0]
    # One call per record, mapped over the rows of the records' bytes (each a buffer,
    # though numpy's stubs do not say so): 30% less than slicing the journal per record,
    # and ~100 numpy operations of a vectorised xxh3 would cost more.
    bodies = records[:count].view(np.uint8).reshape(count, dtype.itemsize)
    bodies = bodies[:, : dtype.itemsize - RECORD_CHECKSUM.size]
    hash_ = xxhash.xxh3_64_intdigest
    digests = np.fromiter(map(hash_, bodies), np.uint64, count)  # type: ignore[arg-type]
    intact = digests == records["crc"][:count]
    if not intact.all():
        count = int(np.argmin(intact))
    return records[:count]


FIELDS = ("kind", "offset", "size", "checksum")


class _Records:
    """The block records of a journal decoded so far, in file order: their keys, a matrix
    of bytes per run of one key length, and their kind, offset, size and checksum."""

    def __init__(self) -> None:
        self.key_runs: list[np.ndarray] = []  # (records, key length) of uint8, per run
        self._field_runs: list[tuple[np.ndarray, ...]] = []  # kind, offset, size, checksum
        self._singles: list[tuple[bytes, int, int, int, int]] = []  # decoded one by one

    def add_run(self, records: np.ndarray) -> None:
        self._flush()
        # The keys' bytes where they lie in the journal's: copied once, by _key_matrix.
        raw = records.view(np.uint8).reshape(len(records), records.itemsize)
        self.key_runs.append(raw[:, RECORD.size : RECORD.size + records.dtype["key"].itemsize])
        self._field_runs.append(tuple(records[f] for f in FIELDS))  # views, copied by fields()

    def add(self, kind: int, key: bytes, offset: int, size: int, checksum: int) -> None:
        if self._singles and len(self._singles[-1][0]) != len(key):
            self._flush()  # a run of keys of one length each
        self._singles.append((key, kind, offset, size, checksum))

    def _flush(self) -> None:
        if self._singles:
            keys = b"".join(single[0] for single in self._singles)
            matrix = np.frombuffer(keys, np.uint8).reshape(len(self._singles), -1)
            self.key_runs.append(matrix)
            fields = np.array([single[1:] for single in self._singles], dtype=np.uint64)
            self._field_runs.append(tuple(fields.reshape(-1, len(FIELDS)).T))
            self._singles = []

    def fields(self) -> list[np.ndarray]:
        """Kind, offset, size and checksum of every record, a uint64 array each."""
        self._flush()
        return [
            np.concatenate([run[i] for run in self._field_runs], dtype=np.uint64)
            if self._field_runs
            else np.zeros(0, dtype=np.uint64)
            for i in range(len(FIELDS))
        ]


def _parse(data: Data) -> tuple[_Records, dict[bytes, str], str, int, int]:
    """The block records of a journal's intact records, its labels, how many records there
    are and where they end."""
    records = _Records()
    labels: dict[bytes, str] = {}
    writer = ""
    num_records = 0
    position = FILE_HEADER_BYTES
    while position + RECORD.size + RECORD_CHECKSUM.size <= len(data):
        magic, kind, key_len, label_len, offset, size, checksum = RECORD.unpack_from(data, position)
        if magic == RECORD_MAGIC and kind != LABEL and not label_len:
            run = _parse_run(data, position, key_len)
            if len(run):
                records.add_run(run)
                num_records += len(run)
                position += len(run) * run.itemsize
                continue
        end = position + RECORD.size + key_len + label_len
        if (
            magic != RECORD_MAGIC
            or kind not in (COMMIT, REMOVE, LABEL, FILLED, STAMP)
            or end + 8 > len(data)
        ):
            break
        (expected,) = RECORD_CHECKSUM.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(data[position:end]) != expected:
            break
        key = data[position + RECORD.size : position + RECORD.size + key_len]
        text = data[position + RECORD.size + key_len : end]
        if kind == LABEL:
            labels[key] = text.decode("utf-8", "replace")
        elif kind == STAMP:
            writer = text.decode("ascii", "replace")
        else:
            records.add(kind, key, offset, size, checksum)
        num_records += 1
        position = end + RECORD_CHECKSUM.size
    return records, labels, writer, num_records, position


def _replay(data: Data) -> tuple[Replay, int]:
    """What the records of a journal's bytes describe, and where its intact records end."""
    # Millions of keys and no cycles: a collection pass every few thousand objects would
    # walk all those still alive.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay_records(data)
    finally:
        if enabled:
            gc.enable()


def _replay_records(data: Data) -> tuple[Replay, int]:
    records, labels, writer, num_records, valid_bytes = _parse(data)
    kinds, offsets, sizes, checksums = records.fields()
    # Offsets and sizes past 2**63 fit no arena: negative here, never sealed nor adopted.
    offsets, sizes = offsets.view(np.int64), sizes.view(np.int64)
    key_lengths = {run.shape[1] for run in records.key_runs}
    if len(key_lengths) == 1 and min(key_lengths) > 0:  # keys of one length: a node's are
        key_len = min(key_lengths)
        matrix = _key_matrix(records.key_runs, key_len)
        live = _live_by_fingerprint(matrix, kinds)
        key_rows = matrix[:, :key_len] if live is None else matrix[live, :key_len]
        keys = rows_as_bytes(key_rows)
    else:
        key_rows = None
        keys = list(itertools.chain.from_iterable(map(rows_as_bytes, records.key_runs)))
        live = _live_by_dict(keys, kinds)
        if live is not None:
            keys = [keys[i] for i in live.tolist()]
    if live is not None:
        kinds, offsets, sizes, checksums = kinds[live], offsets[live], sizes[live], checksums[live]
    hashed = kinds == COMMIT
    checksums[~hashed] = 0
    torn = len(data) - valid_bytes
    replay = Replay(
        keys, offsets, sizes, checksums, hashed, labels, writer, num_records, torn, key_rows
    )
    return replay, valid_bytes


# Which records say what is live: the last of each key, unless a REMOVE, in file order (its
# commit order: a COMMIT or FILLED moves its key to the newest place).  None: every record.


def _live_by_fingerprint(matrix: np.ndarray, kinds: np.ndarray) -> np.ndarray | None:
    """Records whose keys are the rows of ``matrix``, found in numpy (a dict of a million
    keys costs twice as much): sorted by a fingerprint of their key with their index in
    its low bits, a key's records lie together, in file order; those that share a
    fingerprint are compared whole."""
    num_records = len(kinds)
    bits = max(1, (num_records - 1).bit_length())
    index_mask = np.uint64((1 << bits) - 1)
    # One plain sort of one array: two thirds of what an argsort costs.
    packed = (_fingerprints(matrix) & ~index_mask) | np.arange(num_records, dtype=np.uint64)
    packed.sort()
    order = (packed & index_mask).astype(np.intp)
    fingerprints = packed >> np.uint64(bits)
    same = fingerprints[1:] == fingerprints[:-1]
    earlier, later = order[:-1][same], order[1:][same]
    equal = np.ones(len(earlier), dtype=bool)
    for word in matrix.view("<u8").T:  # a word at a time: numpy reduces short rows slowly
        equal &= word[earlier] == word[later]
    removed = kinds == REMOVE
    if not len(earlier) and not removed.any():
        return None  # each key once, nothing removed: a journal just compacted
    is_live = ~removed
    is_live[earlier[equal]] = False  # a later record of its key follows
    if not equal.all():
        # Keys that merely share a fingerprint (rare, or chosen to: keys are the clients'):
        # their groups are decided by a dict of their records.
        group = np.cumsum(np.concatenate(([True], ~same)))
        colliding = np.flatnonzero(np.isin(group, group[1:][same][~equal]))
        records = np.sort(order[colliding])
        last = dict(zip(rows_as_bytes(matrix[records]), records.tolist(), strict=True))
        winners = np.fromiter(last.values(), dtype=np.intp, count=len(last))
        is_live[records] = False
        is_live[winners] = ~removed[winners]
    return np.flatnonzero(is_live)


def _live_by_dict(keys: list[bytes], kinds: np.ndarray) -> np.ndarray | None:
    """The same for keys of several lengths: a dict built at C speed finds each key's last
    record."""
    last = dict(zip(keys, range(len(keys)), strict=True))
    if len(last) == len(keys) and not (kinds == REMOVE).any():
        return None
    index = np.fromiter(last.values(), dtype=np.intp, count=len(last))
    index.sort()
    return index[kinds[index] != REMOVE]


def _key_matrix(key_runs: list[np.ndarray], key_len: int) -> np.ndarray:
    """The keys of ``key_runs`` (all ``key_len`` bytes long), a row each, zero-padded to
    whole 64-bit words."""
    width = -(-key_len // 8) * 8
    matrix = np.zeros((sum(map(len, key_runs)), width), dtype=np.uint8)
    position = 0
    for run in key_runs:
        matrix[position : position + len(run), :key_len] = run
        position += len(run)
    return matrix


FINGERPRINT_SEED = 0x9E3779B97F4A7C15
FINGERPRINT_MULTIPLIER = np.uint64(0xFF51AFD7ED558CCD)


def _fingerprints(matrix: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of each row of ``matrix`` (whole 64-bit words): each word mixed
    into the state by a xor, an odd multiplier and a xor-shift."""
    state = np.full(len(matrix), FINGERPRINT_SEED, dtype=np.uint64)
    shift = np.uint64(32)
    for word in matrix.view("<u8").T:
        state ^= word
        state *= FINGERPRINT_MULTIPLIER
        state ^= state >> shift
    return state


def read_journal(path: Path) -> Replay:
    """What the journal at ``path`` describes, read without opening it for writing (for
    tools and tests: a running daemon keeps appending)."""
    return _replay(path.read_bytes())[0]


class Journal:
    """The journal of one arena: replayed at open, appended to while the daemon runs."""

    def __init__(
        self,
        path: Path,
        dev: int,
        ino: int,
        arena_bytes: int,
        *,
        fresh: bool = False,
        dir_fd: int | None = None,
        deferred: bool = False,
    ):
        """``dir_fd``: the node directory's descriptor, which the journal's files are
        opened relative to, never through a symbolic link (None: by ``path``).  With
        ``deferred``, the journal is only read until :meth:`commit` (a node's start: nothing
        is written until every check has passed)."""
        self.path = path
        self._dir_fd = dir_fd
        self._name = path.name if dir_fd is not None else str(path)
        self._identity = (dev, ino, arena_bytes)
        self.replayed = Replay.empty()
        self.num_records = 0
        self._valid_bytes = 0
        self._filled: dict[bytes, Entry] = {}  # FILLED, not yet followed by COMMIT or REMOVE
        self._new_fd = -1  # the snapshot being written (a compaction under way), else -1
        # What the snapshot has still to write, oldest first: the store's names for its
        # blocks (slots of its index), each turned into an entry when its step comes.
        self._snapshot: Sequence[int] | np.ndarray = []
        self._snapshot_at = 0  # how many of them it wrote
        self._new_records = 0
        # The format the journal had and the release that wrote it last (None: a new one).
        self.found: Stamp | None = None
        self._new_bytes = 0
        self.num_bytes = 0  # the file's size
        # What the live records take, for the rule on bytes: a block's record (the keys of
        # a node are of one length) times the blocks, and each labelled namespace's record.
        self._block_record_bytes = record_bytes(b"k" * 48)
        self._label_bytes: dict[bytes, int] = {}
        self._label_total = 0
        self._fd = -1  # open for appends (_open_for_appends)
        if not fresh:
            self.replayed = self._replay()  # read only: a refused start changes nothing
        if self._valid_bytes:
            self.num_records = self.replayed.num_records
            self.num_bytes = self._valid_bytes
            self._count_labels(self.replayed.labels)
        else:
            self.num_records = 1
            self.num_bytes = FILE_HEADER_BYTES + len(_stamp_record())
        if not deferred:
            self._open_for_appends()

    def commit(self) -> None:
        """A journal opened ``deferred``, once every check of the start has passed: open it
        for appends, then stamp it with this release's format (:meth:`stamp`)."""
        self._open_for_appends()
        self.stamp()

    def _open_for_appends(self) -> None:
        """Drop a compaction a crash cut short and the torn tail replay stopped at (or start
        a new journal), and append from there."""
        self._unlink(self._name + ".new")
        if self._valid_bytes:
            self._fd = open_in(self._dir_fd, self._name, os.O_WRONLY)
            os.ftruncate(self._fd, self._valid_bytes)  # drop a torn tail: append after it
            os.lseek(self._fd, 0, os.SEEK_END)
        else:
            self._fd = self._create(self._name)

    def _create(self, name: str) -> int:
        """A new journal file: its header, then a STAMP naming this release."""
        fd = open_in(self._dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
        _write_all(fd, _header(*self._identity) + _stamp_record())
        return fd

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _replay(self) -> Replay:
        try:
            data = _map(open_in(self._dir_fd, self._name, os.O_RDONLY))
        except FileNotFoundError:
            return Replay.empty()
        header = read_header(data, self.path)  # a damaged or unknown format: refused
        if header is None or (header.dev, header.ino, header.arena_bytes) != self._identity:
            return Replay.empty()  # cut off as it was created, or another arena's
        replayed, self._valid_bytes = _replay(data)
        self.found = Stamp(header.version, replayed.writer)
        return replayed

    def stamp(self) -> None:
        """Bring the journal this daemon adopted to this release's format, in place (rule
        8; :meth:`commit` calls it once every check of the start has passed): a STAMP naming
        this release, then, for format 1, the header.  A crash between the two leaves a format-1
        header before a STAMP, which replay reads as well."""
        found = self.found
        if found is None or found == Stamp(JOURNAL.version, RELEASE):
            return
        self._write([_stamp_record()])
        if found.version != JOURNAL.version:
            os.pwrite(self._fd, _header(*self._identity), 0)

    def forget_replay(self) -> None:
        """Drop the blocks replay found, once the store adopted them (what it counted stays)."""
        counted = self.replayed
        self.replayed = Replay.empty()
        self.replayed.writer = counted.writer
        self.replayed.num_records = counted.num_records
        self.replayed.num_torn_bytes = counted.num_torn_bytes

    # -- appending ------------------------------------------------------------------------

    def committed(self, entries: Iterable[Entry]) -> None:
        entries = list(entries)
        self._write([_record(COMMIT, e.key, e.offset, e.size, e.checksum or 0) for e in entries])
        for entry in entries:
            self._filled.pop(entry.key, None)
        if entries:
            self._block_record_bytes = record_bytes(entries[-1].key)

    def committed_many(
        self, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, checksums: np.ndarray
    ) -> None:
        """:meth:`committed` of a commit's blocks whose keys are all of one length, given as
        a matrix of their bytes (``rows``): the records built together."""
        self._append(_block_records(COMMIT, rows, offsets, sizes, checksums), len(rows))
        if self._filled:
            for key in rows_as_bytes(rows):
                self._filled.pop(key, None)
        if len(rows):
            self._block_record_bytes = RECORD.size + rows.shape[1] + RECORD_CHECKSUM.size

    def filled(self, entries: Iterable[Entry]) -> None:
        entries = list(entries)
        self._write([_record(FILLED, e.key, e.offset, e.size) for e in entries])
        self._filled.update((entry.key, entry) for entry in entries)

    def removed(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        self._write([_record(REMOVE, key) for key in keys])
        for key in keys:
            self._filled.pop(key, None)

    def labelled(self, namespace_id: bytes, label: str) -> None:
        encoded = _label(label)
        self._write([_record(LABEL, namespace_id, label=encoded)])
        size = record_bytes(namespace_id, encoded)
        self._label_total += size - self._label_bytes.get(namespace_id, 0)
        self._label_bytes[namespace_id] = size

    def _count_labels(self, labels: dict[bytes, str]) -> None:
        """What the records of ``labels``, the live ones, take."""
        self._label_bytes = {ns: record_bytes(ns, _label(label)) for ns, label in labels.items()}
        self._label_total = sum(self._label_bytes.values())

    def record_bytes(self, key: bytes, label: str = "") -> int:
        """The bytes a record of ``key`` (with ``label``: a LABEL record) appends."""
        return record_bytes(key, _label(label)) if label else record_bytes(key)

    def _write(self, records: list[bytes]) -> None:
        if records:
            self._append(b"".join(records), len(records))

    def _append(self, data: bytes, num_records: int) -> None:
        if num_records:
            _write_all(self._fd, data)
            self.num_records += num_records
            self.num_bytes += len(data)
            if self._new_fd >= 0:  # the snapshot hears it too, after what it wrote so far
                _write_all(self._new_fd, data)
                self._new_records += num_records
                self._new_bytes += len(data)

    # -- compaction -----------------------------------------------------------------------

    def needs_compaction(self, num_live: int) -> bool:
        """Whether the journal holds ``COMPACT_RATIO`` times what its ``num_live`` blocks
        and its labels take, in records or in bytes (and is not tiny)."""
        if self.num_records > max(COMPACT_MIN_RECORDS, COMPACT_RATIO * num_live):
            return True
        live_bytes = num_live * self._block_record_bytes + self._label_total
        return self.num_bytes > max(COMPACT_MIN_BYTES, COMPACT_RATIO * live_bytes)

    @property
    def compacting(self) -> bool:
        return self._new_fd >= 0

    def start_compaction(
        self, blocks: Sequence[int] | np.ndarray, labels: dict[bytes, str]
    ) -> None:
        """Begin a snapshot of ``blocks`` (the store's slots, oldest first; the journal
        takes the sequence) and of ``labels``; :meth:`compact_step` writes it."""
        self._new_fd = self._create(self._name + ".new")
        records = [_record(LABEL, ns, label=_label(label)) for ns, label in labels.items()]
        self._count_labels(labels)
        # Blocks still being sealed: their writers were told they are stored.
        records += [_record(FILLED, e.key, e.offset, e.size) for e in self._filled.values()]
        data = b"".join(records)
        _write_all(self._new_fd, data)
        self._new_records = 1 + len(records)  # and the STAMP _create wrote
        self._new_bytes = FILE_HEADER_BYTES + len(_stamp_record()) + len(data)
        self._snapshot, self._snapshot_at = blocks, 0

    def compact_step(self, live: Callable[[int], Entry | None]) -> bool:
        """Write the next ``COMPACT_STEP`` blocks of the snapshot that ``live`` says are
        committed now (their entries now); once all are written, the snapshot replaces the
        journal (then True)."""
        end = min(self._snapshot_at + COMPACT_STEP, len(self._snapshot))
        entries = [e for b in self._snapshot[self._snapshot_at : end] if (e := live(b)) is not None]
        self._snapshot_at = end
        records = [_record(COMMIT, e.key, e.offset, e.size, e.checksum or 0) for e in entries]
        data = b"".join(records)
        try:
            _write_all(self._new_fd, data)
            self._new_records += len(records)
            self._new_bytes += len(data)
            if end == len(self._snapshot):
                os.replace(
                    self._name + ".new",
                    self._name,
                    src_dir_fd=self._dir_fd,
                    dst_dir_fd=self._dir_fd,
                )
        except BaseException:
            self._abandon_compaction()
            raise
        if end < len(self._snapshot):
            return False
        os.close(self._fd)
        self._fd, self._new_fd = self._new_fd, -1
        self.num_records = self._new_records
        self.num_bytes = self._new_bytes
        self._snapshot, self._snapshot_at = [], 0
        return True

    def _abandon_compaction(self) -> None:
        os.close(self._new_fd)
        self._new_fd = -1
        self._snapshot, self._snapshot_at = [], 0
        self._unlink(self._name + ".new")

    def close(self, *, remove: bool = False) -> None:
        if self._new_fd >= 0:
            self._abandon_compaction()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            self._unlink(self._name)


def _map(fd: int) -> Data:
    """The bytes of the journal open at ``fd`` (closed here), mapped, not copied (a
    restart reads ~90 MB per million records).  Only for the daemon's own journal: it
    holds the node directory's lock, so nobody truncates the file under the map.
    Unmapped once the last reference to it (replay's numpy views included) is gone."""
    with open(fd, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class NoJournal:
    """Memory only: nothing outlives the process (tests, and ``--fresh`` of nothing)."""

    replayed = Replay.empty()
    found = None

    def forget_replay(self) -> None:
        pass

    def stamp(self) -> None:
        pass

    def committed(self, entries: Iterable[Entry]) -> None:
        pass

    def committed_many(
        self, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, checksums: np.ndarray
    ) -> None:
        pass

    def filled(self, entries: Iterable[Entry]) -> None:
        pass

    def removed(self, keys: Iterable[bytes]) -> None:
        pass

    def labelled(self, namespace_id: bytes, label: str) -> None:
        pass

    def record_bytes(self, key: bytes, label: str = "") -> int:
        return 0

    def needs_compaction(self, num_live: int) -> bool:
        return False

    compacting = False

    def start_compaction(
        self, blocks: Sequence[int] | np.ndarray, labels: dict[bytes, str]
    ) -> None:
        pass

    def compact_step(self, live: Callable[[int], Entry | None]) -> bool:
        return False

    def close(self, *, remove: bool = False) -> None:
        pass
