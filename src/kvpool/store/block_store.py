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
5. Every lease is granted by the store's lease ledger (:mod:`kvpool.store.leases`) under its
   :class:`~kvpool.limits.LeaseLimits`: whatever a caller asks for, a pin, a reservation
   or a write area lasts at most the bound of its kind.
6. Eviction removes least recently used committed, unpinned blocks: on demand when an
   allocation fails, and down to the low watermark once usage passes the high watermark.
7. A put of a key that is committed or pending reports EXISTS or PENDING; nothing is
   overwritten (a key names its content).
8. A reservation the node makes for itself (``held``: a promotion) has no lease.
9. An evicted block is offered to the lower tier (``spill``) before its memory is freed.
10. The journal hears every commit before it is acknowledged and every removal before the
    memory can be handed out again; a store built on a replayed journal adopts its blocks.
11. With tenants, no write evicts a block of a tenant within its quota (``quotas``).
12. The shared directory (:mod:`kvpool.directory`) lists committed, sealed blocks, and
    withdraws each before its memory can be handed out again.
13. ``touch`` counts reads made through the directory: they keep blocks recent, as pins do.
14. A write area is free memory a same-host writer holds under a lease
    (:mod:`kvpool.store.areas`).  ``place`` makes its front the pending blocks of the keys
    named, in order, with the statuses ``reserve`` would give, and frees a refused key's.
15. Reservations, pins, write areas and prefetch holds are leases of one ledger: its
    ``expire`` (:meth:`BlockStore.expire`) ends each kind the way it ends, and a
    disconnecting owner's leases of every kind end together (:meth:`release_owner`).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from itertools import takewhile

