"""The index of a store's committed blocks: columns by slot, and a table from key to slot.

A node holds millions of blocks.  One Python object per block (a dict entry, the key's
bytes, a few large ints) costs ~500 bytes of heap each, and each dict's rehash as it grows
holds the event loop for as long as a pass over the whole index.  Here a committed block is
a *slot*: a row of fixed-width columns (its key, offset, size, checksum, pins, reads, seal),
and :class:`BlockIndex` finds a key's slot through an open-addressed table of slot numbers
(linear probing, backward-shift deletion) keyed by Python's hash of the key.

- **Sized once.** A block takes at least one page of the arena, so the arena's page count
  bounds the blocks it can hold: the columns and the table are sized for that many when the
  store is built, and never grow, so nothing ever rehashes or copies the index.
- **Resident as used.** The columns are reserved address space (``MAP_NORESERVE``), made
  resident page by page as slots are used, lowest first (a freed slot is reused before a new
  one): their cost follows the blocks held, ~120 bytes each.  (A host with strict
  overcommit, ``vm.overcommit_memory=2``, counts the whole reservation against its commit
  limit: ~140 bytes per arena page, 3.5 % of the arena.)  The table (two buckets of 4
  bytes per arena page, so at most half full) is touched at random, so it becomes resident
  whole as the arena fills: 8 bytes per 4 KiB page of arena, 0.2 % of it.
- **Hash flooding.** Python's hash of bytes is SipHash with a per-process random key: a
  client cannot choose keys that collide; equal hashes are still compared key to key.

- **A request's keys at once.** A long prompt names ~2,000 blocks: :class:`KeyColumns`
  decodes its keys once into columns (Python's hash of each, their bytes as a matrix), and
  :meth:`BlockIndex.find_many` and :meth:`BlockIndex.insert_many` probe the table for all
  of them together, a round of numpy operations per probe step, where a Python statement
  per key per step cost ~0.5 µs a key (what a node spends per block must not be
  interpreter time).  Keys of several lengths in one request (no engine sends them) take
  the one-key path.

Keys are at most :data:`~kvpool.keys.MAX_KEY_BYTES` long (the protocol refuses longer ones).
Synchronous, touched from one thread (the daemon's event loop), as the store is.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvpool.keys import MAX_KEY_BYTES, MIN_COLUMN_KEYS, BlockOrigin
from kvpool.store.block import Block, BlockState

KEY_WIDTH = MAX_KEY_BYTES
LIVE = 1  # committed: in the table, found by its key
SEALED = 2  # its checksum was computed or verified over its arena bytes by the node
LISTED = 4  # in the shared directory (kvpool.directory): withdrawn when it leaves
# Bytes of columns per slot (key, length, hash, offset, size, checksum, pins, reads, flags).
SLOT_BYTES = KEY_WIDTH + 1 + 8 + 8 + 8 + 8 + 4 + 4 + 1
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class Reserved:
    """Zeroed columns of ``count`` rows, reserved address space that becomes resident only
    where it is written (and so costs what the slots in use take)."""

    def __init__(self, count: int):
        self.count = max(1, count)
        self._maps: list[mmap.mmap] = []

    def column(self, dtype: type[np.generic] | str) -> tuple[np.ndarray, memoryview]:
        """A column of ``count`` items: as numpy (bulk work) and as a memoryview (one item
        at a time: a few times faster from Python)."""
        item = np.dtype(dtype)
        area = self.area(item.itemsize)
        view = memoryview(area).cast(item.char)  # type: ignore[arg-type]
        return np.frombuffer(area, dtype=item, count=self.count), view  # type: ignore[return-value]

    def area(self, row_bytes: int) -> mmap.mmap:
        """``row_bytes`` per row, as a map (its slices are bytes, the fastest to compare)."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        area = mmap.mmap(-1, self.count * row_bytes, flags=flags)
        self._maps.append(area)
        return area


