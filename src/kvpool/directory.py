"""The shared directory: where each sealed block lies in the arena, so that a same-host reader
copies it without asking the node (no round trip), and knows afterwards whether its copy
is good.

A file beside the arena (``directory`` in the node's directory), written only by the node
(:class:`DirectoryWriter`) and mapped read-only by same-host clients
(:class:`DirectoryReader`).  A header page, then an open-addressed hash table of 32-byte
entries, four native u64 each::

    generation | digest, low word | digest, high word | offset in pages << 32 | size

- The digest is xxh3-128 of the key, with the high word's lowest bit set so that an empty
  entry (all zeros) is never a key's.  An entry lives at the slot its low word names, or at
  most ``MAX_PROBE`` slots after it (linear probing; a removal shifts the entries after it
  back, so there are no tombstones).
- The generation is a sequence lock: the node makes it odd, changes the entry, then makes
  it even again, and never gives an entry a generation it had before.  A reader takes an
  even generation, reads the entry, copies the block, then reads the generation and the
  header's ``retired`` word again: its copy is good only if neither changed.

Rules the node keeps (each has a test in tests/test_directory.py):
1. Only committed, sealed blocks are listed: the node hashed those very bytes, and nothing
   writes a committed block, so a reader copies them without hashing them.
2. A block is withdrawn (its entry's generation moves on) before its memory can be handed
   out again: a reader whose copy raced the reuse sees the generation change.
3. A daemon that starts retires the directory an earlier daemon left (``retired`` = 1)
   before it writes a byte of the arena, then makes a new file: a client still reading the
   old one (its node crashed) finds its copies refused and asks the new node.
4. A key the directory does not list may still be in the pool (being sealed, adopted and
   not yet scrubbed, in a lower tier, or the table was full): the reader asks the node.

Memory order: the node's stores (generation, entry, generation) and a reader's loads
(generation, entry, block, generation) each stay in program order on x86-64 (TSO), and the
node's withdrawal reaches memory before the reservation reply that lets a writer reuse the
block's memory (a system call).  Other architectures need barriers that Python cannot
issue, so there readers do not use the directory (:data:`SUPPORTED`): they pin, as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvpool.config import PAGE_BYTES
from kvpool.keys import MIN_COLUMN_KEYS

MAGIC = int.from_bytes(b"KVPOOLD1", "little")
VERSION = 1
HEADER_BYTES = PAGE_BYTES
HEADER_WORDS = HEADER_BYTES // 8
ENTRY_WORDS = 4
ENTRY_BYTES = ENTRY_WORDS * 8
MAX_PROBE = 32  # an entry lies at most this many slots past its home
FULL_SHARE = 8  # the table lists no more once all but this share of its slots are taken
MIN_SLOTS = 1 << 12
MAX_SLOTS = 1 << 26  # 2 GiB of table
AVERAGE_BLOCK_BYTES = 32 << 10  # slots: twice the blocks of this size the arena holds
MAX_OFFSET_PAGES = 1 << 32
MAX_SIZE = (1 << 32) - 1
# Header words
_MAGIC, _VERSION, _NUM_SLOTS, _RETIRED, _ARENA_ID, _ARENA_BYTES = 0, 1, 2, 3, 4, 6
FILE_MODE = 0o660

SUPPORTED = platform.machine().lower() in {"x86_64", "amd64"}

Location = tuple[int, int, int, int]  # slot, generation, offset, size


def digest(key: bytes) -> tuple[int, int]:
    """The two words an entry holds for ``key``."""
    value = xxhash.xxh3_128_intdigest(key)
    return value & 0xFFFF_FFFF_FFFF_FFFF, (value >> 64) | 1


def num_slots_for(arena_bytes: int) -> int:
    """Table size for an arena: a power of two, room for twice its blocks of average size."""
    want = max(MIN_SLOTS, 2 * arena_bytes // AVERAGE_BLOCK_BYTES)
    return min(MAX_SLOTS, 1 << (want - 1).bit_length())


def file_bytes(num_slots: int) -> int:
    return HEADER_BYTES + num_slots * ENTRY_BYTES


def retire(path: Path) -> None:
    """Mark the directory file at ``path`` retired, if it is one, and remove it (rule 3)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        if os.fstat(fd).st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES) as mapping:
                words = memoryview(mapping).cast("Q")
                if words[_MAGIC] == MAGIC:
                    words[_RETIRED] = 1
                words.release()
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)