from kvpool.config import page_bytes
from kvpool.directory import DirectoryWriter, NoDirectory
from kvpool.errors import BadRequest, LeaseExpired, Status
from kvpool.keys import BlockOrigin
from kvpool.limits import LeaseLimits
from kvpool.store.allocator import Allocator, SegregatedFitAllocator
from kvpool.store.areas import WriteAreas
from kvpool.store.block import (
    Area,
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
from kvpool.store.leases import LeaseBook, LeaseKind, LeaseLedger
from kvpool.store.namespaces import NamespaceTable
from kvpool.store.quotas import Quotas
from kvpool.store.space import Space

Clock = Callable[[], float]
_BLOCK_BYTES = sys.getsizeof(Block(b"", 0, 0))
_INT_BYTES = sys.getsizeof(1 << 62)  # an offset or checksum past the small ints
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
        leases: LeaseLimits | None = None,
        ledger: LeaseLedger | None = None,
        journal: Journal | NoJournal | None = None,
        spill: SpillTarget | None = None,
        directory: DirectoryWriter | NoDirectory | None = None,
        events: StoreEvents | None = None,
        on_change: Callable[[], None] | None = None,
        clock: Clock = time.monotonic,
    ):
        """``ledger``: the node's lease ledger, shared with its prefetch holds (else the
        store keeps one of its own under ``leases``); ``events``: told of every block that
        becomes visible or leaves; ``on_change``: called after any change a waiting lookup
        may be waiting for."""
        self.allocator = allocator or SegregatedFitAllocator(capacity)
        self.capacity = self.allocator.capacity
        self.eviction = eviction or LRUPolicy()
        # The node's one lease ledger (shared with the prefetch holds, when the node passes
        # it), else one of the store's own under ``leases``.
        self.ledger = ledger if ledger is not None else LeaseLedger(leases, clock)
        self.limits = self.ledger.limits
        self.clock = self.ledger.clock
        self.counters = StoreCounters()
        self.namespaces = NamespaceTable()
        self.on_change = on_change
        # The index: committed blocks, and pending ones (reserved, not committed yet); a
        # key is in one of them at most.  One entry per block: they are millions.
        self._committed: dict[bytes, Block] = {}
        self._pending: dict[bytes, Block] = {}
        self._reservations: LeaseBook[Reservation] = self.ledger.open_book(
            LeaseKind.RESERVATION, self._end_reservation
        )
        self._pins: LeaseBook[Pin] = self.ledger.open_book(LeaseKind.PIN, self._end_pin)
        self.reserved_bytes = 0
        self.committed_bytes = 0
        self._key_bytes = 0  # the heap the keys of committed blocks take (metadata_bytes)
        self.num_committed = 0
        self.journal = journal or NoJournal()
        self.directory = directory if directory is not None else NoDirectory()
        self.spill = spill
        self.quotas: Quotas | None = None  # per-tenant limits (kvpool.store.quotas)
        self.areas = WriteAreas(self.allocator, self.ledger)
        self.space = Space(self.allocator, self.eviction, self, high_watermark, low_watermark)
        # Told of changes only after adopting: adopted blocks were announced when stored.
        self.events: StoreEvents | None = None
        self._adopt()
        self.events = events

    def set_quotas(self, limits: dict[bytes, int] | None) -> None:
        """Per-tenant limits, by tag (None: no tenants); counts what is held now."""
        if limits is None:
            self.quotas = None
        else:
            self.quotas = Quotas()
            held = itertools.chain(self._committed.values(), self._pending.values())
            self.quotas.recount(limits, ((b.key, b.size) for b in held))
        self.space.quotas = self.quotas
        # One LRU list per tenant (a reload visits every block once; requests never do).
        self.eviction.regroup(None if self.quotas is None else self.quotas.group_of)

    def _adopt(self) -> None:
        """Take over the blocks a replayed journal describes (a warm restart)."""
        # In bulk, with no call per block: a restart adopts millions.  Adopted blocks are
        # not sealed (nothing to list in the directory) and were announced when stored.
        replayed = self.journal.replayed
        capacity = self.capacity
        entries = [  # hashed (see seal_replayed) and small enough for this arena
            e for e in replayed.entries if e.checksum is not None and e.size <= capacity
        ]
        taken = self.allocator.adopt([(e.offset, e.size) for e in entries])
        committed = BlockState.COMMITTED
        blocks = [
            Block(e.key, e.offset, e.size, committed, e.checksum or 0)
            for e, ok in zip(entries, taken, strict=True)
            if ok
        ]
        dropped = [e.key for e, ok in zip(entries, taken, strict=True) if not ok]
        self._committed.update({b.key: b for b in blocks})
        self.committed_bytes += sum(b.size for b in blocks)
        self._key_bytes += sum(sys.getsizeof(b.key) for b in blocks)
        self.num_committed += len(blocks)
        self.eviction.adopt([b.key for b in blocks])
        self.namespaces.adopted((b.key, b.size) for b in blocks)
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
        statuses, wanted = self._admit(keys, sizes)
        offsets = self.space.allocate_batch([keys[i] for i in wanted], [sizes[i] for i in wanted])
        blocks = self._add_pending(keys, sizes, statuses, wanted, offsets)
        if held:
            granted = deadline = LeaseLedger.no_deadline()
        else:
            granted, deadline = self.ledger.deadline(LeaseKind.RESERVATION, lease_s)
        if all(b is None for b in blocks):
            return ReserveResult(0, statuses, blocks, granted)
        reservation_id = self.ledger.new_id()
        self._reservations.add(reservation_id, Reservation(reservation_id, owner, blocks, deadline))
        return ReserveResult(reservation_id, statuses, blocks, granted)

    def reserve_area(self, num_bytes: int, owner: int, lease_s: float = 0.0) -> Area | None:
        """A write area for ``owner`` (rule 14: see :mod:`kvpool.store.areas`)."""
        return self.areas.grant(num_bytes, owner, lease_s)

    def place(
        self, area_id: int, keys: Sequence[bytes], sizes: Sequence[int], owner: int, keep: bool
    ) -> ReserveResult:
        """The blocks of ``keys`` that the owner wrote one after another at the front of its
        write area, as pending blocks with no lease (as :meth:`take` leaves them); the
        place of a refused key is freed.  ``keep``: see :meth:`WriteAreas.take_front`."""
        if len(keys) != len(sizes):
            raise BadRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        places = self.areas.take_front(area_id, owner, sizes, keep=keep)
        statuses, wanted = self._admit(keys, sizes)
        for i, status in enumerate(statuses):
            if status is not Status.OK:
                self.allocator.free(places[i])
        blocks = self._add_pending(keys, sizes, statuses, wanted, [places[i] for i in wanted])
        return ReserveResult(0, statuses, blocks)

    def _admit(self, keys: Sequence[bytes], sizes: Sequence[int]) -> tuple[list[Status], list[int]]:
        """Per key, OK where it may be written, else why not; the indexes of the OK keys,
        which count against their tenant's quota from here on."""
        statuses: list[Status] = []
        wanted: list[int] = []
        seen: set[bytes] = set()
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if key in seen:
                statuses.append(Status.PENDING)  # named twice: the first is being written
            elif key in self._pending:
                statuses.append(Status.PENDING)
            elif key in self._committed:
                statuses.append(Status.EXISTS)
            elif page_bytes(size) > self.capacity:
                statuses.append(Status.REFUSED)
            elif self.quotas is not None and not self.space.fit_quota(key, size):
                statuses.append(Status.OVER_QUOTA)
            else:
                statuses.append(Status.OK)
                wanted.append(i)
                seen.add(key)
                if self.quotas is not None:
                    self.quotas.added(key, size)
        return statuses, wanted

    def _add_pending(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        statuses: list[Status],
        wanted: list[int],
        offsets: Sequence[int | None],
    ) -> list[Block | None]:
        """Pending blocks of the wanted keys at ``offsets`` (None: NO_SPACE)."""
        blocks: list[Block | None] = [None] * len(keys)
        for i, offset in zip(wanted, offsets, strict=True):
            if offset is None:
                statuses[i] = Status.NO_SPACE
                if self.quotas is not None:
                    self.quotas.removed(keys[i], sizes[i])
                continue
            block = Block(keys[i], offset, sizes[i])
            self._pending[keys[i]] = block
            self.reserved_bytes += block.size
            blocks[i] = block
        return blocks

    def commit(
        self, reservation_id: int, checksums: Checksums, owner: int, origins: Origins = None
    ) -> CommitResult:
        return self.publish(self.take(reservation_id, owner), checksums, origins)

    def take(self, reservation_id: int, owner: int) -> list[Block | None]:
        """End a reservation's lease; its blocks stay pending until :meth:`publish`."""
        reservation = self._reservations.pop(reservation_id, owner)
        if reservation is None:
            raise LeaseExpired(f"reservation {reservation_id} expired or was aborted")
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
                if origins is not None:
                    block.origin = origins[i]
                self._commit(block, checksum)
                result.statuses.append(Status.OK)
                result.committed.append(block)
        self.journal.committed(Entry(b.key, b.offset, b.size, b.checksum) for b in result.committed)
        self.space.trim()
        self._compact_journal()
        self._changed()
        return result

    def abort(self, reservation_id: int, owner: int) -> None:
        reservation = self._reservations.pop(reservation_id, owner)
        if reservation is not None:
            self._end_reservation(reservation_id, reservation)

    def _end_reservation(self, reservation_id: int, reservation: Reservation) -> None:
        """A reservation ended uncommitted (aborted, expired, its owner gone): its memory
        returns (rule 3)."""
        for block in reservation.blocks:
            if block is not None:
                self._fail(block)
        self._changed()

    def _commit(self, block: Block, checksum: int) -> None:
        if self._pending.get(block.key) is block:
            del self._pending[block.key]
        block.state = BlockState.COMMITTED
        block.checksum = checksum
        block.sealed = True
        self.reserved_bytes -= block.size
        self._insert_committed(block)

    def seal(self, block: Block) -> None:
        """The node verified a committed block's bytes itself (the scrubber): same-host
        readers may copy it without hashing it, through the directory."""
        if block.state is BlockState.COMMITTED and not block.sealed:
            block.sealed = True
            self.directory.list(block.key, block.offset, block.size)

    def _insert_committed(self, block: Block) -> None:
        if block.sealed:
            self.directory.list(block.key, block.offset, block.size)
        self._committed[block.key] = block
        self._key_bytes += sys.getsizeof(block.key)
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
        if self._pending.get(block.key) is block:
            del self._pending[block.key]
        self.allocator.free(block.offset)

    # -- reads ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, count: bool = True) -> tuple[int, bool]:
        """The length of the longest committed prefix, and whether the next key is pending."""
        num_prefix = len(list(takewhile(self._committed.__contains__, keys)))
        pending = num_prefix < len(keys) and keys[num_prefix] in self._pending
        if count:
            self.record_lookup(keys, num_prefix)
        return num_prefix, pending

    def lookup_mask(self, keys: Sequence[bytes], *, count: bool = True) -> list[bool]:
        """Whether each key is committed."""
        present = [k in self._committed for k in keys]
        if count:
            num_present = sum(present)
            self.counters.lookup_hits += num_present
            self.counters.lookup_misses += len(keys) - num_present
        return present

    def pending_mask(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is being written (reserved, not committed yet)."""
        pending = self._pending
        return [k in pending for k in keys]

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
            past_a_miss = prefix and len(pinned) < len(found)
            if block is None or past_a_miss:
                found.append(None)
                continue
            if not block.num_pins:
                self.eviction.remove(key)  # out of the LRU while pinned: eviction never visits it
            block.num_pins += 1
            block.num_reads += 1
            found.append(block)
            pinned.append(block)
        self.counters.get_hits += len(pinned)
        self.counters.get_misses += len(keys) - len(pinned)
        granted, deadline = self.ledger.deadline(LeaseKind.PIN, lease_s)
        if not pinned:
            return PinResult(0, found, granted)
        pin_id = self.ledger.new_id()
        self._pins.add(pin_id, Pin(pin_id, owner, pinned, deadline))
        return PinResult(pin_id, found, granted)

    def touch(self, keys: Sequence[bytes]) -> list[Block]:
        """Count reads made without a pin (through the directory); the blocks found."""
        blocks = []
        for key in keys:
            block = self._committed.get(key)
            if block is not None:
                block.num_reads += 1
                if not block.num_pins:
                    self.eviction.touch(key)
                blocks.append(block)
        self.counters.get_hits += len(blocks)
        return blocks

    def unpin(self, pin_id: int, owner: int | None = None) -> bool:
        pin = self._pins.pop(pin_id, owner)
        if pin is None:
            return False
        self._end_pin(pin_id, pin)
        return True

    def _end_pin(self, pin_id: int, pin: Pin) -> None:
        """A pin ended (unpinned, expired, its owner gone): a removed block's memory returns
        with its last pin (rule 4)."""
        for block in pin.blocks:
            block.num_pins -= 1
            if block.num_pins:
                continue
            if block.state is BlockState.REMOVED:
                self.allocator.free(block.offset)
            else:
                self.eviction.touch(block.key)  # evictable again, as recent as its last read

    def get_block(self, key: bytes) -> Block | None:
        return self._committed.get(key)

    def evictable(self, key: bytes) -> Block | None:
        """The block ``key`` names, if eviction may take it now (for :class:`Space`)."""
        block = self._committed.get(key)
        if block is None or not block.is_evictable:
            return None
        return block

    def evict(self, block: Block) -> None:
        """Remove an evictable block as evicted: offered to the lower tier first (rule 9)."""
        self._remove(block, evicted=True)

    def committed_blocks(self) -> list[Block]:
        """Every committed block, oldest commit first."""
        return list(self._committed.values())

    def committed_keys(self) -> list[bytes]:
        """The keys of every committed block, oldest commit first (a list that does not
        keep the blocks themselves alive once they leave)."""
        return list(self._committed)

    # -- removal --------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> list[Status]:
        statuses = []
        for key in keys:
            block = self._committed.get(key)
            if block is None:
                statuses.append(Status.PENDING if key in self._pending else Status.NOT_FOUND)
            else:
                self._remove(block)
                statuses.append(Status.OK)
        return statuses

    def report_corrupt(self, keys: Sequence[bytes]) -> list[Status]:
        """A reader found these blocks corrupt: drop them so that they are rewritten."""
        self.counters.corrupt_reports += len(keys)
        return self.delete(keys)

    def _remove(self, block: Block, *, evicted: bool = False) -> None:
        del self._committed[block.key]
        self._key_bytes -= sys.getsizeof(block.key)
        self.eviction.remove(block.key)
        self.directory.withdraw(block.key)  # both before the memory can be handed out again
        self.journal.removed([block.key])
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

    # -- leases and owners ----------------------------------------------------------------

    def expire(self, now: float | None = None) -> int:
        """End every expired lease of the ledger, of every kind (rule 15): abort expired
        reservations, drop expired pins, write areas and prefetch holds; how many."""
        ledger = self.ledger
        reservations_before = ledger.num_expired[LeaseKind.RESERVATION]
        pins_before = ledger.num_expired[LeaseKind.PIN]
        num_expired = ledger.expire(now)
        self.counters.expired_reservations += (
            ledger.num_expired[LeaseKind.RESERVATION] - reservations_before
        )
        self.counters.expired_pins += ledger.num_expired[LeaseKind.PIN] - pins_before
        return num_expired

    def release_owner(self, owner: int) -> None:
        """A client went away: abort its reservations, drop its pins and its write area."""
        self.ledger.release(owner)

    # -- introspection --------------------------------------------------------------------

    def describe(self, namespace_id: bytes, label: str, *, journal: bool = True) -> None:
        if self.namespaces.label(namespace_id, label) and journal:
            self.journal.labelled(namespace_id, label)

    def _compact_journal(self) -> None:
        """Start a compaction of the journal when it needs one, and advance the one under
        way by a step (a bounded number of records per commit: see :meth:`Journal.compact_step`)."""
        journal = self.journal
        if not journal.compacting and journal.needs_compaction(self.num_committed):
            # Commit order, as the journal itself has it (rule 5 of the journal); a copy of
            # the keys only, a few milliseconds for a million blocks.
            journal.start_compaction(list(self._committed), self.namespaces.labels())
        if journal.compacting:
            journal.compact_step(self._entry)

    def _entry(self, key: bytes) -> Entry | None:
        """The journal entry of a committed block (None: not committed now)."""
        block = self._committed.get(key)
        if block is None:
            return None
        return Entry(block.key, block.offset, block.size, block.checksum)

    def metadata_bytes(self) -> int:
        """The heap the index takes now, estimated in O(1) (for status and metrics): its
        dicts and the LRU as allocated (over-allocation included), the allocator's tables,
        and per committed block its :class:`Block`, its key and its two large ints (offset
        and checksum).  Pending blocks and leases are few and not counted."""
        per_block = _BLOCK_BYTES + 2 * _INT_BYTES
        return (
            sys.getsizeof(self._committed)
            + sys.getsizeof(self._pending)
            + sys.getsizeof(self.eviction)
            + sys.getsizeof(self.allocator)
            + self.num_committed * per_block
            + self._key_bytes
        )

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