# Probe rounds go on in numpy while more keys than this are still probing; the last few
# (the long runs of a crowded table) take the one-key path.
MIN_ROUND_KEYS = 16
# A request's keys are probed in numpy rounds from this many on, one at a time below: a
# round's dozen calls cost more than a few hundred Python probes (a node answering lookups
# of 64 keys spent ~50 µs more a lookup in rounds; at 512 keys, ~115 µs less).
MIN_PROBE_KEYS = 256


class KeyColumns:
    """A request's keys decoded once: Python's hash of each (int64, as the index keeps
    them), and their bytes as a matrix (``rows``: one row per key) where all are of one
    length, else None.  Each is made when first asked for: a request of a few keys that
    takes the one-key paths never needs them."""

    __slots__ = ("_hashes", "_rows", "_rows_made", "keys")

    def __init__(self, keys: Sequence[bytes]):
        self.keys = keys
        self._hashes: np.ndarray | None = None
        self._rows: np.ndarray | None = None
        self._rows_made = False

    @property
    def hashes(self) -> np.ndarray:
        if self._hashes is None:
            self._hashes = np.fromiter(map(hash, self.keys), np.int64, len(self.keys))
        return self._hashes

    @property
    def rows(self) -> np.ndarray | None:
        if not self._rows_made:
            keys = self.keys
            if keys and len(set(map(len, keys))) == 1:
                joined = b"".join(keys)
                self._rows = np.frombuffer(joined, np.uint8).reshape(len(keys), len(keys[0]))
            self._rows_made = True
        return self._rows

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, indexes: np.ndarray) -> KeyColumns:
        """The columns of the keys at ``indexes``, in that order (nothing hashed again)."""
        taken = KeyColumns([self.keys[i] for i in indexes.tolist()])
        if self._hashes is not None:
            taken._hashes = self._hashes[indexes]
        if self._rows_made:
            taken._rows = self._rows[indexes] if self._rows is not None else None
            taken._rows_made = True
        return taken