class DirectoryWriter:
    """The node's side: lists and withdraws blocks.  Touched from one thread (the store's)."""

    def __init__(self, path: Path, arena_bytes: int, arena_id: bytes, num_slots: int | None = None):
        """``num_slots`` (a power of two) overrides the size the arena's calls for."""
        self.path = path
        self.num_slots = num_slots or num_slots_for(arena_bytes)
        if self.num_slots & (self.num_slots - 1):
            raise ValueError(f"{self.num_slots} slots: not a power of two")
        self._mask = self.num_slots - 1
        self.num_unlisted = 0  # blocks the table had no room for (read through the node)
        # The table is the node's only index of it (no dict of keys: with millions of
        # blocks, one would cost more heap than all of the store's own index).
        self._num_listed = 0
        retire(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            os.ftruncate(fd, file_bytes(self.num_slots))
            # Populated as it is mapped (1/512 of the arena, ~20 ms a GiB of it): a commit
            # lists its blocks at random places, and a first-touch fault per page of table
            # cost a fresh node's commits ~1 µs a block.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, file_bytes(self.num_slots), flags)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._words = memoryview(self._mmap).cast("Q")
        # The same words for numpy: a commit lists its blocks together (:meth:`list_many`).
        self._array: np.ndarray | None = np.frombuffer(self._mmap, np.uint64)
        # Which entries are taken, as the table says (kept by :meth:`_write`): what a
        # commit's keys probe together, 1 byte per 32-byte entry.
        self._occupied = np.zeros(self.num_slots, dtype=bool)
        header = self._words
        header[_VERSION] = VERSION
        header[_NUM_SLOTS] = self.num_slots
        header[_ARENA_ID] = int.from_bytes(arena_id[:8], "little")
        header[_ARENA_ID + 1] = int.from_bytes(arena_id[8:16], "little")
        header[_ARENA_BYTES] = arena_bytes
        header[_MAGIC] = MAGIC  # last: a reader that sees it sees the rest

    def __len__(self) -> int:
        return self._num_listed

    def _find(self, low: int, high: int) -> int | None:
        """The slot of the entry with this digest, if listed (it lies at most
        ``MAX_PROBE`` slots past its home, and no empty slot comes before it)."""
        words, mask = self._words, self._mask
        slot = low & mask
        for _ in range(MAX_PROBE):
            base = HEADER_WORDS + slot * ENTRY_WORDS
            entry_low, entry_high = words[base + 1], words[base + 2]
            if entry_low == low and entry_high == high:
                return slot
            if entry_low == 0 and entry_high == 0:
                return None
            slot = (slot + 1) & mask
        return None

    def list(self, key: bytes, offset: int, size: int, *, replace: bool = True) -> bool:
        """List a sealed block (in place of its key's entry, if ``replace``: the caller may
        say it is not listed); False if the table has no room near its home, or is nearly
        full (past that, probing for room costs every commit ``MAX_PROBE`` reads, mostly
        in vain: blocks many times smaller than the table was sized for)."""
        low, high = digest(key)
        if replace:
            self._withdraw(low, high)
        if (
            offset % PAGE_BYTES
            or offset // PAGE_BYTES >= MAX_OFFSET_PAGES
            or size > MAX_SIZE
            or self._num_listed >= self.num_slots - self.num_slots // FULL_SHARE
        ):
            self.num_unlisted += 1
            return False
        words = self._words
        slot = low & self._mask
        for _ in range(MAX_PROBE):
            base = HEADER_WORDS + slot * ENTRY_WORDS
            if words[base + 1] == 0 and words[base + 2] == 0:
                self._write(slot, low, high, (offset // PAGE_BYTES) << 32 | size)
                self._num_listed += 1
                return True
            slot = (slot + 1) & self._mask
        self.num_unlisted += 1
        return False

    def list_many(
        self, keys: Sequence[bytes], offsets: np.ndarray, sizes: np.ndarray
    ) -> np.ndarray:
        """:meth:`list` (``replace=False``) of a commit's blocks together, none of them
        listed: whether each was.  The blocks are listed in order while the table has room
        (as one call per block would); each entry is written as :meth:`_write` writes one,
        generation odd first and even last, every entry's step before the next step."""
        n = len(keys)
        words = self._array
        if n < MIN_COLUMN_KEYS or words is None:
            one_by_one = zip(keys, offsets.tolist(), sizes.tolist(), strict=True)
            return np.array([self.list(*block, replace=False) for block in one_by_one], bool)
        listed = np.zeros(n, dtype=bool)
        # Each key's xxh3-128, big-endian: its high word, then its low word.
        digests = np.frombuffer(b"".join(map(xxhash.xxh3_128_digest, keys)), ">u8")
        highs = digests[0::2].astype(np.uint64) | np.uint64(1)
        lows = digests[1::2].astype(np.uint64)
        fits = (
            (offsets % PAGE_BYTES == 0)
            & (offsets // PAGE_BYTES < MAX_OFFSET_PAGES)
            & (sizes <= MAX_SIZE)
        )
        room = max(0, self.num_slots - self.num_slots // FULL_SHARE - self._num_listed)
        wanted = np.flatnonzero(fits)[:room]
        self.num_unlisted += n - len(wanted)
        homes = (lows[wanted] & np.uint64(self._mask)).astype(np.int64)
        slots = np.full(n, -1, dtype=np.int64)
        probing = np.arange(len(wanted))
        occupied = self._occupied
        for step in range(MAX_PROBE):
            if len(probing) < MIN_COLUMN_KEYS:  # the last few: a numpy round each costs more
                probing = self._place_each(homes, probing, step, occupied, slots, wanted)
                break
            at = (homes[probing] + step) & self._mask
            free = np.flatnonzero(~occupied[at])
            # Of several keys for one slot, the first takes it; the others probe on.
            _, first = np.unique(at[free], return_index=True)
            winners = free[first]
            occupied[at[winners]] = True
            slots[wanted[probing[winners]]] = at[winners]
            probing = np.delete(probing, winners)
        self.num_unlisted += len(probing)
        placed = np.flatnonzero(slots >= 0)
        base = HEADER_WORDS + slots[placed] * ENTRY_WORDS
        location = (offsets[placed].astype(np.uint64) // np.uint64(PAGE_BYTES)) << np.uint64(32)
        location |= sizes[placed].astype(np.uint64)
        words[base] += np.uint64(1)  # odd: readers keep off
        words[base + 1] = lows[placed]
        words[base + 2] = highs[placed]
        words[base + 3] = location
        words[base] += np.uint64(1)
        self._num_listed += len(placed)
        listed[placed] = True
        return listed

    def _place_each(
        self,
        homes: np.ndarray,
        probing: np.ndarray,
        step: int,
        occupied: np.ndarray,
        slots: np.ndarray,
        wanted: np.ndarray,
    ) -> np.ndarray:
        """:meth:`list_many`'s probing for its last keys, each in turn from ``step`` on (the
        rounds' rule: of two keys for one slot, the earlier takes it); those that find no
        room within ``MAX_PROBE`` slots of their home."""
        mask, unplaced = self._mask, []
        for j in probing.tolist():
            home = int(homes[j])
            for later in range(step, MAX_PROBE):
                at = (home + later) & mask
                if not occupied[at]:
                    occupied[at] = True
                    slots[wanted[j]] = at
                    break
            else:
                unplaced.append(j)
        return np.array(unplaced, dtype=np.int64)

    def withdraw(self, key: bytes) -> None:
        """Withdraw a block (before its memory is handed out again); then close the gap by
        shifting the entries after it back towards their homes."""
        self._withdraw(*digest(key))

    def _withdraw(self, low: int, high: int) -> None:
        hole = self._find(low, high)
        if hole is None:
            return
        self._num_listed -= 1
        self._write(hole, 0, 0, 0)
        words, mask = self._words, self._mask
        slot = hole
        while True:
            slot = (slot + 1) & mask
            base = HEADER_WORDS + slot * ENTRY_WORDS
            low, high, location = words[base + 1], words[base + 2], words[base + 3]
            if (low == 0 and high == 0) or (slot - hole) & mask > MAX_PROBE:
                return  # an empty slot, or entries too far on to have a home before the hole
            home = low & mask
            # The entry may move into the hole if the hole lies between its home and it.
            if (slot - home) & mask >= (slot - hole) & mask:
                self._write(hole, low, high, location)
                self._write(slot, 0, 0, 0)
                hole = slot

    def _write(self, slot: int, low: int, high: int, location: int) -> None:
        words = self._words
        base = HEADER_WORDS + slot * ENTRY_WORDS
        generation = words[base]
        words[base] = generation + 1  # odd: readers keep off
        words[base + 1] = low
        words[base + 2] = high
        words[base + 3] = location
        words[base] = generation + 2
        self._occupied[slot] = bool(low or high)

    def close(self, *, remove: bool = False) -> None:
        """Retire the directory (its readers stop trusting it) and unmap it."""
        if self._mmap.closed:
            return
        self._words[_RETIRED] = 1
        self._words.release()
        self._array = None  # its export of the map, before the map closes
        self._mmap.close()
        if remove:
            self.path.unlink(missing_ok=True)


@dataclass(slots=True)
class Located:
    """Where a batch of keys' blocks lie now, as the directory lists them: per key its
    entry's slot and generation, and the block's offset and size (int64 columns)."""

    slots: np.ndarray
    generations: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)


class DirectoryReader:
    """A client's side: finds listed blocks, and tells whether a copy of them held."""

    def __init__(self, words: memoryview, num_slots: int, arena_bytes: int):
        self._words = words
        self._array = np.frombuffer(words, np.uint64)  # the same words, read together
        self._mask = num_slots - 1
        self._arena_bytes = arena_bytes

    @classmethod
    def open(cls, path: str, arena_id: bytes, arena_bytes: int) -> DirectoryReader | None:
        """Map the node's directory read-only; ``None`` if it is not the one of this arena
        (or readers cannot use it here)."""
        if not SUPPORTED or not path:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                return None
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        words = memoryview(mapping).cast("Q")
        num_slots = words[_NUM_SLOTS]
        expected_id = (
            int.from_bytes(arena_id[:8], "little"),
            int.from_bytes(arena_id[8:16], "little"),
        )
        is_ours = (
            words[_MAGIC] == MAGIC
            and words[_VERSION] == VERSION
            and not words[_RETIRED]
            and num_slots >= 1
            and num_slots & (num_slots - 1) == 0
            and size >= file_bytes(num_slots)
            and (words[_ARENA_ID], words[_ARENA_ID + 1]) == expected_id
            and words[_ARENA_BYTES] == arena_bytes
        )
        if not is_ours:
            words.release()
            with contextlib.suppress(BufferError):
                mapping.close()
            return None
        return cls(words, num_slots, arena_bytes)

    def find(self, key: bytes) -> Location | None:
        """Where ``key``'s block lies now: (slot, generation, offset, size), or ``None``
        (not listed, or its entry is changing: ask the node)."""
        low, high = digest(key)
        words, mask = self._words, self._mask
        slot = low & mask
        for _ in range(MAX_PROBE):
            base = HEADER_WORDS + slot * ENTRY_WORDS
            generation = words[base]
            if generation & 1:
                return None
            entry_low, entry_high = words[base + 1], words[base + 2]
            if entry_low == low and entry_high == high:
                location = words[base + 3]
                offset, size = (location >> 32) * PAGE_BYTES, location & MAX_SIZE
                if offset + size > self._arena_bytes:
                    return None  # read torn: the entry changed under us
                return slot, generation, offset, size
            if entry_low == 0 and entry_high == 0:
                return None
            slot = (slot + 1) & mask
        return None

    def find_all(self, keys: Sequence[bytes]) -> Located | None:
        """Every key's location, or ``None`` if any is not listed (or its entry is
        changing).  The keys probe the table together, a round of numpy loads per probe
        step, each round's generations loaded before its entries (x86-64 keeps loads in
        program order), as :meth:`find` does a key at a time."""
        n = len(keys)
        if n < MIN_COLUMN_KEYS:
            return self._find_each(keys)
        words, mask = self._array, self._mask
        digests = np.frombuffer(b"".join(map(xxhash.xxh3_128_digest, keys)), ">u8")
        highs = digests[0::2].astype(np.uint64) | np.uint64(1)
        lows = digests[1::2].astype(np.uint64)
        at = (lows & np.uint64(mask)).astype(np.int64)
        found = np.full(n, -1, dtype=np.int64)
        generations = np.zeros(n, dtype=np.uint64)
        locations = np.zeros(n, dtype=np.uint64)
        probing = np.arange(n)
        for _ in range(MAX_PROBE):
            if not len(probing):
                break
            base = HEADER_WORDS + at[probing] * ENTRY_WORDS
            generation = words[base]
            entry_low, entry_high, location = words[base + 1], words[base + 2], words[base + 3]
            if (generation & np.uint64(1)).any():
                return None  # an entry is changing: ask the node
            match = (entry_low == lows[probing]) & (entry_high == highs[probing])
            if ((entry_low == 0) & (entry_high == 0) & ~match).any():
                return None  # not listed
            hits = probing[match]
            found[hits] = at[hits]
            generations[hits] = generation[match]
            locations[hits] = location[match]
            probing = probing[~match]
            at[probing] = (at[probing] + 1) & mask
        if len(probing):
            return None
        offsets = (locations >> np.uint64(32)).astype(np.int64) * PAGE_BYTES
        sizes = (locations & np.uint64(MAX_SIZE)).astype(np.int64)
        if ((offsets + sizes) > self._arena_bytes).any():
            return None  # read torn: an entry changed under us
        return Located(found, generations.astype(np.int64), offsets, sizes)

    def _find_each(self, keys: Sequence[bytes]) -> Located | None:
        """:meth:`find_all` a key at a time (a few keys)."""
        found = []
        for key in keys:
            location = self.find(key)
            if location is None:
                return None
            found.append(location)
        columns = np.array(found, dtype=np.int64).reshape(len(keys), 4).T
        return Located(columns[0], columns[1], columns[2], columns[3])

    def unchanged(self, located: Located) -> bool:
        """Whether every entry still has the generation it was found with, and the
        directory is not retired: then copies taken since are good."""
        words = self._array
        now = words[HEADER_WORDS + located.slots * ENTRY_WORDS].astype(np.int64)
        return bool((now == located.generations).all()) and not self._words[_RETIRED]

    @property
    def is_retired(self) -> bool:
        return bool(self._words[_RETIRED])


class NoDirectory:
    """No shared directory (a store in tests, or a node that lists nothing): every same-host
    read asks the node."""

    num_unlisted = 0
    path: Path | None = None

    def __len__(self) -> int:
        return 0

    def list(self, key: bytes, offset: int, size: int, *, replace: bool = True) -> bool:
        return False

    def list_many(
        self, keys: Sequence[bytes], offsets: np.ndarray, sizes: np.ndarray
    ) -> np.ndarray:
        return np.zeros(len(keys), dtype=bool)

    def withdraw(self, key: bytes) -> None:
        pass

    def close(self, *, remove: bool = False) -> None:
        pass
