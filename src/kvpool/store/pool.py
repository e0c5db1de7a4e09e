"""The block store: index, two-phase writes, pins under leases, and eviction.

The store is synchronous and touched from one thread (the daemon's event loop).  It
manages offsets into the arena; it never touches the bytes.  Its only I/O is the journal
(:mod:`kvpool.store.journal`, small appends to a file on tmpfs) that lets a restarted
daemon adopt the blocks of a surviving arena.

Rules (each has a test in tests/store/test_pool.py):
1. ``reserve`` allocates; the key is *pending* (lookups report it, reads never see it).
2. ``commit`` (``take``, pending with no lease, then ``publish``) makes a block visible
   atomically with its checksum; after an abort or expiry it raises :class:`LeaseExpired`.
3. ``abort``, an expired reservation lease, and a disconnecting owner return the memory.
4. ``pin`` protects committed blocks from eviction until ``unpin`` or the pin lease expires;
   a pinned block that is deleted disappears from the index at once, and its memory is
   returned when the last pin drops.
5. Every lease is granted by the store's :class:`~kvpool.timing.LeasePolicy`: whatever a
   caller asks for, a pin or a reservation lasts at most the policy's bound.
6. Eviction removes least recently used committed, unpinned blocks: on demand when an
   allocation fails, and down to the low watermark once usage passes the high watermark.
7. A put of a key that is committed or pending reports EXISTS or PENDING; nothing is
   overwritten (a key names its content).
8. A reservation the node makes for itself (``held``: a promotion) has no lease.
9. An evicted block is offered to the lower tier (``spill``) before its memory is freed.
10. The journal hears every commit before it is acknowledged and every removal before the
    memory can be handed out again; a store built on a replayed journal adopts its blocks.
11. With tenants, no write evicts a block of a tenant within its quota (``quotas``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import takewhile

from kvpool.errors import BadRequest, LeaseExpired, Status
from kvpool.keys import BlockOrigin
from kvpool.store.allocator import Allocator, SegregatedFitAllocator, pages
from kvpool.store.block import (
    Block,
    BlockState,
    CommitResult,
    Pin,
    PinResult,
    Reservation,
    ReserveResult,
    SpillTarget,
    StoreCounters,
    StoreEvents,
)
from kvpool.store.eviction import EvictionPolicy, LRUPolicy
from kvpool.store.journal import Entry, Journal, NoJournal
from kvpool.store.namespaces import NamespaceTable
from kvpool.store.quotas import Quotas
from kvpool.timing import LeasePolicy

Clock = Callable[[], float]
Origins = Sequence[BlockOrigin | None] | None  # per block: what it was computed from
Checksums = Sequence[int | None]  # per block (None: drop it)


class BlockStore:
    def __init__(
        self,
        capacity: int,
        *,
        allocator: Allocator | None = None,
        eviction: EvictionPolicy | None = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        leases: LeasePolicy | None = None,
        journal: Journal | NoJournal | None = None,
        spill: SpillTarget | None = None,
        clock: Clock = time.monotonic,
    ):
        self.allocator = allocator or SegregatedFitAllocator(capacity)
        self.capacity = self.allocator.capacity
        self.eviction = eviction or LRUPolicy()
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.leases = leases or LeasePolicy()
        self.clock = clock
        self.counters = StoreCounters()
        self.namespaces = NamespaceTable()
        self.on_change: Callable[[], None] | None = None
        self.events: StoreEvents | None = None
        self._index: dict[bytes, Block] = {}  # every block in the index, pending or committed
        self._committed: dict[bytes, Block] = {}  # only the committed ones: the fast path
        self._reservations: dict[int, Reservation] = {}
        self._pins: dict[int, Pin] = {}
        self._owner_to_reservation_ids: dict[int, set[int]] = {}
        self._owner_to_pin_ids: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self.reserved_bytes = 0
        self.committed_bytes = 0
        self.num_committed = 0
        self.journal = journal or NoJournal()
        self.spill = spill
        self.quotas: Quotas | None = None  # per-tenant limits (kvpool.store.quotas)
        self._adopt()

    def set_quotas(self, limits: dict[bytes, int] | None) -> None:
        """Per-tenant limits, by tag (None: no tenants); counts what is held now."""
        self.quotas = None if limits is None else Quotas()
        if self.quotas is not None and limits is not None:
            self.quotas.recount(limits, ((b.key, b.size) for b in self._index.values()))

    def _adopt(self) -> None:
        """Take over the blocks a replayed journal describes (a warm restart)."""
        replayed = self.journal.replayed
        hashed = [e for e in replayed.entries if e.checksum is not None]  # see seal_replayed
        entries = [e for e in hashed if pages(e.size) * 4096 <= self.capacity]
        taken = self.allocator.adopt([(e.offset, e.size) for e in entries])
        dropped = []
        for entry, ok in zip(entries, taken, strict=True):
            if not ok:
                dropped.append(entry.key)
                continue
            checksum = entry.checksum or 0
            block = Block(entry.key, entry.offset, entry.size, BlockState.COMMITTED, checksum)
            self._index[block.key] = block
            self._insert_committed(block)
        for namespace_id, label in replayed.labels.items():
            self.describe(namespace_id, label, journal=False)
        self.counters.adopted = self.num_committed
        self.counters.puts = 0
        self.namespaces.reset_puts()
        if dropped:
            self.journal.removed(dropped)

    # -- writes ---------------------------------------------------------------------------

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        owner: int,
        lease_s: float = 0.0,
        *,
        held: bool = False,
    ) -> ReserveResult:
        """Allocate space for the keys that are neither stored nor pending, for at most the
        policy's reservation lease (``lease_s`` 0: exactly that; ``held``: no lease, for the
        node's own copies, which always end in commit or abort)."""
        if len(keys) != len(sizes):
            raise BadRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        statuses: list[Status] = []
        wanted: list[int] = []
        seen: set[bytes] = set()
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            existing = self._index.get(key)
            if existing is not None or key in seen:
                pending = existing is None or existing.state is BlockState.RESERVED
                statuses.append(Status.PENDING if pending else Status.EXISTS)
            elif pages(size) * 4096 > self.capacity:
                statuses.append(Status.REFUSED)
            elif self.quotas is not None and not self._fit_quota(key, size):
                statuses.append(Status.OVER_QUOTA)
            else:
                statuses.append(Status.OK)
                wanted.append(i)
                seen.add(key)
                if self.quotas is not None:
                    self.quotas.added(key, size)  # counted from the reservation on
        blocks: list[Block | None] = [None] * len(keys)
        offsets = self._allocate_batch([keys[i] for i in wanted], [sizes[i] for i in wanted])
        for i, offset in zip(wanted, offsets, strict=True):
            if offset is None:
                statuses[i] = Status.NO_SPACE
                if self.quotas is not None:
                    self.quotas.removed(keys[i], sizes[i])
                continue
            block = Block(keys[i], offset, sizes[i])
            self._index[keys[i]] = block
            self.reserved_bytes += block.size
            blocks[i] = block
        reservation_id = 0
        granted = math.inf if held else self.leases.reserve(lease_s)
        if any(b is not None for b in blocks):
            reservation_id = next(self._ids)
            deadline = self.clock() + granted
            self._reservations[reservation_id] = Reservation(
                reservation_id, owner, blocks, deadline
            )
            self._owner_to_reservation_ids.setdefault(owner, set()).add(reservation_id)
        return ReserveResult(reservation_id, statuses, blocks, granted)

    def commit(
        self, reservation_id: int, checksums: Checksums, owner: int, origins: Origins = None
    ) -> CommitResult:
        return self.publish(self.take(reservation_id, owner), checksums, origins)

    def take(self, reservation_id: int, owner: int) -> list[Block | None]:
        """End a reservation's lease; its blocks stay pending until :meth:`publish`."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.owner != owner:
            raise LeaseExpired(f"reservation {reservation_id} expired or was aborted")
        self._forget_reservation(reservation)
        return reservation.blocks

    def publish(
        self, blocks: Sequence[Block | None], checksums: Checksums, origins: Origins = None
    ) -> CommitResult:
        """Make taken blocks visible, with checksums the node computed over their bytes."""
        if len(checksums) != len(blocks):
            raise BadRequest(f"{len(checksums)} checksums for a reservation of {len(blocks)}")
        if origins is not None and len(origins) != len(checksums):
            raise BadRequest(f"{len(origins)} origins for {len(checksums)} checksums")
        result = CommitResult([])
        for i, (block, checksum) in enumerate(zip(blocks, checksums, strict=True)):
            if block is None:
                result.statuses.append(Status.NOT_FOUND)
            elif checksum is None:
                self.journal.removed([block.key])  # a FILLED record may name it
                self._fail(block)
                result.statuses.append(Status.NOT_FOUND)
            else:
                block.origin = origins[i] if origins is not None else None
                self._commit(block, checksum)
                result.statuses.append(Status.OK)
                result.committed.append(block)
        self.journal.committed(Entry(b.key, b.offset, b.size, b.checksum) for b in result.committed)
        self._evict_past_high_watermark()
        if self.journal.needs_compaction(self.num_committed):
            self.journal.compact(self._entries_oldest_first(), self.namespaces.labels())
        self._changed()
        return result

    def abort(self, reservation_id: int, owner: int) -> None:
        reservation = self._reservations.get(reservation_id)
        if reservation is None or reservation.owner != owner:
            return
        self._forget_reservation(reservation)
        for block in reservation.blocks:
            if block is not None:
                self._fail(block)
        self._changed()

    def _commit(self, block: Block, checksum: int) -> None:
        block.state = BlockState.COMMITTED
        block.checksum = checksum
        block.sealed = True
        self.reserved_bytes -= block.size
        self._insert_committed(block)

    def _insert_committed(self, block: Block) -> None:
        self._committed[block.key] = block
        self.committed_bytes += block.size
        self.num_committed += 1
        self.eviction.touch(block.key)
        self.namespaces.added(block.key, block.size)
        self.counters.puts += 1
        if self.events is not None:
            self.events.stored(block)

    def _fail(self, block: Block) -> None:
        block.state = BlockState.FAILED
        self.reserved_bytes -= block.size
        if self.quotas is not None:
            self.quotas.removed(block.key, block.size)
        if self._index.get(block.key) is block:
            del self._index[block.key]
        self.allocator.free(block.offset)

    def _forget_reservation(self, reservation: Reservation) -> None:
        del self._reservations[reservation.reservation_id]
        _forget_id(self._owner_to_reservation_ids, reservation.owner, reservation.reservation_id)

    # -- reads ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, count: bool = True) -> tuple[int, bool]:
        """The length of the longest committed prefix, and whether the next key is pending."""
        num_prefix = len(list(takewhile(self._committed.__contains__, keys)))
        pending = num_prefix < len(keys) and keys[num_prefix] in self._index
        if count:
            self.record_lookup(keys, num_prefix)
        return num_prefix, pending

    def lookup_mask(self, keys: Sequence[bytes], *, count: bool = True) -> list[bool]:
        """Whether each key is committed."""
        committed = self._committed
        present = [k in committed for k in keys]
        if count:
            hits = sum(present)
            self.counters.lookup_hits += hits
            self.counters.lookup_misses += len(keys) - hits
        return present

    def pending_mask(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is being written (reserved, not committed yet)."""
        index, committed = self._index, self._committed
        return [k in index and k not in committed for k in keys]

    def record_lookup(self, keys: Sequence[bytes], num_prefix: int) -> None:
        """Count a lookup of ``keys`` that found ``num_prefix`` leading blocks (for a lookup
        that waited, counted once at its end)."""
        self.counters.lookup_hits += num_prefix
        self.counters.lookup_misses += len(keys) - num_prefix
        self.namespaces.looked_up(keys, num_prefix)

    def pin(
        self, keys: Sequence[bytes], owner: int, lease_s: float = 0.0, *, prefix: bool = False
    ) -> PinResult:
        """Pin the committed blocks among ``keys`` (only the leading run if ``prefix``) for
        at most the policy's pin lease (``lease_s`` 0: exactly that)."""
        found: list[Block | None] = []
        pinned: list[Block] = []
        committed = self._committed
        for key in keys:
            block = committed.get(key)
            if block is None or (prefix and len(pinned) < len(found)):
                found.append(None)
                continue
            block.num_pins += 1
            block.num_reads += 1
            self.eviction.touch(key)
            found.append(block)
            pinned.append(block)
        self.counters.get_hits += len(pinned)
        self.counters.get_misses += len(keys) - len(pinned)
        granted = self.leases.pin(lease_s)
        if not pinned:
            return PinResult(0, found, granted)
        pin_id = next(self._ids)
        self._pins[pin_id] = Pin(pin_id, owner, pinned, self.clock() + granted)
        self._owner_to_pin_ids.setdefault(owner, set()).add(pin_id)
        return PinResult(pin_id, found, granted)

    def unpin(self, pin_id: int, owner: int | None = None) -> bool:
        pin = self._pins.get(pin_id)
        if pin is None or (owner is not None and pin.owner != owner):
            return False
        del self._pins[pin_id]
        _forget_id(self._owner_to_pin_ids, pin.owner, pin_id)
        for block in pin.blocks:
            block.num_pins -= 1
            if block.num_pins == 0 and block.state is BlockState.REMOVED:
                self.allocator.free(block.offset)
        return True

    def get_block(self, key: bytes) -> Block | None:
        return self._committed.get(key)

    def committed_blocks(self) -> list[Block]:
        """Every committed block, oldest commit first."""
        return list(self._committed.values())

    # -- removal --------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> list[Status]:
        statuses = []
        for key in keys:
            block = self._index.get(key)
            if block is None:
                statuses.append(Status.NOT_FOUND)
            elif block.state is BlockState.RESERVED:
                statuses.append(Status.PENDING)
            else:
                self._remove(block)
                statuses.append(Status.OK)
        return statuses

    def report_corrupt(self, keys: Sequence[bytes]) -> list[Status]:
        """A reader found these blocks corrupt: drop them so that they are rewritten."""
        self.counters.corrupt_reports += len(keys)
        return self.delete(keys)

    def _remove(self, block: Block, *, evicted: bool = False) -> None:
        del self._index[block.key]
        del self._committed[block.key]
        self.eviction.remove(block.key)
        self.journal.removed([block.key])  # before the memory can be handed out again
        block.state = BlockState.REMOVED
        if evicted:
            self.counters.evictions += 1
            if self.spill is not None and self.spill.offer(block):
                self.counters.spilled += 1
        self.committed_bytes -= block.size
        self.num_committed -= 1
        self.namespaces.removed(block.key, block.size)
        if self.quotas is not None:
            self.quotas.removed(block.key, block.size)
        if self.events is not None:
            self.events.removed(block)
        if block.num_pins == 0:
            self.allocator.free(block.offset)

    # -- space ----------------------------------------------------------------------------

    def _allocate_batch(self, keys: list[bytes], sizes: list[int]) -> list[int | None]:
        """One contiguous extent for the whole batch if there is one, else block by block."""
        if not sizes:
            return []
        if len(sizes) > 1:
            extent = self.allocator.allocate(sum(pages(s) * 4096 for s in sizes))
            if extent is not None:
                return list(self.allocator.carve(extent, sizes))
        return [self._allocate(key, size) for key, size in zip(keys, sizes, strict=True)]

    def _allocate(self, key: bytes, num_bytes: int) -> int | None:
        offset = self.allocator.allocate(num_bytes)
        if offset is not None:
            return offset
        quotas = self.quotas
        for victim in self.eviction.victims():
            block = self._index.get(victim)
            if block is None or not block.is_evictable:
                continue
            if quotas is not None and not quotas.may_evict(victim, key):
                continue  # another tenant's block, within its share
            self._remove(block, evicted=True)
            offset = self.allocator.allocate(num_bytes)
            if offset is not None:
                return offset
        return None

    def _fit_quota(self, key: bytes, size: int) -> bool:
        """Whether ``size`` more bytes fit the key's tenant's quota, after evicting that
        tenant's own least recently used blocks if need be."""
        if self.quotas is None or not self.quotas.room(key, size):
            return True
        for victim in self.eviction.victims():
            block = self._index.get(victim)
            if block is None or not block.is_evictable or not self.quotas.same_tenant(victim, key):
                continue
            self._remove(block, evicted=True)
            if not self.quotas.room(key, size):
                return True
        return False

    def _evict_past_high_watermark(self) -> None:
        if self.allocator.used <= self.high_watermark * self.capacity:
            return
        target = self.low_watermark * self.capacity
        for key in self.eviction.victims():
            if self.allocator.used <= target:
                break
            block = self._index.get(key)
            if block is None or not block.is_evictable:
                continue
            if self.quotas is None or self.quotas.may_evict(key, None):
                self._remove(block, evicted=True)

    # -- leases and owners ----------------------------------------------------------------

    def expire(self) -> int:
        """Abort expired reservations and drop expired pins; returns how many."""
        now = self.clock()
        expired_reservations = [r for r in self._reservations.values() if r.deadline <= now]
        for reservation in expired_reservations:
            self.abort(reservation.reservation_id, reservation.owner)
        expired_pins = [p for p in self._pins.values() if p.deadline <= now]
        for pin in expired_pins:
            self.unpin(pin.pin_id)
        self.counters.expired_reservations += len(expired_reservations)
        self.counters.expired_pins += len(expired_pins)
        return len(expired_reservations) + len(expired_pins)

    def release_owner(self, owner: int) -> None:
        """A client went away: abort its reservations and drop its pins."""
        for reservation_id in list(self._owner_to_reservation_ids.get(owner, ())):
            self.abort(reservation_id, owner)
        for pin_id in list(self._owner_to_pin_ids.get(owner, ())):
            self.unpin(pin_id)

    # -- introspection --------------------------------------------------------------------

    def describe(self, namespace_id: bytes, label: str, *, journal: bool = True) -> None:
        if self.namespaces.label(namespace_id, label) and journal:
            self.journal.labelled(namespace_id, label)

    def _entries_oldest_first(self) -> Iterator[Entry]:
        ordered = [k for k in self.eviction.victims() if k in self._committed]
        unordered = self._committed.keys() - set(ordered)  # what the policy does not order
        for block in (self._committed[k] for k in [*ordered, *unordered]):
            yield Entry(block.key, block.offset, block.size, block.checksum)

    @property
    def num_pinned(self) -> int:
        return sum(len(p.blocks) for p in self._pins.values())

    @property
    def used_bytes(self) -> int:
        return self.allocator.used

    def __len__(self) -> int:
        return self.num_committed

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def _forget_id(ids_by_owner: dict[int, set[int]], owner: int, id_: int) -> None:
    ids = ids_by_owner.get(owner)
    if ids is not None:
        ids.discard(id_)
        if not ids:
            del ids_by_owner[owner]