class BlockIndex:
    """Committed blocks by slot, found by key in O(1) (see the module's docstring).

    Why so many methods (36): the index is a struct of arrays (a column per field of a
    block, :meth:`__init__`), so each field has its accessor (``key``, ``offset``,
    ``size``, ``checksum``, the pin and read counts, the flags) and each operation a
    one-key form and a many-keys form over whole columns (``find`` / ``find_many``,
    ``insert`` / ``insert_many``, ``add_pin`` / ``add_pins_many``): the many-keys forms are
    the hot path's (numpy over a request's keys), the one-key forms the rest's.
    """

    def __init__(self, max_blocks: int):
        self.max_blocks = max(1, max_blocks)
        space = Reserved(self.max_blocks)
        self._keys = space.area(KEY_WIDTH)  # row by row, each key's bytes then zeros
        self.keys = np.frombuffer(self._keys, np.uint8).reshape(self.max_blocks, KEY_WIDTH)
        self.key_lengths, self._key_lengths = space.column(np.uint8)
        self.hashes, self._hashes = space.column(np.int64)
        self.offsets, self._offsets = space.column(np.int64)
        self.sizes, self._sizes = space.column(np.int64)
        self.checksums, self._checksums = space.column(np.uint64)
        self.pins, self._pins = space.column(np.int32)
        self.reads, self._reads = space.column(np.uint32)
        self.flags, self._flags = space.column(np.uint8)
        self._free_slots, self._free = space.column(np.int32)
        self._num_free = 0
        self.high = 0  # slots ever used: [0, high)
        self.count = 0  # live slots (in the table)
        num_buckets = 1 << (2 * self.max_blocks - 1).bit_length()  # at most half full
        self._mask = num_buckets - 1
        # Slot + 1 per bucket (0: empty), so that a fresh table needs no initialising pass.
        self.table, self._table = Reserved(num_buckets).column(np.int32)

    # -- one key at a time ----------------------------------------------------------------

    def find(self, key: bytes) -> int:
        """The slot of ``key``'s committed block, -1 if none."""
        h = hash(key)
        table, hashes, mask = self._table, self._hashes, self._mask
        keys, lengths, size = self._keys, self._key_lengths, len(key)
        i = h & mask
        while True:
            slot = table[i] - 1
            if slot < 0:
                return -1
            # Equal hashes are compared key to key (inline: every lookup runs this).
            if hashes[slot] == h and lengths[slot] == size:
                start = slot * KEY_WIDTH
                if keys[start : start + size] == key:
                    return slot
            i = (i + 1) & mask

    def insert(self, key: bytes, offset: int, size: int, checksum: int, *, sealed: bool) -> int:
        """A new live slot for ``key`` (not in the index: the caller checked)."""
        slot = self._new_slot()
        h = hash(key)
        start = slot * KEY_WIDTH
        self._keys[start : start + len(key)] = key
        self._key_lengths[slot] = len(key)
        self._hashes[slot] = h
        self._offsets[slot] = offset
        self._sizes[slot] = size
        self._checksums[slot] = checksum
        self._pins[slot] = 0
        self._reads[slot] = 0
        self._flags[slot] = LIVE | (SEALED if sealed else 0)
        table, mask = self._table, self._mask
        i = h & mask
        while table[i]:
            i = (i + 1) & mask
        table[i] = slot + 1
        self.count += 1
        return slot

    # -- a request's keys at once ---------------------------------------------------------

    def find_all(self, keys: Sequence[bytes]) -> np.ndarray:
        """:meth:`find` of each key (int64 slots, -1 where none): together where they are
        many, one at a time below ``MIN_PROBE_KEYS`` (the rounds cost more than they save)."""
        if len(keys) < MIN_PROBE_KEYS:
            return np.array([self.find(key) for key in keys], dtype=np.int64)
        return self.find_many(KeyColumns(keys))

    def find_many(self, columns: KeyColumns) -> np.ndarray:
        """The slot of each key's committed block (int64), -1 where none."""
        n = len(columns)
        found = np.full(n, -1, dtype=np.int64)
        if not n or not self.count:
            return found
        rows = columns.rows if n >= MIN_PROBE_KEYS else None
        if rows is None:
            found[:] = [self.find(key) for key in columns.keys]
            return found
        width = rows.shape[1]
        hashes = columns.hashes
        buckets = hashes & self._mask
        probing = np.arange(n)
        while len(probing) > MIN_ROUND_KEYS:
            slots = self.table[buckets[probing]].astype(np.int64) - 1
            occupied = slots >= 0
            candidate = np.flatnonzero(
                occupied
                & (self.hashes[slots] == hashes[probing])
                & (self.key_lengths[slots] == width)
            )
            same = (self.keys[slots[candidate], :width] == rows[probing[candidate]]).all(axis=1)
            matched = candidate[same]
            found[probing[matched]] = slots[matched]
            done = ~occupied
            done[matched] = True
            probing = probing[~done]
            buckets[probing] = (buckets[probing] + 1) & self._mask
        for i in probing.tolist():
            found[i] = self.find(columns.keys[i])
        return found

    def insert_many(
        self,
        columns: KeyColumns,
        offsets: np.ndarray,
        sizes: np.ndarray,
        checksums: np.ndarray,
        *,
        sealed: bool,
    ) -> np.ndarray:
        """New live slots for distinct keys none of which is in the index (the caller
        checked); their slots (int64), in order."""
        n = len(columns)
        rows = columns.rows if n >= MIN_COLUMN_KEYS else None
        if rows is None:
            return np.array(
                [
                    self.insert(key, offset, size, checksum, sealed=sealed)
                    for key, offset, size, checksum in zip(
                        columns.keys,
                        offsets.tolist(),
                        sizes.tolist(),
                        checksums.tolist(),
                        strict=True,
                    )
                ],
                dtype=np.int64,
            )
        slots = self._new_slots(n)
        self.keys[slots, : rows.shape[1]] = rows
        self.key_lengths[slots] = rows.shape[1]
        self.hashes[slots] = columns.hashes
        self.offsets[slots] = offsets
        self.sizes[slots] = sizes
        self.checksums[slots] = checksums
        self.pins[slots] = 0
        self.reads[slots] = 0
        self.flags[slots] = LIVE | (SEALED if sealed else 0)
        self._place(columns.hashes & self._mask, slots + 1)
        self.count += n
        return slots

    def _new_slots(self, n: int) -> np.ndarray:
        """``n`` free slots: freed ones first (the last freed first, as :meth:`_new_slot`
        takes them), then new ones."""
        reused = min(n, self._num_free)
        start = self._num_free - reused
        slots = np.empty(n, dtype=np.int64)
        slots[:reused] = self._free_slots[start : self._num_free][::-1]
        self._num_free = start
        fresh = n - reused
        if self.high + fresh > self.max_blocks:
            self._free_slots[start : start + reused] = slots[:reused][::-1]
            self._num_free += reused
            raise RuntimeError("the index is full (more blocks than arena pages)")
        slots[reused:] = np.arange(self.high, self.high + fresh)
        self.high += fresh
        return slots

    def set_listed_many(self, slots: np.ndarray) -> None:
        self.flags[slots] |= LISTED

    def unlink(self, slot: int) -> None:
        """Take a live slot out of the table: its key is not found any more.  The slot keeps
        its columns (a pinned block's memory is freed later) until :meth:`release`."""
        table, hashes, mask = self._table, self._hashes, self._mask
        i = hashes[slot] & mask
        while table[i] != slot + 1:
            i = (i + 1) & mask
        # Backward-shift deletion: pull later entries of the run into the hole wherever
        # their probe path passes it, so that no lookup stops short at it (no tombstones).
        j = i
        while True:
            j = (j + 1) & mask
            entry = table[j]
            if not entry:
                break
            home = hashes[entry - 1] & mask
            if (j - home) & mask >= (j - i) & mask:
                table[i] = entry
                i = j
        table[i] = 0
        self._flags[slot] &= ~LIVE
        self.count -= 1

    def release(self, slot: int) -> None:
        """A slot taken out of the table is free for another block."""
        self._free[self._num_free] = slot
        self._num_free += 1

    def _new_slot(self) -> int:
        if self._num_free:
            self._num_free -= 1
            return self._free[self._num_free]
        if self.high == self.max_blocks:
            raise RuntimeError("the index is full (more blocks than arena pages)")
        self.high += 1
        return self.high - 1

    # -- columns of one slot ---------------------------------------------------------------

    def key(self, slot: int) -> bytes:
        start = slot * KEY_WIDTH
        return self._keys[start : start + self._key_lengths[slot]]

    def offset(self, slot: int) -> int:
        return self._offsets[slot]

    def hash_of(self, slot: int) -> int:
        """Python's hash of the slot's key (random per process: for sampling, never kept)."""
        return self._hashes[slot]

    def size(self, slot: int) -> int:
        return self._sizes[slot]

    def checksum(self, slot: int) -> int:
        return self._checksums[slot]

    def is_live(self, slot: int) -> bool:
        return bool(self._flags[slot] & LIVE)

    def is_sealed(self, slot: int) -> bool:
        return bool(self._flags[slot] & SEALED)

    def seal(self, slot: int) -> None:
        self._flags[slot] |= SEALED

    def is_listed(self, slot: int) -> bool:
        return bool(self._flags[slot] & LISTED)

    def set_listed(self, slot: int) -> None:
        self._flags[slot] |= LISTED

    def num_pins(self, slot: int) -> int:
        return self._pins[slot]

    def add_pin(self, slot: int, *, read: bool = True) -> int:
        """One more pin (and, with ``read``, read) of the slot's block; the pins it had
        before."""
        pins = self._pins[slot]
        self._pins[slot] = pins + 1
        if read:
            self.add_read(slot)
        return pins

    def drop_pin(self, slot: int) -> int:
        """One pin fewer; the pins left."""
        pins = self._pins[slot] - 1
        self._pins[slot] = pins
        return pins

    def add_read(self, slot: int) -> None:
        reads = self._reads[slot]
        if reads < 0xFFFFFFFF:
            self._reads[slot] = reads + 1

    def add_reads_many(self, slots: np.ndarray) -> None:
        """:meth:`add_read` of distinct slots."""
        reads = self.reads[slots]
        self.reads[slots] = np.where(reads < 0xFFFFFFFF, reads + 1, reads)

    def add_pins_many(self, slots: np.ndarray, *, read: bool = True) -> np.ndarray:
        """:meth:`add_pin` of distinct slots; the pins each had before."""
        before = self.pins[slots]
        self.pins[slots] = before + 1
        if read:
            self.add_reads_many(slots)
        return before

    def drop_pins_many(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`drop_pin` of distinct slots; the pins each has left."""
        left = self.pins[slots] - 1
        self.pins[slots] = left
        return left

    def blocks(self, slots: np.ndarray, origins: Sequence[BlockOrigin | None]) -> list[Block]:
        """:meth:`block` of each slot, its columns read together (a few, one at a time)."""
        if len(slots) < MIN_COLUMN_KEYS:
            return [self.block(s, o) for s, o in zip(slots.tolist(), origins, strict=True)]
        flags = self.flags[slots].tolist()
        return [
            Block(
                self.key(slot),
                offset,
                size,
                BlockState.COMMITTED if flag & LIVE else BlockState.REMOVED,
                checksum,
                bool(flag & SEALED),
                pins,
                reads,
                origin,
            )
            for slot, offset, size, checksum, flag, pins, reads, origin in zip(
                slots.tolist(),
                self.offsets[slots].tolist(),
                self.sizes[slots].tolist(),
                self.checksums[slots].tolist(),
                flags,
                self.pins[slots].tolist(),
                self.reads[slots].tolist(),
                origins,
                strict=True,
            )
        ]

    def block(self, slot: int, origin: BlockOrigin | None = None) -> Block:
        """The slot's block, as a :class:`Block` (a copy, for a block in flight: a pin's
        reader, a spill, an event)."""
        state = BlockState.COMMITTED if self._flags[slot] & LIVE else BlockState.REMOVED
        return Block(
            self.key(slot),
            self._offsets[slot],
            self._sizes[slot],
            state,
            self._checksums[slot],
            bool(self._flags[slot] & SEALED),
            self._pins[slot],
            self._reads[slot],
            origin,
        )

    # -- in bulk ---------------------------------------------------------------------------

    def live_slots(self) -> np.ndarray:
        """Every live slot, in slot order."""
        return np.flatnonzero(self.flags[: self.high] & LIVE)

    def live_from(self, start: int, limit: int) -> tuple[np.ndarray, int]:
        """The live slots among the next ``limit`` slots from ``start``, and where to go on
        (0 once past the last slot ever used)."""
        end = min(self.high, start + limit)
        found = start + np.flatnonzero(self.flags[start:end] & LIVE)
        return found, (end if end < self.high else 0)

    def adopt(
        self,
        keys: Sequence[bytes],
        offsets: np.ndarray,
        sizes: np.ndarray,
        checksums: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Live, unsealed slots for distinct ``keys`` (a warm restart's blocks, all at once,
        on an index that holds nothing yet); their slots, in order.  ``rows``: the same
        keys as a matrix of bytes, where they are all of one length (the journal's replay
        has them so)."""
        if self.high or self.count:
            raise ValueError("adopt needs an empty index")
        n = len(keys)
        if n > self.max_blocks:
            raise ValueError(f"{n} blocks for an index of {self.max_blocks}")
        slots = np.arange(n, dtype=np.int64)
        if not n:
            return slots
        if rows is not None:
            lengths = np.full(n, rows.shape[1], dtype=np.int64)
            self.keys[:n, : rows.shape[1]] = rows
        else:
            lengths = np.fromiter(map(len, keys), np.int64, n)
        for length in [] if rows is not None else np.unique(lengths).tolist():
            rows = np.flatnonzero(lengths == length)
            same = keys if len(rows) == n else [keys[i] for i in rows.tolist()]
            data = np.frombuffer(b"".join(same), np.uint8).reshape(len(rows), length)
            self.keys[rows, :length] = data
        self.key_lengths[:n] = lengths
        hashes = np.fromiter(map(hash, keys), np.int64, n)
        self.hashes[:n] = hashes
        self.offsets[:n] = offsets
        self.sizes[:n] = sizes
        self.checksums[:n] = checksums
        self.flags[:n] = LIVE
        self._place(hashes & self._mask, slots + 1)
        self.high = self.count = n
        return slots

    def _place(self, buckets: np.ndarray, entries: np.ndarray) -> None:
        """Put ``entries`` into an empty table from their home ``buckets`` on, all at once:
        each round, every entry not placed yet takes its bucket if free (one of those that
        want the same bucket wins), and the others move one on.  An entry moves on only past
        a taken bucket, as linear probing would have it."""
        table = self.table
        waiting = np.arange(len(entries))
        while waiting.size:
            at = buckets[waiting]
            free = table[at] == 0
            trying, at = waiting[free], at[free]
            table[at] = entries[trying]  # of several for one bucket, the last write stays
            placed = np.zeros(len(entries), dtype=bool)
            placed[trying[table[at] == entries[trying]]] = True
            waiting = waiting[~placed[waiting]]
            buckets[waiting] = (buckets[waiting] + 1) & self._mask

    def nbytes(self) -> int:
        """The memory the index takes now: the columns of the slots used, and the table."""
        return self.high * SLOT_BYTES + self.table.nbytes

    def __len__(self) -> int:
        return self.count


