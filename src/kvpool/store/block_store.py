"""The block store: index, two-phase writes, pins under leases, and eviction.

The store is synchronous and touched from one thread (the daemon's event loop).  It manages
offsets into the arena; it never touches the bytes.  A request's blocks are handled together,
as columns (:class:`~kvpool.store.index.KeyColumns`, offsets, sizes, checksums): its
lookups, its commit and its pins update each table and list once, so that what a node spends
per block of a long prompt is not a Python statement per block per structure.  Committed
blocks are rows of its index (:mod:`kvpool.store.index`: columns by slot, no Python object
per block), so that what it holds costs ~150 bytes of heap per block and no request waits
for the index to grow.  Its only I/O is the journal (:mod:`kvpool.store.journal`, small
appends to a file on tmpfs) that lets a restarted daemon adopt the blocks of a surviving
arena.

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
   allocation fails, and down to the low watermark once usage passes the high watermark
   (at a client's commit: a promotion's leaves it to the next, so that the read it serves
   finds what it brought up).
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
    named, in order, with the statuses ``reserve`` would give, and frees a refused key's;
    ``commit_placed``, for blocks their writer hashed as it copied them in, publishes them
    at once with those checksums (never pending).
15. Reservations, pins, write areas and prefetch holds are leases of one ledger: its
    ``expire`` (:meth:`BlockStore.expire`) ends each kind the way it ends, and a
    disconnecting owner's leases of every kind end together (:meth:`release_owner`).
16. Every call that appends to the journal advances its compaction (rule 6 of the journal),
    and counts what it appended to the account of the keys' tenant
    (:mod:`kvpool.store.accounts`); a label is printable text, and a tenant's label changes
    are rate-limited there (``QuotaExceeded`` past the rate).
17. ``on_change`` hears the keys whose presence a waiting lookup may wait for: blocks
    committed, and reservations that ended without a commit (never a rescan of all).
18. The clients' reads (pins, directory reads) and writes (commits) are the accesses
    :class:`~kvpool.store.reuse.ReuseSampler` samples; the node's own (promotions, the
    pins of its write-through) are not.
19. A store that is leaving (a drain handing its blocks to other nodes: :meth:`leave`)
    admits no new block of a client's: every key of a reserve or a placement is REFUSED (a
    value: the writer's block is simply not kept here) and no write area is granted; the
    node's own reservations (promotions, ``held``) go on.  ``leave(False)`` takes writes
    again (a drain that could not place everything).
20. ``retain`` gives committed blocks a retention priority (:mod:`kvpool.store.retention`):
    lower priorities are evicted first, a duration reverts a block to the default, and
    what a tenant holds above the default is its ``RETAINED_BYTES`` account (the node's
    own at most ``MAX_NODE_RETAINED_SHARE`` of the arena); a block past it is refused and
    counted, and keeps its priority.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvpool.config import PAGE_BYTES, page_bytes, pages_of
from kvpool.directory import DirectoryWriter, NoDirectory
from kvpool.errors import STATUS_OF_CODE, BadRequest, LeaseExpired, QuotaExceeded, Status
from kvpool.keys import MIN_COLUMN_KEYS, NAMESPACE_ID_BYTES, BlockOrigin
from kvpool.limits import LeaseLimits
from kvpool.stats import ESTIMATE_SCALES
from kvpool.store.accounts import Accounts, Resource
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
from kvpool.store.index import (
    KEY_WIDTH,
    LISTED,
    LIVE,
    MIN_PROBE_KEYS,
    SEALED,
    BlockIndex,
    KeyColumns,
    counted_prefixes,
    groups_by_prefix,
)
from kvpool.store.journal import Entry, Journal, NoJournal
from kvpool.store.leases import LeaseBook, LeaseKind, LeaseLedger, Owner
from kvpool.store.namespaces import NamespaceTable, is_label
from kvpool.store.quotas import Quotas
from kvpool.store.retention import Retention
from kvpool.store.reuse import ReuseSampler
from kvpool.store.space import Space
from kvpool.tenants import TAG_BYTES

Clock = Callable[[], float]
# Slots the scrubber's walk over the index looks at per step, at most.
WALK_STEP = 4096
# What retention hints of no tenant's may hold above the default priority, of the arena.
MAX_NODE_RETAINED_SHARE = 0.5
Origins = Sequence[BlockOrigin | None] | None  # per block: what it was computed from
Checksums = Sequence[int | None]  # per block (None: drop it)
OnChange = Callable[[Sequence[bytes]], None]  # the keys whose presence changed


@dataclass(slots=True)
class Admitted:
    """The keys of a write that may be written (their indexes in the request), and their
    columns (None where the request's keys were looked up one at a time)."""

    keys: list[int]
    columns: KeyColumns | None


def _distinct(slots: np.ndarray) -> np.ndarray:
    """``slots`` without repeats, in the order each first appears (a read that names a
    block twice pins it and counts it once)."""
    if len(slots) < MIN_COLUMN_KEYS:
        listed = slots.tolist()
        return slots if len(set(listed)) == len(listed) else np.array(list(dict.fromkeys(listed)))
    _, first = np.unique(slots, return_index=True)
    return slots if len(first) == len(slots) else slots[np.sort(first)]


@dataclass
class Retained:
    """What a ``retain`` did, in blocks."""

    num_retained: int = 0
    num_refused: int = 0  # past the account (rule 20)
    num_missing: int = 0  # not committed here


class BlockStore:
    """The node's blocks in DRAM: every change of a block's state goes through here.

    Why so many methods (66): the store is the one place a block's state changes (the
    module's rules), so each step of a block's life is a method of it, and each step of
    a request has a columnar form for the hot path beside its one-key form: writes
    (``reserve``, ``reserve_area``, ``place``, ``commit``, ``take``/``publish``, ``abort``,
    ``seal``), reads (``lookup``, ``pin``, ``touch``, ``unpin``, ``get_block``), retention
    (``retain``), removal (``evict``, ``delete``, ``expire``, ``release_owner``,
    ``report_corrupt``), the journal's records and its compaction, and what status reads.
    What each step decides lives in its own module, handed to the constructor: space and
    eviction (:mod:`.space`, :mod:`.eviction`), leases (:mod:`.leases`), quotas
    (:mod:`.quotas`, meters of :mod:`.accounts`), the index (:mod:`.index`), the journal
    (:mod:`.journal`).  Splitting the methods by step would split the rules that hold
    across steps (a pinned block is never evicted; a pending key is never read).
    """

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
        on_change: OnChange | None = None,
        accounts: Accounts | None = None,
        retention: Retention | None = None,
        clock: Clock = time.monotonic,
    ):
        """``ledger``: the node's lease ledger, shared with its prefetch holds (else the
        store keeps one of its own under ``leases``); ``events``: told of every block that
        becomes visible or leaves; ``on_change``: told of the keys a waiting lookup may be
        waiting for (rule 17); ``accounts``: the node's account ledger (rules 16 and 20;
        else one of the store's own, with no tenants); ``retention``: the retention
        priorities inside ``eviction`` (the node wraps them in its prefetch holds' policy;
        else the store wraps ``eviction`` in them itself)."""
        self.allocator = allocator or SegregatedFitAllocator(capacity)
        self.capacity = self.allocator.capacity
        self.accounts = accounts if accounts is not None else Accounts()
        if retention is None:
            retention = Retention(eviction if eviction is not None else LRUPolicy())
            eviction = retention
        self.retention = retention
        retention.accounts = self.accounts
        retention.max_node_bytes = int(self.capacity * MAX_NODE_RETAINED_SHARE)
        self.eviction = eviction if eviction is not None else retention
        # The node's one lease ledger (shared with the prefetch holds, when the node passes
        # it), else one of the store's own under ``leases``.
        self.ledger = ledger if ledger is not None else LeaseLedger(leases, clock)
        self.limits = self.ledger.limits
        self.clock = self.ledger.clock
        self.counters = StoreCounters()
        self.is_leaving = False  # rule 19
        self.namespaces = NamespaceTable()
        self.on_change = on_change
        # The index: committed blocks (millions: rows of columns), and pending ones
        # (reserved, not committed yet: few, objects); a key is in one of them at most.
        self.index = BlockIndex(self.capacity // PAGE_BYTES)
        self.eviction.bind(self.index.max_blocks, self.index.key)
        self._pending: dict[bytes, Block] = {}
        # What committed blocks were computed from, for those whose writers said (events).
        self._origins: dict[bytes, BlockOrigin] = {}
        self._reservations: LeaseBook[Reservation] = self.ledger.open_book(
            LeaseKind.RESERVATION, self._end_reservation
        )
        self._pins: LeaseBook[Pin] = self.ledger.open_book(LeaseKind.PIN, self._end_pin)
        self.reserved_bytes = 0
        self.committed_bytes = 0
        self.journal = journal or NoJournal()
        self.directory = directory if directory is not None else NoDirectory()
        self.spill = spill
        # The tenants' arena quotas: the ledger's ARENA_BYTES (kvpool.store.quotas), while
        # some tenant has one.
        self._arena_quotas = Quotas(self.accounts, Resource.ARENA_BYTES)
        self.quotas: Quotas | None = None
        self.areas = WriteAreas(self.allocator, self.ledger)
        self.space = Space(self.allocator, self.eviction, self, high_watermark, low_watermark)
        # The clients' accesses, sampled: what more or less memory would buy (rule 18).
        self.reuse = ReuseSampler()
        self.reuse.cover(ESTIMATE_SCALES[-1] * self.index.max_blocks)
        # Told of changes only after adopting: adopted blocks were announced when stored.
        self.events: StoreEvents | None = None
        self._adopt()
        self.events = events

    def recount_quotas(self) -> None:
        """Count each tenant's arena bytes again, from what is held now: the ledger's
        tenants changed (:meth:`Accounts.set_tenants`: a reload); none has a quota: no
        tenants here."""
        if not self.accounts.metered(Resource.ARENA_BYTES).limits:
            self.quotas = None
        else:
            self.quotas = self._arena_quotas
            # The committed blocks, by tag in bulk (a reload; requests never do this).
            slots = self.index.live_slots()
            costs = self.index.sizes[slots]
            costs = np.maximum(1, -(-costs // PAGE_BYTES)) * PAGE_BYTES  # page_bytes
            committed = counted_prefixes(self.index, slots, TAG_BYTES, costs)
            self.quotas.recount(
                ((b.key, b.size) for b in self._pending.values()),
                {tag: num_bytes for tag, (_, num_bytes) in committed.items()},
            )
        self.space.quotas = self.quotas
        # One LRU list per tenant (a reload visits every block once; requests never do).
        self.eviction.regroup(None if self.quotas is None else self._group_of_slot)

    def _group_of_slot(self, slot: int) -> object:
        assert self.quotas is not None
        return self.quotas.group_of(self.index.key(slot))

    def _adopt(self) -> None:
        """Take over the blocks a replayed journal describes (a warm restart)."""
        # In bulk, with no statement per block: a restart adopts millions.  Adopted blocks
        # are not sealed (nothing to list in the directory) and were announced when stored.
        replayed = self.journal.replayed
        sizes = replayed.sizes
        # Hashed (see seal_replayed), small enough for this arena, keys the index can hold
        # (a journal's record may name up to 255 bytes: a damaged one).
        if replayed.key_rows is not None:
            fits = replayed.key_rows.shape[1] <= KEY_WIDTH
        else:
            fits = np.fromiter(map(len, replayed.keys), np.int64, len(replayed.keys)) <= KEY_WIDTH
        wanted = np.flatnonzero(replayed.hashed & (sizes >= 0) & (sizes <= self.capacity) & fits)
        extents = np.stack([replayed.offsets[wanted], sizes[wanted]], axis=1)
        taken = self.allocator.adopt(extents)
        adopted, refused = wanted[taken], wanted[~taken]
        keys = replayed.keys
        if len(refused):
            self.journal.removed([keys[i] for i in refused.tolist()])
        if len(adopted) < len(keys):
            keys = [keys[i] for i in adopted.tolist()]
        sizes, rows = sizes[adopted], replayed.key_rows
        if rows is not None and len(adopted) < len(rows):
            rows = rows[adopted]
        slots = self.index.adopt(
            keys, replayed.offsets[adopted], sizes, replayed.checksums[adopted], rows
        )
        self.committed_bytes += int(sizes.sum())
        self.eviction.adopt(slots)
        self.namespaces.adopted(
            counted_prefixes(self.index, slots, NAMESPACE_ID_BYTES, sizes).items()
        )
        for namespace_id, label in replayed.labels.items():
            if is_label(label):  # an older daemon's journal may hold one that is not
                self.describe(namespace_id, label, journal=False)
        self.counters.adopted = len(slots)
        self.counters.puts = 0
        self.namespaces.reset_puts()
        self.journal.forget_replay()  # its columns and keys: ~100 bytes a block, not needed now

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
        if self.is_leaving and not held:
            return ReserveResult(0, [Status.REFUSED] * len(keys), [None] * len(keys))
        statuses, admitted = self._admit(keys, sizes)
        wanted = admitted.keys
        evictions = self.counters.evictions
        offsets = self.space.allocate_batch([keys[i] for i in wanted], [sizes[i] for i in wanted])
        blocks = self._add_pending(keys, sizes, statuses, wanted, offsets)
        if self.counters.evictions != evictions:
            self._compact_journal()  # its evictions appended
        if held:
            granted = deadline = LeaseLedger.no_deadline()
        else:
            granted, deadline = self.ledger.deadline(LeaseKind.RESERVATION, lease_s)
        if all(b is None for b in blocks):
            return ReserveResult(0, statuses, blocks, granted)
        reservation_id = self.ledger.new_id()
        self._reservations.add(reservation_id, Reservation(reservation_id, owner, blocks, deadline))
        return ReserveResult(reservation_id, statuses, blocks, granted)

    def would_evict(self, keys: Sequence[bytes], sizes: Sequence[int]) -> bool:
        """Whether writing blocks of ``sizes`` (for ``keys``: one tenant's, as a request's
        are; none for a write area) may evict: the arena would pass its high watermark, or
        the keys' tenant its quota.  O(blocks named)."""
        num_bytes = sum(page_bytes(size) for size in sizes)
        if self.allocator.used + num_bytes > self.space.high_watermark * self.capacity:
            return True
        return self.quotas is not None and bool(keys) and self.quotas.room(keys[0], num_bytes) > 0

    def reserve_area(self, num_bytes: int, owner: int, lease_s: float = 0.0) -> Area | None:
        """A write area for ``owner`` (rule 14: see :mod:`kvpool.store.areas`); none while
        the store is leaving (rule 19)."""
        if self.is_leaving:
            return None
        return self.areas.grant(num_bytes, owner, lease_s)

    def leave(self, is_leaving: bool = True) -> None:
        """Stop admitting clients' new blocks (rule 19), or admit them again."""
        self.is_leaving = is_leaving

    def place(
        self, area_id: int, keys: Sequence[bytes], sizes: Sequence[int], owner: int, keep: bool
    ) -> ReserveResult:
        """The blocks of ``keys`` that the owner wrote one after another at the front of its
        write area, as pending blocks with no lease (as :meth:`take` leaves them); the
        place of a refused key is freed.  ``keep``: see :meth:`WriteAreas.take_front`."""
        statuses, wanted, places = self._take_places(area_id, keys, sizes, owner, keep)
        blocks = self._add_pending(keys, sizes, statuses, wanted.keys, places)
        return ReserveResult(0, statuses, blocks)

    def commit_placed(
        self,
        area_id: int,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        owner: int,
        keep: bool,
        checksums: Sequence[int],
        origins: Origins = None,
    ) -> CommitResult:
        """:meth:`place` and :meth:`publish` at once, for blocks whose writer hashed them as
        it copied them in (``checksums``, over the bytes in the arena: a same-host writer,
        which maps the arena writable, is trusted with its checksums as with its bytes):
        they are never pending, and become rows of the index as the columns they came in."""
        if len(checksums) != len(keys) or (origins is not None and len(origins) != len(keys)):
            raise BadRequest(f"{len(keys)} keys, {len(checksums)} checksums")
        statuses, wanted, places = self._take_places(area_id, keys, sizes, owner, keep)
        chosen = wanted.keys
        if chosen:
            size_of = np.asarray(sizes, dtype=np.int64)[chosen]
            checksum_of = np.asarray(checksums, dtype=np.uint64)[chosen]
            offsets = np.array(places, dtype=np.int64)
            chosen_origins = [origins[i] for i in chosen] if origins is not None else None
            columns = wanted.columns or KeyColumns([keys[i] for i in chosen])
            slots = self._commit(columns, offsets, size_of, checksum_of, chosen_origins)
            self.reuse.access_many(self.index.hashes[slots].tolist(), hit=False)
        self.space.trim()
        self._compact_journal()
        committed = list(keys) if len(chosen) == len(keys) else [keys[i] for i in chosen]
        self._changed(committed)
        return CommitResult(statuses, committed, int(size_of.sum()) if chosen else 0)

    def _take_places(
        self, area_id: int, keys: Sequence[bytes], sizes: Sequence[int], owner: int, keep: bool
    ) -> tuple[list[Status], Admitted, list[int]]:
        """Carve the front of the owner's write area into the blocks of ``keys`` and admit
        them: per key a status, the keys admitted, and their places (a refused key's place
        is freed)."""
        if len(keys) != len(sizes):
            raise BadRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        places = self.areas.take_front(area_id, owner, sizes, keep=keep)
        if self.is_leaving:
            for place in places:
                self.allocator.free(place)
            return [Status.REFUSED] * len(keys), Admitted([], None), []
        statuses, wanted = self._admit(keys, sizes)
        if len(wanted.keys) == len(keys):  # every key admitted, as a fresh prompt's are
            return statuses, wanted, places
        for i, status in enumerate(statuses):
            if status is not Status.OK:
                self.allocator.free(places[i])
        return statuses, wanted, [places[i] for i in wanted.keys]

    def _admit(self, keys: Sequence[bytes], sizes: Sequence[int]) -> tuple[list[Status], Admitted]:
        """Per key, OK where it may be written, else why not; the OK keys, which count
        against their tenant's quota from here on.  A request's distinct keys
        of one length (an engine's) are looked up together."""
        n = len(keys)
        columns = KeyColumns(keys)
        if n < MIN_COLUMN_KEYS or not self._columnar(columns):
            statuses, chosen = self._admit_each(keys, sizes)
            return statuses, Admitted(chosen, None)
        codes = np.full(n, Status.OK, dtype=np.int8)
        codes[pages_of(np.asarray(sizes, dtype=np.int64)) * PAGE_BYTES > self.capacity] = (
            Status.REFUSED
        )
        codes[self.index.find_many(columns) >= 0] = Status.EXISTS
        if self._pending:
            codes[np.fromiter(map(self._pending.__contains__, keys), bool, n)] = Status.PENDING
        wanted = np.flatnonzero(codes == Status.OK)
        if self.quotas is not None and len(wanted):
            wanted = self._fit_quotas(columns, sizes, wanted, codes)
        statuses = [STATUS_OF_CODE[code] for code in codes.tolist()]
        return statuses, Admitted(wanted.tolist(), columns.take(wanted))

    @staticmethod
    def _columnar(columns: KeyColumns) -> bool:
        """Whether a request's keys can be taken as columns: distinct, of one length that
        the index's key matrix holds."""
        rows = columns.rows
        if rows is None or rows.shape[1] > KEY_WIDTH:
            return False
        return len(set(columns.keys)) == len(rows)

    def _fit_quotas(
        self, columns: KeyColumns, sizes: Sequence[int], wanted: np.ndarray, codes: np.ndarray
    ) -> np.ndarray:
        """Count the wanted keys against their tenants' quotas: a tenant's keys together
        where they fit as they are, else one at a time, each evicting the tenant's own
        blocks as it needs (OVER_QUOTA where that cannot make room); the keys still wanted."""
        quotas, keys = cast(Quotas, self.quotas), columns.keys
        for tag, members in groups_by_prefix(cast(np.ndarray, columns.rows)[wanted], TAG_BYTES):
            tenant_keys = wanted[members].tolist()
            if quotas.add_all(tag, sum(quotas.cost(sizes[i]) for i in tenant_keys)):
                continue
            for i in tenant_keys:
                if self.space.fit_quota(keys[i], sizes[i]):
                    quotas.added(keys[i], sizes[i])
                else:
                    codes[i] = Status.OVER_QUOTA
        return np.flatnonzero(codes == Status.OK)

    def _admit_each(
        self, keys: Sequence[bytes], sizes: Sequence[int]
    ) -> tuple[list[Status], list[int]]:
        """:meth:`_admit`, a key at a time (keys named twice, or of several lengths)."""
        statuses: list[Status] = []
        wanted: list[int] = []
        seen: set[bytes] = set()
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if key in seen:
                statuses.append(Status.PENDING)  # named twice: the first is being written
            elif key in self._pending:
                statuses.append(Status.PENDING)
            elif self.index.find(key) >= 0:
                statuses.append(Status.EXISTS)
            elif page_bytes(size) > self.capacity or len(key) > KEY_WIDTH:
                statuses.append(Status.REFUSED)  # the protocol bounds keys; other paths too
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
        blocks = self.take(reservation_id, owner)
        return self.publish(blocks, checksums, origins, by_client=owner != Owner.PROMOTER)

    def take(self, reservation_id: int, owner: int) -> list[Block | None]:
        """End a reservation's lease; its blocks stay pending until :meth:`publish`."""
        reservation = self._reservations.pop(reservation_id, owner)
        if reservation is None:
            raise LeaseExpired(f"reservation {reservation_id} expired or was aborted")
        return reservation.blocks

    def publish(
        self,
        blocks: Sequence[Block | None],
        checksums: Checksums,
        origins: Origins = None,
        *,
        by_client: bool = True,
    ) -> CommitResult:
        """Make taken blocks visible, with checksums the node computed over their bytes.
        ``by_client`` false: the node's own promotion from a lower tier, which is not an
        access (rule 18) and does not trim (rule 6): the read it serves pins what it
        brought up, and the next write trims."""
        if len(checksums) != len(blocks):
            raise BadRequest(f"{len(checksums)} checksums for a reservation of {len(blocks)}")
        if origins is not None and len(origins) != len(checksums):
            raise BadRequest(f"{len(origins)} origins for {len(checksums)} checksums")
        statuses: list[Status] = []
        committed: list[Block] = []
        pending = self._pending
        for i, (block, checksum) in enumerate(zip(blocks, checksums, strict=True)):
            if block is None:
                statuses.append(Status.NOT_FOUND)
            elif checksum is None:
                self.journal.removed([block.key])  # a FILLED record may name it
                self._count_journal(block.key)
                self._fail(block)
                statuses.append(Status.NOT_FOUND)
            else:
                if pending.get(block.key) is block:
                    del pending[block.key]
                block.state = BlockState.COMMITTED
                block.checksum = checksum
                block.sealed = True
                if origins is not None:
                    block.origin = origins[i]
                committed.append(block)
                statuses.append(Status.OK)
        num_bytes = sum(b.size for b in committed)
        if committed:
            self.reserved_bytes -= num_bytes
            slots = self._commit(
                KeyColumns([b.key for b in committed]),
                np.array([b.offset for b in committed], dtype=np.int64),
                np.array([b.size for b in committed], dtype=np.int64),
                np.array([b.checksum for b in committed], dtype=np.uint64),
                [b.origin for b in committed],
            )
            if by_client:
                self.reuse.access_many(self.index.hashes[slots].tolist(), hit=False)
        if by_client:
            self.space.trim()
        self._compact_journal()
        self._changed([b.key for b in blocks if b is not None])
        return CommitResult(statuses, [b.key for b in committed], num_bytes)

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
        self._changed([b.key for b in reservation.blocks if b is not None])

    def _commit(
        self,
        columns: KeyColumns,
        offsets: np.ndarray,
        sizes: np.ndarray,
        checksums: np.ndarray,
        origins: Sequence[BlockOrigin | None] | None,
    ) -> np.ndarray:
        """New blocks (distinct keys none of which is held, their bytes hashed) become rows
        of the index, together: each table and list is updated once for the request, from
        its columns; their slots."""
        keys = columns.keys
        if origins is not None:
            kept = self._origins
            for key, origin in zip(keys, origins, strict=True):
                if origin is not None:
                    kept[key] = origin
        self.committed_bytes += int(sizes.sum())
        slots = self.index.insert_many(columns, offsets, sizes, checksums, sealed=True)
        self.index.set_listed_many(slots[self.directory.list_many(keys, offsets, sizes)])
        self.eviction.touch_many(slots)
        if origins is not None and self.eviction.follows_prefixes:
            self._link_parents(keys, origins, slots)
        self.namespaces.added_many(columns, sizes)
        self.counters.puts += len(keys)
        if self.events is not None:
            for block in self.index.blocks(slots, origins or [None] * len(keys)):
                self.events.stored(block)
        self._journal_commits(columns, offsets, sizes, checksums)
        return slots

    def _link_parents(
        self, keys: Sequence[bytes], origins: Sequence[BlockOrigin | None], slots: np.ndarray
    ) -> None:
        """Tell the policy which block each extends (its origin's parent hash, in the
        block's namespace), where its writer said and that block is held."""
        children = [i for i, origin in enumerate(origins) if origin is not None and origin.parent]
        if not children:
            return
        parent_keys = [
            keys[i][:NAMESPACE_ID_BYTES] + cast(BlockOrigin, origins[i]).parent for i in children
        ]
        parents = self.index.find_all(parent_keys)
        for i, parent in zip(children, parents.tolist(), strict=True):
            if parent >= 0:
                self.eviction.link(int(slots[i]), parent)

    def _journal_commits(
        self, columns: KeyColumns, offsets: np.ndarray, sizes: np.ndarray, checksums: np.ndarray
    ) -> None:
        """The commits' records (rule 10), counted to their tenants' journal bytes (rule
        16)."""
        rows = columns.rows if len(columns) >= MIN_COLUMN_KEYS else None
        if rows is None:  # a few, or of several lengths
            values = (offsets.tolist(), sizes.tolist(), checksums.tolist())
            entries = zip(columns.keys, *values, strict=True)
            self.journal.committed(Entry(*entry) for entry in entries)
            for key in columns.keys:
                self._count_journal(key)
            return
        self.journal.committed_many(rows, offsets, sizes, checksums)
        record_bytes = self.journal.record_bytes(columns.keys[0])
        if record_bytes:
            for tag, members in groups_by_prefix(rows, TAG_BYTES):
                account = self.accounts.account_of(tag)
                self.accounts.count(account, Resource.JOURNAL_BYTES, record_bytes * len(members))

    def seal(self, block: Block) -> None:
        """The node verified a committed block's bytes itself: see :meth:`seal_slots`."""
        slot = self._slot_of(block)
        if slot >= 0:
            self.seal_slots(np.array([slot], dtype=np.int64))

    def seal_slots(self, slots: np.ndarray) -> None:
        """The node verified these committed blocks' bytes itself (the scrubber): same-host
        readers may copy them without hashing them, through the directory."""
        index = self.index
        slots = slots[(index.flags[slots] & SEALED) == 0]
        if not len(slots):
            return
        index.flags[slots] |= SEALED
        unlisted = slots[(index.flags[slots] & LISTED) == 0]
        keys = [index.key(slot) for slot in unlisted.tolist()]
        listed = self.directory.list_many(keys, index.offsets[unlisted], index.sizes[unlisted])
        index.set_listed_many(unlisted[listed])

    def is_current(self, block: Block) -> bool:
        """Whether a copy of a committed block handed out earlier is still that block:
        committed now, at the same place with the same checksum."""
        return self._slot_of(block) >= 0

    def still_held(
        self, slots: np.ndarray, offsets: np.ndarray, checksums: np.ndarray
    ) -> np.ndarray:
        """Per slot, whether it holds a committed block at ``offsets`` with ``checksums``
        still (what a scrub read of it found: the same bytes at the same place)."""
        index = self.index
        return (
            ((index.flags[slots] & LIVE) != 0)
            & (index.offsets[slots] == offsets)
            & (index.checksums[slots] == checksums)
        )

    def _slot_of(self, block: Block) -> int:
        """The slot of the committed block ``block`` copies, -1 if it left since."""
        index = self.index
        slot = index.find(block.key)
        if slot < 0 or index.offset(slot) != block.offset:
            return -1
        return slot if index.checksum(slot) == block.checksum else -1

    def _fail(self, block: Block) -> None:
        block.state = BlockState.FAILED
        self.reserved_bytes -= block.size
        if self.quotas is not None:
            self.quotas.removed(block.key, block.size)
        if self._pending.get(block.key) is block:
            del self._pending[block.key]
        self.allocator.free(block.offset)

    # -- reads ----------------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[bytes], *, count: bool = True, start: int = 0
    ) -> tuple[int, bool]:
        """The length of the longest committed prefix, and whether the next key is pending
        (``start``: the first ``start`` keys are known to be held: the walk begins after
        them, and counts only what it walks)."""
        if len(keys) - start < MIN_PROBE_KEYS:  # walked, up to the first miss
            find, num_prefix = self.index.find, start
            while num_prefix < len(keys) and find(keys[num_prefix]) >= 0:
                num_prefix += 1
        else:
            missing = np.flatnonzero(self.index.find_all(keys[start:]) < 0)
            num_prefix = start + int(missing[0]) if len(missing) else len(keys)
        pending = num_prefix < len(keys) and keys[num_prefix] in self._pending
        if count:
            self.record_lookup(keys, num_prefix)
        return num_prefix, pending

    def lookup_mask(self, keys: Sequence[bytes], *, count: bool = True) -> list[bool]:
        """Whether each key is committed."""
        present = (self.index.find_all(keys) >= 0).tolist()
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
        self,
        keys: Sequence[bytes],
        owner: int,
        lease_s: float = 0.0,
        *,
        prefix: bool = False,
        count: bool = True,
    ) -> PinResult:
        """Pin the committed blocks among ``keys`` (only the leading run if ``prefix``) for
        at most the policy's pin lease (``lease_s`` 0: exactly that); ``count``: as reads
        (not the node's own guard while it makes room)."""
        if len(keys) < MIN_COLUMN_KEYS:
            found, pinned = self._pin_each(keys, owner, prefix, count)
        else:
            found, pinned = self._pin_many(keys, owner, prefix, count)
        if count:
            num_found = len(keys) - found.count(None)
            self.counters.get_hits += num_found
            self.counters.get_misses += len(keys) - num_found
        granted, deadline = self.ledger.deadline(LeaseKind.PIN, lease_s)
        if not len(pinned):
            return PinResult(0, found, granted)
        pin_id = self.ledger.new_id()
        self._pins.add(pin_id, Pin(pin_id, owner, pinned, deadline))
        return PinResult(pin_id, found, granted)

    def _pin_many(
        self, keys: Sequence[bytes], owner: int, prefix: bool, count: bool
    ) -> tuple[list[Block | None], np.ndarray]:
        """:meth:`pin`'s blocks for many keys, as columns: each key's block (None where
        not pinned), and the distinct slots pinned."""
        index = self.index
        slots = index.find_all(keys)
        if prefix:
            missing = np.flatnonzero(slots < 0)
            if len(missing):
                slots[missing[0] :] = -1
        named = np.flatnonzero(slots >= 0)
        pinned = _distinct(slots[named])
        first = index.add_pins_many(pinned, read=count) == 0
        self.eviction.remove_many(pinned[first])  # out of the LRU while pinned: never visited
        if count and owner > 0:  # a client's read (the node's own pins are not accesses)
            self.reuse.access_many(index.hashes[pinned].tolist(), hit=True)
        found: list[Block | None] = [None] * len(keys)
        for i, block in zip(named.tolist(), self._blocks(slots[named], keys, named), strict=True):
            found[i] = block
        return found, pinned

    def _pin_each(
        self, keys: Sequence[bytes], owner: int, prefix: bool, count: bool
    ) -> tuple[list[Block | None], np.ndarray]:
        """:meth:`_pin_many` for a few keys, one at a time (the columns cost more than they
        save)."""
        index, origins = self.index, self._origins
        found: list[Block | None] = []
        pinned: dict[int, None] = {}  # distinct, in the order each is first named
        missed = False
        for key in keys:
            slot = -1 if missed else index.find(key)
            if slot < 0:
                found.append(None)
                missed = prefix
                continue
            if slot not in pinned:
                pinned[slot] = None
                if not index.add_pin(slot, read=count):
                    self.eviction.remove(slot)
                if count and owner > 0:
                    self.reuse.access(index.hash_of(slot), hit=True)
            found.append(index.block(slot, origins.get(key)))
        return found, np.array(list(pinned), dtype=np.int64)

    def _blocks(self, slots: np.ndarray, keys: Sequence[bytes], named: np.ndarray) -> list[Block]:
        """Copies of the committed blocks of ``slots`` (those of ``keys[named]``), with
        what their writers said they were computed from."""
        origins = self._origins
        if origins:
            return self.index.blocks(slots, [origins.get(keys[i]) for i in named.tolist()])
        return self.index.blocks(slots, [None] * len(slots))

    def retain(self, keys: Sequence[bytes], priority: int, duration_s: float) -> Retained:
        """Give the committed blocks of ``keys`` ``priority`` for ``duration_s`` (0: until
        they leave), leaves first (rule 20); missing keys are skipped."""
        index = self.index
        retention = self.retention
        slots = index.find_all(keys)
        retained = Retained()
        # The last block of a prefix first: it joins its list as the least recent.
        for slot in reversed(slots[slots >= 0].tolist()):
            size = page_bytes(int(index.sizes[slot]))
            is_listed = index.num_pins(slot) == 0
            if retention.set_priority(slot, priority, duration_s, size, is_listed=is_listed):
                retained.num_retained += 1
            else:
                retained.num_refused += 1
        retained.num_missing = len(keys) - retained.num_retained - retained.num_refused
        self.counters.retained += retained.num_retained
        self.counters.retention_refused += retained.num_refused
        return retained

    def touch(self, keys: Sequence[bytes]) -> tuple[list[bytes], int]:
        """Count reads made without a pin (through the directory); the keys found, and
        their bytes."""
        if len(keys) < MIN_COLUMN_KEYS:
            return self._touch_each(keys)
        index = self.index
        slots = index.find_all(keys)
        named = np.flatnonzero(slots >= 0)
        held = _distinct(slots[named])
        index.add_reads_many(held)
        self.reuse.access_many(index.hashes[held].tolist(), hit=True)
        self.eviction.touch_many(held[index.pins[held] == 0])
        self.counters.get_hits += len(named)
        return [keys[i] for i in named.tolist()], int(index.sizes[held].sum())

    def _touch_each(self, keys: Sequence[bytes]) -> tuple[list[bytes], int]:
        """:meth:`touch` of a few keys, one at a time."""
        index = self.index
        found: list[bytes] = []
        seen: set[int] = set()
        num_bytes = 0
        for key in keys:
            slot = index.find(key)
            if slot < 0:
                continue
            found.append(key)
            if slot in seen:  # named twice: counted once
                continue
            seen.add(slot)
            index.add_read(slot)
            self.reuse.access(index.hash_of(slot), hit=True)
            if not index.num_pins(slot):
                self.eviction.touch(slot)
            num_bytes += index.size(slot)
        self.counters.get_hits += len(found)
        return found, num_bytes

    def unpin(self, pin_id: int, owner: int | None = None) -> bool:
        pin = self._pins.pop(pin_id, owner)
        if pin is None:
            return False
        self._end_pin(pin_id, pin)
        return True

    def _end_pin(self, pin_id: int, pin: Pin) -> None:
        """A pin ended (unpinned, expired, its owner gone): a removed block's memory returns
        with its last pin (rule 4)."""
        index = self.index
        if len(pin.slots) < MIN_COLUMN_KEYS:
            for slot in pin.slots.tolist():
                if index.drop_pin(slot):
                    continue
                if index.is_live(slot):
                    self.eviction.touch(slot)
                else:
                    self.allocator.free(index.offset(slot))
                    index.release(slot)
            return
        unpinned = pin.slots[index.drop_pins_many(pin.slots) == 0]
        live = (index.flags[unpinned] & LIVE) != 0
        self.eviction.touch_many(unpinned[live])  # evictable again, as recent as its last read
        for slot in unpinned[~live].tolist():  # removed while pinned: its memory and its slot
            self.allocator.free(index.offset(slot))  # return with its last pin
            index.release(slot)

    def get_block(self, key: bytes) -> Block | None:
        """A copy of the committed block ``key`` names, if any."""
        slot = self.index.find(key)
        return None if slot < 0 else self.index.block(slot, self._origins.get(key))

    def evictable(self, slot: int) -> bool:
        """Whether eviction may take the block of ``slot`` now (for :class:`Space`)."""
        return self.index.is_live(slot) and not self.index.num_pins(slot)

    def evict(self, slot: int) -> None:
        """Remove an evictable block as evicted: offered to the lower tier first (rule 9)."""
        self._remove(slot, evicted=True)

    def committed_blocks(self) -> list[Block]:
        """A copy of every committed block, in slot order (for tests and tools: a pass over
        the whole index)."""
        return [self.index.block(slot) for slot in self.index.live_slots().tolist()]

    # -- removal --------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> list[Status]:
        statuses = []
        for key in keys:
            slot = self.index.find(key)
            if slot < 0:
                statuses.append(Status.PENDING if key in self._pending else Status.NOT_FOUND)
            else:
                self._remove(slot)
                statuses.append(Status.OK)
        if Status.OK in statuses:
            self._compact_journal()
        return statuses

    def report_corrupt(self, keys: Sequence[bytes]) -> list[Status]:
        """A reader found these blocks corrupt: drop them so that they are rewritten."""
        self.counters.corrupt_reports += len(keys)
        return self.delete(keys)

    def _remove(self, slot: int, *, evicted: bool = False) -> None:
        index = self.index
        key, offset, size = index.key(slot), index.offset(slot), index.size(slot)
        if index.is_listed(slot):
            self.directory.withdraw(key)  # before the memory can be handed out again
        index.unlink(slot)
        self.eviction.remove(slot)
        self.eviction.forget(slot)
        self.journal.removed([key])
        self._count_journal(key)
        origin = self._origins.pop(key, None)
        spill = self.spill if evicted else None
        if spill is not None or self.events is not None:
            block = index.block(slot, origin)  # in flight: to a lower tier, to an event
            if spill is not None and spill.offer(block):
                self.counters.spilled += 1
            if self.events is not None:
                self.events.removed(block)
        if evicted:
            self.counters.evictions += 1
        self.committed_bytes -= size
        self.namespaces.removed(key, size)
        if self.quotas is not None:
            self.quotas.removed(key, size)
        if not index.num_pins(slot):
            self.allocator.free(offset)
            index.release(slot)

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

    def describe(
        self, namespace_id: bytes, label: str, *, journal: bool = True, saving: str = ""
    ) -> None:
        """Set a namespace's label (printable text, else :class:`BadRequest`); a change is
        a journal record, which the namespace's tenant may make at its rate (rule 16:
        :class:`QuotaExceeded` past it).  ``journal=False``: one the journal replayed.
        ``saving``: when its engine saves, if it says (no journal record: engines say it
        again)."""
        if self.namespaces.would_change(namespace_id, label):
            self._label(namespace_id, label, journal=journal)
        if saving:  # once the namespace has its row
            self.namespaces.say_saving(namespace_id, saving)

    def _label(self, namespace_id: bytes, label: str, *, journal: bool) -> None:
        account = self.accounts.account_of(namespace_id)
        if journal and not self.accounts.charge(account, Resource.LABEL_CHANGES):
            raise QuotaExceeded(
                f"too many label changes: at most {self.accounts.budgets.label_changes_per_s:g} "
                "a second"
            )
        self.namespaces.label(namespace_id, label)
        if journal:
            self.journal.labelled(namespace_id, label)
            size = self.journal.record_bytes(namespace_id, label)
            self.accounts.count(account, Resource.JOURNAL_BYTES, size)
            self._compact_journal()

    def _count_journal(self, key: bytes) -> None:
        """Count a block record appended for ``key`` to its tenant's journal bytes."""
        size = self.journal.record_bytes(key)
        if size:
            self.accounts.count(self.accounts.account_of(key), Resource.JOURNAL_BYTES, size)

    def _compact_journal(self) -> None:
        """Start a compaction of the journal when it needs one, and advance the one under
        way by a step (a bounded number of records per call that appended: see
        :meth:`Journal.compact_step`)."""
        journal = self.journal
        if not journal.compacting and journal.needs_compaction(len(self.index)):
            journal.start_compaction(self._recency_order(), self.namespaces.labels())
        if journal.compacting and journal.compact_step(self._entry):
            self.accounts.reset(Resource.JOURNAL_BYTES)  # what is appended from here on

    def _recency_order(self) -> np.ndarray:
        """Every live slot, least recently used first (the order a restart's LRU takes up
        from the journal: rule 5 of the journal), to a 65,536th of the span of recency: a
        16-bit key sorts in one radix pass (~50 ms for 2M blocks, on the event loop), where
        an exact sort of the 64-bit stamps takes several times that."""
        slots = self.index.live_slots()
        if not len(slots):
            return slots
        stamps = self.eviction.recency(slots)
        low = int(stamps.min())
        shift = max(0, (int(stamps.max()) - low).bit_length() - 16)
        coarse = ((stamps - np.uint64(low)) >> np.uint64(shift)).astype(np.uint16)
        return slots[np.argsort(coarse, kind="stable")]

    def hottest_first(self) -> np.ndarray:
        """Every live slot, most recently used first (to the precision of the compaction's
        order): what a node leaving the cluster hands over first."""
        return self._recency_order()[::-1]

    def entry(self, slot: int) -> Entry | None:
        """The block a slot holds now (None: none committed there now)."""
        return self._entry(slot)

    def _entry(self, slot: int) -> Entry | None:
        """The journal entry of a slot's committed block (None: not committed now)."""
        index = self.index
        if not index.is_live(slot):
            return None
        return Entry(index.key(slot), index.offset(slot), index.size(slot), index.checksum(slot))

    def metadata_bytes(self) -> int:
        """The memory the index takes now, in O(1) (for status and metrics): its columns
        for the slots in use and its key table, the eviction policy's columns, the sampled
        reuse times (their bound), the allocator's tables, and the origins kept.  Pending
        blocks and leases are few and not counted."""
        return (
            self.index.nbytes()
            + self.eviction.nbytes(self.index.high)
            + self.reuse.nbytes()
            + sys.getsizeof(self.allocator)
            + sys.getsizeof(self._pending)
            + sys.getsizeof(self._origins)
        )

    @property
    def num_committed(self) -> int:
        return len(self.index)

    @property
    def num_pinned(self) -> int:
        return sum(len(p.slots) for p in self._pins.values())

    @property
    def used_bytes(self) -> int:
        return self.allocator.used

    def __len__(self) -> int:
        return len(self.index)

    def _changed(self, keys: Sequence[bytes]) -> None:
        if self.on_change is not None and keys:
            self.on_change(keys)
