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
  by it).

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
6. When the journal holds much more than it describes, it is compacted: a snapshot of the
   live records (committed blocks, and FILLED blocks not committed yet) is written beside it
   and renamed over it, so a crash mid-way leaves the old journal whole.  The snapshot is
   written a step at a time (``COMPACT_STEP`` records per commit), never in one pass over
   the whole index: while it is under way every record goes to both files, and a block is
   written into the snapshot only if it is still live when its step comes, so the new file
   describes what the old one does when it replaces it.
7. The header names the arena (device, inode, size): a journal of another arena is
   discarded at start.

Writes go to tmpfs (page cache): they outlive the process at once, with no fsync; a host
reboot loses the arena and the journal together.  Adopted blocks are verified before they
are served like every block, by their readers, against the checksums recorded here.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

FILE_MAGIC = b"KVPOOLJ1"
FILE_HEADER_BODY = struct.Struct("<8sQQQ")  # magic, dev, ino, arena bytes
FILE_HEADER_BYTES = FILE_HEADER_BODY.size + 8  # and the body's checksum
RECORD_MAGIC = b"KVJR"
RECORD = struct.Struct("<4sBBHQQQ")  # magic, kind, key length, label length, offset, size, checksum
RECORD_CHECKSUM = struct.Struct("<Q")
MAX_KEY_BYTES = 255
MAX_LABEL_BYTES = 1024
COMMIT, REMOVE, LABEL, FILLED = 1, 2, 3, 4
# Compact when the journal holds this many times the live records (and is not tiny): what
# a restart replays.  Cheap, now that a compaction is written a step per commit.
COMPACT_RATIO = 2
COMPACT_MIN_RECORDS = 4096
# Snapshot records a compaction writes per step (per commit): a few milliseconds of work.
COMPACT_STEP = 1024
# Records replay decodes together at most (a bounded batch, however long the journal).
RUN_RECORDS = 1 << 16


class Entry(NamedTuple):
    """A live block as the journal recorded it (a tuple: replay makes millions)."""

    key: bytes
    offset: int
    size: int
    checksum: int | None  # None: FILLED, not hashed yet


@dataclass(slots=True)
class Replay:
    """What a journal described: live blocks (commit order), labels, and how much of the
    file was torn off."""

    entries: list[Entry]
    labels: dict[bytes, str]
    num_records: int = 0
    num_torn_bytes: int = 0


def _record(
    kind: int, key: bytes, offset: int = 0, size: int = 0, checksum: int = 0, label: bytes = b""
) -> bytes:
    body = (
        RECORD.pack(RECORD_MAGIC, kind, len(key), len(label), offset, size, checksum) + key + label
    )
    return body + RECORD_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def _header(dev: int, ino: int, arena_bytes: int) -> bytes:
    body = FILE_HEADER_BODY.pack(FILE_MAGIC, dev, ino, arena_bytes)
    return body + RECORD_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


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