def rows_as_bytes(matrix: np.ndarray) -> list[bytes]:
    """Each row of a matrix of bytes as a bytes object."""
    rows = np.ascontiguousarray(matrix)
    if not rows.shape[1]:
        return [b""] * len(rows)
    return cast(list[bytes], rows.view(np.dtype((np.void, rows.shape[1]))).ravel().tolist())


def groups_by_prefix(rows: np.ndarray, num_bytes: int) -> list[tuple[bytes, np.ndarray]]:
    """The distinct first ``num_bytes`` of a matrix of keys (``rows``), each with the rows
    that start with it (a request's keys nearly always share their namespace: then one
    comparison)."""
    heads = rows[:, :num_bytes]
    if not len(rows):
        return []
    if (heads == heads[0]).all():
        return [(heads[0].tobytes(), np.arange(len(rows)))]
    prefixes = np.ascontiguousarray(heads).view(np.dtype((np.void, num_bytes))).ravel()
    unique, inverse = np.unique(prefixes, return_inverse=True)
    return [(unique[i].tobytes(), np.flatnonzero(inverse == i)) for i in range(len(unique))]


def counted_prefixes(
    index: BlockIndex, slots: np.ndarray, num_bytes: int, weights: np.ndarray
) -> dict[bytes, tuple[int, int]]:
    """Per distinct first ``num_bytes`` of the slots' keys: how many slots, and the sum of
    their ``weights`` (sizes): a restart's namespaces and tenants, without a Python
    statement per block."""
    if not len(slots):
        return {}
    rows = np.ascontiguousarray(index.keys[slots, :num_bytes])
    prefixes = rows.view(np.dtype((np.void, num_bytes))).ravel()
    unique, first, inverse, counts = np.unique(
        prefixes, return_index=True, return_inverse=True, return_counts=True
    )
    totals = np.bincount(inverse, weights=weights, minlength=len(unique))
    names = rows_as_bytes(index.keys[slots[first], :num_bytes])
    return {
        name: (int(count), int(total))
        for name, count, total in zip(names, counts.tolist(), totals.tolist(), strict=True)
    }