def _parse_run(
    data: bytes, position: int, key_len: int
) -> list[tuple[int, int, bytes, int, int, int, bytes]]:
    """The intact block records from ``position`` on whose keys are all ``key_len`` bytes
    long (nearly every record of a journal), decoded together: a restart replays millions,
    and numpy checks their headers at once; each record's checksum is still verified."""
    dtype = _run_dtype(key_len)
    count = min(RUN_RECORDS, (len(data) - position) // dtype.itemsize)
    if count < 2:
        return []
    records = np.frombuffer(data, dtype, count, position)
    kind = records["kind"]
    fits = (
        (records["magic"] == RECORD_MAGIC)
        & (records["key_len"] == key_len)
        & (records["label_len"] == 0)
        & ((kind == COMMIT) | (kind == REMOVE) | (kind == FILLED))
    )
    if not fits.all():
        count = int(np.argmin(fits))
    body = dtype.itemsize - RECORD_CHECKSUM.size
    view, hash_ = memoryview(data), xxhash.xxh3_64_intdigest
    starts = range(position, position + count * dtype.itemsize, dtype.itemsize)
    digests = np.fromiter((hash_(view[p : p + body]) for p in starts), np.uint64, count)
    intact = digests == records["crc"][:count]
    if not intact.all():
        count = int(np.argmin(intact))
    key_at = RECORD.size
    ends = range(position + dtype.itemsize, position + (count + 1) * dtype.itemsize, dtype.itemsize)
    return list(
        zip(
            ends,
            kind[:count].tolist(),
            [data[p + key_at : p + key_at + key_len] for p in starts[:count]],
            records["offset"][:count].tolist(),
            records["size"][:count].tolist(),
            records["checksum"][:count].tolist(),
            itertools.repeat(b"", count),
            strict=False,
        )
    )


def _parse(data: bytes) -> Iterator[tuple[int, int, bytes, int, int, int, bytes]]:
    """(end position, kind, key, offset, size, checksum, label) of each intact record."""
    position = FILE_HEADER_BYTES
    while position + RECORD.size + RECORD_CHECKSUM.size <= len(data):
        magic, kind, key_len, label_len, offset, size, checksum = RECORD.unpack_from(data, position)
        if magic == RECORD_MAGIC and kind != LABEL and not label_len:
            run = _parse_run(data, position, key_len)
            if run:
                yield from run
                position = run[-1][0]
                continue
        end = position + RECORD.size + key_len + label_len
        if (
            magic != RECORD_MAGIC
            or kind not in (COMMIT, REMOVE, LABEL, FILLED)
            or end + 8 > len(data)
        ):
            return
        (expected,) = RECORD_CHECKSUM.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(data[position:end]) != expected:
            return
        key = data[position + RECORD.size : position + RECORD.size + key_len]
        label = data[position + RECORD.size + key_len : end]
        position = end + RECORD_CHECKSUM.size
        yield position, kind, key, offset, size, checksum, label


def _replay(data: bytes) -> tuple[Replay, int]:
    """What the records of a journal's bytes describe, and where its intact records end."""
    # Millions of short-lived tuples and no cycles: a collection pass every few thousand
    # of them would walk all those still alive (minutes, for a long journal).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay_records(data)
    finally:
        if enabled:
            gc.enable()


def _replay_records(data: bytes) -> tuple[Replay, int]:
    live: dict[bytes, tuple[bytes, int, int, int | None]] = {}
    labels: dict[bytes, str] = {}
    num_records = 0
    valid_bytes = FILE_HEADER_BYTES
    for end, kind, key, offset, size, checksum, label in _parse(data):
        num_records += 1
        valid_bytes = end
        if kind in (COMMIT, FILLED):
            live.pop(key, None)  # re-inserted: its commit order is the newest
            live[key] = (key, offset, size, checksum if kind == COMMIT else None)
        elif kind == REMOVE:
            live.pop(key, None)
        else:
            labels[key] = label.decode("utf-8", "replace")
    torn = len(data) - valid_bytes
    entries = list(map(Entry._make, live.values()))
    return Replay(entries, labels, num_records, torn), valid_bytes


def read_journal(path: Path) -> Replay:
    """What the journal at ``path`` describes, read without opening it for writing (for
    tools and tests: a running daemon keeps appending)."""
    return _replay(path.read_bytes())[0]


class Journal:
    """The journal of one arena: replayed at open, appended to while the daemon runs."""

    def __init__(self, path: Path, dev: int, ino: int, arena_bytes: int, *, fresh: bool = False):
        self.path = path
        self._identity = (dev, ino, arena_bytes)
        self.replayed = Replay([], {})
        self.num_records = 0
        self._valid_bytes = 0
        self._filled: dict[bytes, Entry] = {}  # FILLED, not yet followed by COMMIT or REMOVE
        self._new_fd = -1  # the snapshot being written (a compaction under way), else -1
        self._snapshot: list[bytes] = []  # keys the snapshot has still to write, oldest first
        self._snapshot_at = 0  # how many of them it wrote
        self._new_records = 0
        Path(str(path) + ".new").unlink(missing_ok=True)  # a compaction a crash cut short
        if not fresh:
            self.replayed = self._replay()
        if self._valid_bytes:
            self._fd = os.open(path, os.O_WRONLY)
            os.ftruncate(self._fd, self._valid_bytes)  # drop a torn tail: append after it
            os.lseek(self._fd, 0, os.SEEK_END)
            self.num_records = self.replayed.num_records
        else:
            self._fd = self._create(path)

    def _create(self, path: Path) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o660)
        os.write(fd, _header(*self._identity))
        return fd

    def _replay(self) -> Replay:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Replay([], {})
        if data[:FILE_HEADER_BYTES] != _header(*self._identity):
            return Replay([], {})  # another arena's, or a garbled header: start empty
        replayed, self._valid_bytes = _replay(data)
        return replayed

    # -- appending ------------------------------------------------------------------------

    def committed(self, entries: Iterable[Entry]) -> None:
        entries = list(entries)
        self._write([_record(COMMIT, e.key, e.offset, e.size, e.checksum or 0) for e in entries])
        for entry in entries:
            self._filled.pop(entry.key, None)

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
        self._write([_record(LABEL, namespace_id, label=label.encode()[:MAX_LABEL_BYTES])])

    def _write(self, records: list[bytes]) -> None:
        if records:
            data = b"".join(records)
            _write_all(self._fd, data)
            self.num_records += len(records)
            if self._new_fd >= 0:  # the snapshot hears it too, after what it wrote so far
                _write_all(self._new_fd, data)
                self._new_records += len(records)

    # -- compaction -----------------------------------------------------------------------

    def needs_compaction(self, num_live: int) -> bool:
        return self.num_records > max(COMPACT_MIN_RECORDS, COMPACT_RATIO * num_live)

    @property
    def compacting(self) -> bool:
        return self._new_fd >= 0

    def start_compaction(self, keys: list[bytes], labels: dict[bytes, str]) -> None:
        """Begin a snapshot of the blocks ``keys`` names (oldest first; the journal takes
        the list) and of ``labels``; :meth:`compact_step` writes it."""
        new = Path(str(self.path) + ".new")
        self._new_fd = self._create(new)
        records = [
            _record(LABEL, ns, label=label.encode()[:MAX_LABEL_BYTES])
            for ns, label in labels.items()
        ]
        # Blocks still being sealed: their writers were told they are stored.
        records += [_record(FILLED, e.key, e.offset, e.size) for e in self._filled.values()]
        _write_all(self._new_fd, b"".join(records))
        self._new_records = len(records)
        self._snapshot, self._snapshot_at = keys, 0

    def compact_step(self, live: Callable[[bytes], Entry | None]) -> None:
        """Write the next ``COMPACT_STEP`` keys of the snapshot that ``live`` says are
        committed now; once all are written, the snapshot replaces the journal."""
        end = min(self._snapshot_at + COMPACT_STEP, len(self._snapshot))
        entries = [e for k in self._snapshot[self._snapshot_at : end] if (e := live(k)) is not None]
        self._snapshot_at = end
        records = [_record(COMMIT, e.key, e.offset, e.size, e.checksum or 0) for e in entries]
        try:
            _write_all(self._new_fd, b"".join(records))
            self._new_records += len(records)
            if end == len(self._snapshot):
                os.replace(str(self.path) + ".new", self.path)
        except BaseException:
            self._abandon_compaction()
            raise
        if end < len(self._snapshot):
            return
        os.close(self._fd)
        self._fd, self._new_fd = self._new_fd, -1
        self.num_records = self._new_records
        self._snapshot, self._snapshot_at = [], 0

    def _abandon_compaction(self) -> None:
        os.close(self._new_fd)
        self._new_fd = -1
        self._snapshot, self._snapshot_at = [], 0
        Path(str(self.path) + ".new").unlink(missing_ok=True)

    def close(self, *, remove: bool = False) -> None:
        if self._new_fd >= 0:
            self._abandon_compaction()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class NoJournal:
    """Memory only: nothing outlives the process (tests, and ``--fresh`` of nothing)."""

    replayed = Replay([], {})

    def committed(self, entries: Iterable[Entry]) -> None:
        pass

    def filled(self, entries: Iterable[Entry]) -> None:
        pass

    def removed(self, keys: Iterable[bytes]) -> None:
        pass

    def labelled(self, namespace_id: bytes, label: str) -> None:
        pass

    def needs_compaction(self, num_live: int) -> bool:
        return False

    compacting = False

    def start_compaction(self, keys: list[bytes], labels: dict[bytes, str]) -> None:
        pass

    def compact_step(self, live: Callable[[bytes], Entry | None]) -> None:
        pass

    def close(self, *, remove: bool = False) -> None:
        pass
