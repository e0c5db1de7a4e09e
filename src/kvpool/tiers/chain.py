"""The node's tier chain: DRAM (the store and its arena), then the lower tiers in order
(:class:`~kvpool.tiers.tier.Tier`: the local disk, then the object store that the whole
cluster shares), with other nodes (:class:`~kvpool.tiers.tier.RemoteSource`) as one more
source that only prefetches ask.

- **Lookups** count a block on disk or in the object store as present; the answer says
  which tier holds each block of the prefix.  They only read in-memory indexes, on the
  event loop: never a request to the object store.
- **Write-back**: DRAM evictions go to disk (:mod:`kvpool.tiers.writeback`), and the disk's
  evicted segments go to the object store (:mod:`kvpool.tiers.objects`).
- **One promotion path** (:meth:`Tiers._promote`): reserve slots under the node's own
  owner (``Owner.PROMOTER``, no lease), fill them on an I/O thread (a lower tier reads and
  verifies; a block its tier lost meanwhile is tried in the tiers after it; other nodes'
  bytes are copied with their checksum), then commit what arrived (or abort on a bug).
  Promotion on read, prefetch from lower tiers and prefetch from other nodes all go
  through it.
- **Promotion on read**: a PIN or GET of a block that is in a lower tier but not in DRAM
  first copies it back, straight into a slot the node reserves for itself, verifies it,
  and commits it; the read then proceeds from DRAM.  Concurrent reads of one block share
  one promotion.  A promotion runs as a task of its own, so a reader that goes away (or
  stops waiting at its deadline) cannot cut it short while its thread still writes into
  the arena; the reader waits at most ``wait_s`` and then finds what has arrived.
- **Reads larger than DRAM** (:meth:`Tiers.pin_for_read`): what a read's promotion could
  not bring up (DRAM had no room for the whole batch) is read from its lower tier straight
  into the reply, a bounded stage at a time (:meth:`Tiers.read_below`): over the
  connection's socket, into the caller's buffers, verified as it arrives.  A reply
  announces each block's size and checksum (the tier's index has both) before its bytes; a
  block its tier lost in between goes out as zeros, which the reader's check refuses.  A
  read's stage is ``STAGE_BYTES`` (or one block); without tenants at most
  ``MAX_STAGED_BYTES`` are staged on the node at once, with tenants each tenant's reads at
  most its share of them (its account's ``STAGED_BYTES``: by quota, at least one stage), so
  one tenant's reads never take another's; a read that finds no stage left is served what
  DRAM holds.  A stage is held only while its bytes go out: a reader that does not take a
  stage's bytes within ``STAGE_SEND_S`` loses its connection and the stage.  What found no
  room in DRAM stays known as such until it comes up: overlapping reads of the same blocks
  are each served them from below.
- **Prefetch**: the same promotion, started ahead of the read for a request that is still
  queued, and below the priority of real reads: it has one I/O thread of its own where
  reads have ``READ_THREADS``, and at most ``PREFETCH_MAX_BYTES`` in flight (the rest is
  refused).  Its blocks are *held* (:mod:`kvpool.store.holds`) until read or until the
  hold lapses.  A prefetch of blocks already in DRAM or already coming up only holds them;
  a cancelled one releases its holds.
- **Prefetch from other nodes** is bounded like the rest, since any tenant may ask for it:
  at most ``RemoteSource.max_keys`` keys of a request go out, at most
  ``REMOTE_KEYS_IN_FLIGHT`` keys are out at once on the node and
  ``REMOTE_KEYS_IN_FLIGHT_PER_TENANT`` per tenant (by the key's tenant tag), and each
  fetch reserves ``REMOTE_FETCH_BYTES`` of ``PREFETCH_MAX_BYTES`` before it starts: the
  other nodes' answers are cut at that from the sizes they announce, before a byte is
  buffered.  What is past a bound is refused (a hint: the read will go elsewhere).

All disk and object-store I/O runs on threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvpool.buffers import copy_with_checksum
from kvpool.errors import Status
from kvpool.protocol.messages import PrefetchResponse
from kvpool.stats import ESTIMATE_SCALES, TIER_DRAM, HitRateEstimate, PrefetchStats, TierStats
from kvpool.store.accounts import NODE, Resource
from kvpool.store.arena import Arena
from kvpool.store.block import PinResult
from kvpool.store.block_store import BlockStore
from kvpool.store.holds import Holds
from kvpool.store.leases import Owner
from kvpool.tenants import TAG_BYTES
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.objects import ObjectTier
from kvpool.tiers.tier import RemoteSource, Tier
from kvpool.tiers.writeback import WriteBack

log = logging.getLogger("kvpool.node")

READ_THREADS = 4
DEFAULT_WAIT_S = 2.0  # a read that names no deadline waits this long for lower tiers
PREFETCH_MAX_BYTES = 512 << 20
REMOTE_KEYS_IN_FLIGHT = 1024
REMOTE_KEYS_IN_FLIGHT_PER_TENANT = 256
REMOTE_FETCH_BYTES = 64 << 20  # the most one fetch from other nodes may buffer
# A lookup past DRAM asks the lower tiers this many keys at a time, up to the first miss.
LOOKUP_CHUNK = 256
MAX_NO_ROOM_KEYS = 1 << 16  # keys remembered as having found no room in DRAM
STAGE_BYTES = 8 << 20  # a read's stage for blocks served from below DRAM (or one block)
MAX_STAGED_BYTES = 128 << 20  # every read's stages together, at most (shared by tenants)
STAGE_SEND_S = 5.0  # a stage's bytes go out within this, or the connection closes

# Fills reserved slots, given as ``(index, destination)``: per slot, its checksum or None.
Fill = Callable[[list[tuple[int, memoryview]]], list[int | None]]
# A promotion under way: it comes to the keys that came up.
Promotion = asyncio.Future[list[bytes]]


@dataclass(slots=True)
class Below:
    """A block of a read that a lower tier serves (DRAM had no room for it)."""

    index: int  # in the read's keys
    size: int
    checksum: int
    tier_id: int


@dataclass
class LowerTiers:
    """The tiers below DRAM, fastest first, and the write-back that feeds the first (the
    disk); built from the node's configuration by
    :func:`kvpool.tiers.build.open_lower_tiers`."""

    chain: list[Tier] = field(default_factory=list)
    writeback: WriteBack | None = None
    disk: DiskTier | None = None

    @property
    def objects(self) -> ObjectTier | None:
        """The object-store tier, if the chain has one."""
        for tier in self.chain:
            if isinstance(tier, ObjectTier):
                return tier
        return None

    def close(self) -> None:
        """Close every tier (a start that failed after they were opened)."""
        for tier in self.chain:
            tier.close()


class Tiers:
    """Lookups, promotions, prefetches and statistics across the node's tiers.  Lifecycle:
    ``start`` (the write-back's thread), then lookups and promotions on the event loop,
    then ``stop`` (waits for promotions, writes back what is queued, closes the tiers)."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        lower: LowerTiers | None = None,
        holds: Holds | None = None,
        remote: RemoteSource | None = None,
    ) -> None:
        self.store = store
        self.arena = arena
        self.lower = lower if lower is not None else LowerTiers()
        self.chain = self.lower.chain
        self.remote = remote  # other nodes of the cluster (prefetch only)
        self.holds = (
            holds
            if holds is not None
            else Holds(arena.num_bytes // 2, store.ledger, store.accounts)
        )
        self.hits = {TIER_DRAM: 0} | {tier.tier_id: 0 for tier in self.chain}
        self.promoted = {tier.tier_id: 0 for tier in self.chain}
        self.served = {tier.tier_id: 0 for tier in self.chain}  # straight into replies
        self.promoted_remote = 0  # blocks a prefetch copied from other nodes
        self.num_late = 0  # reads that stopped waiting for a promotion at their deadline
        self.prefetched = PrefetchStats()
        self._prefetch_bytes = 0  # in flight
        self.staged_bytes = 0  # stages of reads served from below DRAM, now
        self._lost: dict[bytes, int] = {}  # by account: dropped below, not yet reported
        self._dropped_seen = 0
        self._remote_keys = 0  # keys asked of other nodes, in flight
        self._tag_to_remote_keys: dict[bytes, int] = {}  # the same, per tenant tag
        # Promotions under way, by key: each comes to the keys that came up.
        self._promoting: dict[bytes, Promotion] = {}
        # Keys whose latest promotion found no room in DRAM (a read larger than DRAM): the
        # read serves them from below.  Bounded: the oldest are forgotten first.
        self._no_room: OrderedDict[bytes, None] = OrderedDict()
        self._io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-tier-read")
        self._prefetch_io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")

    @property
    def has_lower(self) -> bool:
        return bool(self.chain)

    @property
    def can_prefetch(self) -> bool:
        return self.has_lower or self.remote is not None

    def start(self) -> None:
        if self.lower.writeback is not None:
            self.lower.writeback.start()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._promoting:
            await asyncio.wait(list(set(self._promoting.values())))
        await loop.run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        if self.lower.writeback is not None:
            self.lower.writeback.stop()
        self._io.shutdown(wait=True)
        self._prefetch_io.shutdown(wait=True)
        for tier in self.chain:
            tier.close()

    # -- lookups --------------------------------------------------------------------------

    def _lower_tiers(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, the fastest lower tier that holds it (``None``: none does)."""
        found: list[int | None] = [None] * len(keys)
        for tier in self.chain:
            for i, held in enumerate(tier.contains(keys)):
                if held and found[i] is None:
                    found[i] = tier.tier_id
        return found

    def lookup(self, keys: Sequence[bytes], start: int = 0) -> tuple[int, bool, bytes]:
        """The longest prefix held in any tier, whether the key after it is being written,
        and the tier of each block of the prefix from ``start`` on (the first ``start``
        keys are known to be held: a lookup woken for the key it waited on goes on from
        there).  The walk stops at the first key held nowhere: its cost is what it finds."""
        num_prefix, pending = self.store.lookup(keys, count=False, start=start)
        tiers = bytearray([TIER_DRAM]) * (num_prefix - start)
        # A block coming up from a lower tier is reserved in DRAM, but nobody is writing
        # it: it counts as held where it comes from, not as pending.
        pending = pending and keys[num_prefix] not in self._promoting
        if not self.has_lower or num_prefix == len(keys) or pending:
            return num_prefix, pending, bytes(tiers)
        for at in range(num_prefix, len(keys), LOOKUP_CHUNK):
            chunk = keys[at : at + LOOKUP_CHUNK]
            found = 0
            for in_dram, lower in zip(
                self.store.lookup_mask(chunk, count=False), self._lower_tiers(chunk), strict=True
            ):
                if not in_dram and lower is None:
                    break
                tiers.append(TIER_DRAM if in_dram else lower)  # type: ignore[arg-type]
                found += 1
            if found < len(chunk):
                break
        num_prefix = start + len(tiers)
        if num_prefix < len(keys):
            after = keys[num_prefix]
            pending = self.store.pending_mask([after])[0] and after not in self._promoting
        return num_prefix, pending, bytes(tiers)

    def record_lookup(self, keys: Sequence[bytes], num_prefix: int, tiers: bytes) -> None:
        self.store.record_lookup(keys, num_prefix)
        for tier in self.hits:
            self.hits[tier] += tiers.count(tier)

    def presence(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool], bytes]:
        """Per key: held in some tier, being written, and the tier (DRAM if absent)."""
        present = self.store.lookup_mask(keys)
        pending = [
            p and k not in self._promoting
            for k, p in zip(keys, self.store.pending_mask(keys), strict=True)
        ]
        tiers = bytearray(len(keys))
        if self.has_lower:
            missing = [i for i, p in enumerate(present) if not p]
            for i, lower in zip(
                missing, self._lower_tiers([keys[i] for i in missing]), strict=True
            ):
                if lower is not None:
                    present[i] = True
                    tiers[i] = lower
        return present, pending, bytes(tiers)

    # -- promotion ------------------------------------------------------------------------

    async def promote(self, keys: Sequence[bytes], prefix: bool, wait_s: float = 0.0) -> bool:
        """Bring the blocks among ``keys`` that are in a lower tier but not in DRAM back
        into DRAM (with ``prefix``, only up to the first block held nowhere), waiting at
        most ``wait_s`` (0: ``DEFAULT_WAIT_S``) for them; whether they all came (or found
        no room) in that time."""
        if not self.has_lower:
            return True
        waits, wanted = self._plan(keys, prefix)
        if wanted:
            # The read's own blocks in DRAM stay while its others come up (a read larger
            # than DRAM gets what found no room from below).
            waits.append(self._start(wanted, self._io, keep=keys))
        if not waits:
            return True
        try:
            async with asyncio.timeout(wait_s or DEFAULT_WAIT_S):
                await asyncio.shield(asyncio.gather(*waits, return_exceptions=True))
        except TimeoutError:
            self.num_late += 1  # what is not up yet is a miss for this read
            return False
        return True

    def _plan(
        self, keys: Sequence[bytes], prefix: bool
    ) -> tuple[list[Promotion], list[tuple[bytes, int, int]]]:
        """Promotions to join, and ``(key, size, tier)`` to start."""
        waits: list[Promotion] = []
        wanted: list[tuple[bytes, int, int]] = []
        in_dram = self.store.lookup_mask(keys, count=False)
        if all(in_dram):
            return waits, wanted
        for key, held in zip(keys, in_dram, strict=True):
            if held:
                continue
            if key in self._promoting:
                waits.append(self._promoting[key])
                continue
            source = self._source(key)
            if source is None:
                if prefix:
                    break
                continue
            wanted.append((key, *source))
        return waits, wanted

    def _source(self, key: bytes) -> tuple[int, int] | None:
        """The size of the block and the first lower tier that holds it."""
        for tier in self.chain:
            size = tier.size_of(key)
            if size is not None:
                return size, tier.tier_id
        return None

    def _start(
        self,
        wanted: list[tuple[bytes, int, int]],
        lane: ThreadPoolExecutor,
        keep: Sequence[bytes] = (),
    ) -> Promotion:
        task = asyncio.ensure_future(self._promote_lower(wanted, lane, keep))
        for key, _, _ in wanted:
            self._promoting[key] = task
        return task

    async def _promote_lower(
        self, wanted: list[tuple[bytes, int, int]], lane: ThreadPoolExecutor, keep: Sequence[bytes]
    ) -> list[bytes]:
        """Promote ``(key, size, tier)`` blocks from the lower tiers; the keys that came up."""
        keys = [k for k, _, _ in wanted]
        served: list[int | None] = [None] * len(wanted)  # the tier each block came from
        try:
            checksums = await self._promote(
                keys,
                [size for _, size, _ in wanted],
                lambda slots: self._read(wanted, slots, served),
                lane,
                keep,
            )
        finally:
            for key in keys:
                self._promoting.pop(key, None)
        promoted = []
        for key, tier_id, checksum in zip(keys, served, checksums, strict=True):
            if tier_id is not None and checksum is not None:
                self.promoted[tier_id] += 1
                promoted.append(key)
                self._no_room.pop(key, None)  # found room at last
        return promoted

    async def _promote(
        self,
        keys: list[bytes],
        sizes: list[int],
        fill: Fill,
        lane: ThreadPoolExecutor,
        keep: Sequence[bytes] = (),
    ) -> list[int | None]:
        """The one promotion path: reserve slots for ``keys`` under the node's own owner,
        ``fill`` them on ``lane`` (it verifies, or computes, each checksum), then commit
        what arrived.  Per key, its checksum, or None where it did not come up (already
        stored or pending, no room, or not read).  The blocks of ``keep`` in DRAM stay
        until the commit (and the trim after it) is done: a read larger than DRAM must not
        evict what it is about to read."""
        store = self.store
        guard = store.pin(keep, Owner.PROMOTER, count=False) if keep else None
        try:
            return await self._promote_kept(keys, sizes, fill, lane)
        finally:
            if guard is not None and guard.pin_id:
                store.unpin(guard.pin_id)

    async def _promote_kept(
        self, keys: list[bytes], sizes: list[int], fill: Fill, lane: ThreadPoolExecutor
    ) -> list[int | None]:
        store = self.store
        result = store.reserve(keys, sizes, Owner.PROMOTER, held=True)
        for key, status in zip(keys, result.statuses, strict=True):
            if status in (Status.NO_SPACE, Status.OVER_QUOTA):
                self._no_room[key] = None
        while len(self._no_room) > MAX_NO_ROOM_KEYS:
            self._no_room.popitem(last=False)
        checksums: list[int | None] = [None] * len(keys)
        slots = [
            (i, self.arena.slice(block.offset, block.size))
            for i, block in enumerate(result.blocks)
            if block is not None
        ]
        try:
            if slots:
                loop = asyncio.get_running_loop()
                # Not cancellable: this task outlives the readers that wait on it.
                filled = await loop.run_in_executor(lane, fill, slots)
                for (i, _), checksum in zip(slots, filled, strict=True):
                    checksums[i] = checksum
            if result.reservation_id:
                store.commit(result.reservation_id, checksums, Owner.PROMOTER)
        except Exception:  # a bug must not leave a reservation held for good
            log.exception("promotion of %d blocks failed", len(keys))
            store.abort(result.reservation_id, Owner.PROMOTER)
            return [None] * len(keys)
        return checksums

    def _read(
        self,
        wanted: list[tuple[bytes, int, int]],
        slots: list[tuple[int, memoryview]],
        served: list[int | None],
    ) -> list[int | None]:
        """Read each slot's block from its tier (``wanted[index]``), verified; one that
        tier lost meanwhile is tried in the tiers after it.  Notes in ``served`` the tier
        each block came from."""
        position = {tier.tier_id: n for n, tier in enumerate(self.chain)}
        first = [position[wanted[i][2]] for i, _ in slots]
        checksums: list[int | None] = [None] * len(slots)
        for n, tier in enumerate(self.chain):
            batch = [j for j in range(len(slots)) if first[j] <= n and checksums[j] is None]
            if not batch:
                continue
            jobs = [(wanted[slots[j][0]][0], slots[j][1]) for j in batch]
            for j, checksum in zip(batch, tier.read_many(jobs), strict=True):
                if checksum is not None:
                    checksums[j] = checksum
                    served[slots[j][0]] = tier.tier_id
        return checksums

    # -- reads that DRAM cannot hold --------------------------------------------------------

    def pin_for_read(
        self,
        keys: Sequence[bytes],
        prefix: bool,
        owner: int,
        lease_s: float = 0.0,
        *,
        in_time: bool = True,
    ) -> tuple[PinResult, list[Below]]:
        """Pin what DRAM holds of ``keys`` (with ``prefix``, only the leading run of blocks
        held), and say which of the others a lower tier serves: those their promotion found
        no room for.  A block still coming up, or that failed to, is a miss for this read,
        and so is every one when the promotion ran out of the read's time (``in_time``
        false: the tier is slow, the read's deadline near)."""
        store = self.store
        if not self.has_lower or not in_time:
            return store.pin(keys, owner, lease_s, prefix=prefix), []
        below: list[Below] = []
        end = len(keys)
        in_dram = store.lookup_mask(keys, count=False)
        for i, (key, held) in enumerate(zip(keys, in_dram, strict=True)):
            if held:
                continue
            found = self._stored(key) if key in self._no_room else None
            if found is None:
                if prefix:
                    end = i
                    break
                continue
            below.append(Below(i, *found))
        result = store.pin(keys[:end], owner, lease_s)
        result.blocks += [None] * (len(keys) - end)
        # A block that left DRAM between the lookup and the pin is not served at all.
        return result, [b for b in below if result.blocks[b.index] is None]

    def _stored(self, key: bytes) -> tuple[int, int, int] | None:
        """The size and checksum of the block and the first lower tier that holds it."""
        for tier in self.chain:
            found = tier.stored(key)
            if found is not None:
                return (*found, tier.tier_id)
        return None

    def stage(self, below: Sequence[Below], keys: Sequence[bytes]) -> bytearray | None:
        """Room to read ``below`` (blocks of ``keys``) through, a stage at a time, charged to
        the keys' tenant (None: no stage is left for it: the read is served what DRAM
        holds).  Give it back with :meth:`unstage`."""
        if not below:
            return None
        largest = max(b.size for b in below)
        num_bytes = max(min(STAGE_BYTES, sum(b.size for b in below)), largest)
        accounts = self.store.accounts
        account = accounts.account_of(keys[below[0].index])
        # One block larger than the bound still goes when nothing else is staged (for the
        # node, or for the tenant): it came from this node's DRAM, so it is no larger than
        # the arena.
        if account == NODE:
            if self.staged_bytes and self.staged_bytes + num_bytes > MAX_STAGED_BYTES:
                return None
        elif not accounts.charge(account, Resource.STAGED_BYTES, num_bytes):
            if accounts.used(account, Resource.STAGED_BYTES):
                return None
            accounts.count(account, Resource.STAGED_BYTES, num_bytes)
        self.staged_bytes += num_bytes
        return bytearray(num_bytes)

    def unstage(self, stage: bytearray, keys: Sequence[bytes], below: Sequence[Below]) -> None:
        self.staged_bytes -= len(stage)
        account = self.store.accounts.account_of(keys[below[0].index])
        if account != NODE:
            self.store.accounts.credit(account, Resource.STAGED_BYTES, len(stage))

    async def read_below(
        self, keys: Sequence[bytes], below: Sequence[Below], stage: bytearray
    ) -> list[memoryview]:
        """Read ``below`` (blocks that fit ``stage`` one after another) from their tiers
        into it, verified, on the read threads; each block's bytes (zeros where its tier
        lost it since: the reader's check refuses them)."""
        views: list[memoryview] = []
        offset = 0
        for block in below:
            views.append(memoryview(stage)[offset : offset + block.size])
            offset += block.size
        wanted = [(keys[b.index], b.size, b.tier_id) for b in below]
        slots = list(enumerate(views))
        served: list[int | None] = [None] * len(wanted)
        loop = asyncio.get_running_loop()
        checksums = await loop.run_in_executor(self._io, lambda: self._read(wanted, slots, served))
        for view, block, checksum, tier_id in zip(views, below, checksums, served, strict=True):
            if tier_id is None or checksum != block.checksum:
                view[:] = bytes(len(view))
            else:
                self.served[tier_id] += 1
        return views

    # -- prefetch -------------------------------------------------------------------------

    def prefetch(
        self, keys: Sequence[bytes], hold_s: float, cancel: bool = False
    ) -> PrefetchResponse:
        """Start bringing ``keys`` into DRAM for a queued request, and hold them there.  What
        is brought up counts against the node's bytes in flight and the key's tenant's share
        of them (its account's ``PREFETCH_BYTES``); a hold whose promotion does not come up
        (refused by the tenant's quota, lost, corrupt) is released."""
        answer = PrefetchResponse()
        if cancel:
            self.holds.release(keys)
            return answer
        wanted: list[tuple[bytes, int, int]] = []
        joined: dict[Promotion, list[bytes]] = {}
        elsewhere: list[bytes] = []
        accounts = self.store.accounts
        in_dram = self.store.lookup_mask(keys, count=False)
        for key, held in zip(keys, in_dram, strict=True):
            block = self.store.get_block(key) if held else None
            if block is not None:
                answer.num_in_dram += self.holds.hold(key, block.size, hold_s, fetched=False)
                continue
            source = self._source(key)
            if source is None:
                if self.remote is not None and key not in self._promoting:
                    elsewhere.append(key)
                else:
                    answer.num_absent += 1
                continue
            size = source[0]
            account = accounts.account_of(key)
            if key in self._promoting:
                if self.holds.hold(key, size, hold_s, fetched=True):
                    answer.num_started += 1
                    joined.setdefault(self._promoting[key], []).append(key)
            elif (
                self._prefetch_bytes + size > PREFETCH_MAX_BYTES
                or not accounts.has_room(account, Resource.PREFETCH_BYTES, size)
                or not self.holds.hold(key, size, hold_s, fetched=True)
            ):
                answer.num_refused += 1
            else:
                accounts.charge(account, Resource.PREFETCH_BYTES, size)
                wanted.append((key, *source))
                self._prefetch_bytes += size
        for promotion, joined_keys in joined.items():
            promotion.add_done_callback(functools.partial(self._joined_done, joined_keys))
        if elsewhere:  # other nodes may: asked in the background, within bounds
            asked = self._admit_remote(elsewhere)
            answer.num_refused += len(elsewhere) - len(asked)
            if asked:
                answer.num_started += len(asked)
                self._spawn_remote(asked, hold_s)
        if wanted:
            answer.num_started += len(wanted)
            task = self._start(wanted, self._prefetch_io)
            task.add_done_callback(lambda done: self._prefetch_done(done, wanted))
        stats = self.prefetched
        stats.issued += len(keys)
        stats.in_dram += answer.num_in_dram
        stats.started += answer.num_started
        stats.refused += answer.num_refused
        stats.absent += answer.num_absent
        return answer

    def _admit_remote(self, keys: list[bytes]) -> list[bytes]:
        """The keys that may be asked of other nodes now (see the module's bounds); none
        when no byte budget is left for a fetch, on the node or in the tenant's share (the
        fetch is charged to the first key's tenant: a request names one tenant's keys)."""
        assert self.remote is not None
        if self._prefetch_bytes + REMOTE_FETCH_BYTES > PREFETCH_MAX_BYTES:
            return []
        account = self.store.accounts.account_of(keys[0])
        if not self.store.accounts.has_room(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES):
            return []
        asked: list[bytes] = []
        for key in keys[: self.remote.max_keys]:
            tag = key[:TAG_BYTES]
            num_tenant = self._tag_to_remote_keys.get(tag, 0)
            if self._remote_keys >= REMOTE_KEYS_IN_FLIGHT:
                break
            if num_tenant >= REMOTE_KEYS_IN_FLIGHT_PER_TENANT:
                continue
            self._tag_to_remote_keys[tag] = num_tenant + 1
            self._remote_keys += 1
            asked.append(key)
        return asked

    def _remote_done(self, keys: list[bytes]) -> None:
        for key in keys:
            tag = key[:TAG_BYTES]
            left = self._tag_to_remote_keys[tag] - 1
            if left:
                self._tag_to_remote_keys[tag] = left
            else:
                del self._tag_to_remote_keys[tag]
        self._remote_keys -= len(keys)

    def _spawn_remote(self, keys: list[bytes], hold_s: float) -> None:
        # Reserved until the fetch ends, on the node and in the tenant's share.
        self._prefetch_bytes += REMOTE_FETCH_BYTES
        account = self.store.accounts.account_of(keys[0])
        self.store.accounts.charge(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES)
        task = asyncio.ensure_future(self._prefetch_remote(keys, hold_s, account))
        for key in keys:
            self._promoting[key] = task

    async def _prefetch_remote(
        self, keys: list[bytes], hold_s: float, account: bytes
    ) -> list[bytes]:
        """Copy blocks that other nodes hold into this node's DRAM, and hold them; the keys
        that came up."""
        assert self.remote is not None
        try:
            found = await self.remote.fetch(keys, REMOTE_FETCH_BYTES)
            if not found:
                return []
            values = [memoryview(value) for _, value in found]
            checksums = await self._promote(
                [key for key, _ in found],
                [len(value) for value in values],
                lambda slots: [copy_with_checksum(dst, values[i]) for i, dst in slots],
                self._prefetch_io,
            )
            promoted = [key for (key, _), c in zip(found, checksums, strict=True) if c is not None]
            num = 0
            for (key, value), checksum in zip(found, checksums, strict=True):
                if checksum is not None and self.holds.hold(key, len(value), hold_s, fetched=True):
                    num += 1
            self.prefetched.completed += num
            self.promoted_remote += num
            return promoted
        except Exception:  # a hint: a failure only means the read goes elsewhere
            log.exception("prefetch of %d blocks from other nodes failed", len(keys))
            return []
        finally:
            for key in keys:
                self._promoting.pop(key, None)
            self._remote_done(keys)
            self._prefetch_bytes -= REMOTE_FETCH_BYTES
            self.store.accounts.credit(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES)

    def _prefetch_done(self, task: Promotion, wanted: list[tuple[bytes, int, int]]) -> None:
        """A prefetch's promotion ended: its bytes in flight come back, and the holds of
        the blocks that did not come up are released."""
        accounts = self.store.accounts
        for key, size, _ in wanted:
            self._prefetch_bytes -= size
            accounts.credit(accounts.account_of(key), Resource.PREFETCH_BYTES, size)
        promoted = self._release_unpromoted(task, [key for key, _, _ in wanted])
        self.prefetched.completed += promoted

    def _joined_done(self, held: list[bytes], task: Promotion) -> None:
        self._release_unpromoted(task, held)

    def _release_unpromoted(self, task: Promotion, held: list[bytes]) -> int:
        """Release the holds of ``held`` that ``task`` did not bring up and that are not in
        DRAM now (a promotion its tenant's quota refused holds nothing for it); how many
        came up."""
        came_up: set[bytes] = set()
        if not task.cancelled() and task.exception() is None:
            came_up = set(task.result())
        missed = [key for key in held if key not in came_up]
        in_dram = self.store.lookup_mask(missed, count=False)
        self.holds.release([key for key, there in zip(missed, in_dram, strict=True) if not there])
        return len(held) - len(missed)

    def note_read(self, keys: Sequence[bytes]) -> None:
        """The blocks of these keys were pinned or sent: the requests that held them ran."""
        if len(self.holds):
            self.holds.read(keys)

    def set_quotas(self, quotas: Mapping[bytes, int] | None) -> None:
        """Tenants' DRAM quotas (by tag; None: no tenants), carried to the lower tiers: each
        gives a tenant the share of its capacity that its quota is of all the quotas."""
        total = sum(quotas.values()) if quotas else 0
        for tier in self.chain:
            if not quotas or total <= 0:
                tier.set_quotas(None)
                continue
            tier.set_quotas({tag: tier.capacity * q // total for tag, q in quotas.items()})

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the keys from the tiers below DRAM, for good (the disk writes tombstones,
        the object store is told: on a thread); how many were there."""
        if not self.chain:
            return 0
        if self.lower.writeback is not None:
            self.lower.writeback.discard(keys)  # on its way to disk: it must not land there
        if not any(tier.may_hold(keys) for tier in self.chain):
            return 0  # held by no lower tier, nor on its way into one: no thread
        loop = asyncio.get_running_loop()
        counts = await loop.run_in_executor(
            self._io, lambda: [tier.delete(keys) for tier in self.chain]
        )
        return sum(counts)

    def take_lost(self, account: bytes) -> int:
        """Blocks of ``account``'s (a tenant's, or the node's) that the object store dropped
        on their way into it since the last call (their disk segment found its upload
        queue full, or failed to upload): they are gone, and the account's next put reply
        says so.  O(1) unless something was dropped."""
        objects = self.lower.objects
        if objects is not None and objects.counters.dropped_blocks != self._dropped_seen:
            self._dropped_seen = objects.counters.dropped_blocks
            accounts = self.store.accounts
            for first_key, num in objects.take_dropped().items():
                owner = accounts.account_of(first_key)
                self._lost[owner] = self._lost.get(owner, 0) + num
        return self._lost.pop(account, 0) if self._lost else 0

    @property
    def num_not_kept(self) -> int:
        """Blocks evicted from DRAM that no lower tier took, since the node started: they
        are gone.  Counted on the event loop only, as the store evicts, so what it grows by
        over a synchronous store call is that call's doing.  A node without lower tiers
        counts none: there, eviction is all the cache does."""
        writeback = self.lower.writeback
        return writeback.num_not_kept if writeback is not None else 0

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        """One entry per tier, DRAM first; each lower tier's own counters, with what only
        the chain sees: its lookup hits, its promotions, the write-back's refusals."""
        store, counters = self.store, self.store.counters
        tiers = [
            TierStats(
                name="dram",
                capacity_bytes=store.capacity,
                used_bytes=store.used_bytes,
                num_blocks=len(store),
                hits=self.hits[TIER_DRAM],
                reads=counters.get_hits,
                writes=counters.puts,
                evictions=counters.evictions,
                corrupt=counters.corrupt_reports,
                recovered=counters.adopted,
            )
        ]
        writeback = self.lower.writeback
        for tier in self.chain:
            stats = tier.stats()
            stats.hits = self.hits[tier.tier_id]
            stats.promotions = self.promoted[tier.tier_id]
            stats.served = self.served[tier.tier_id]
            if writeback is not None and tier is writeback.disk:
                stats.refused = writeback.num_refused
                stats.dropped = writeback.num_dropped
                stats.slowed = writeback.num_waits
            tiers.append(stats)
        self._estimate(tiers)
        return tiers

    def _estimate(self, tiers: list[TierStats]) -> None:
        """Each tier's :class:`HitRateEstimate`: the hit rate with the tier at each of
        ESTIMATE_SCALES times its capacity and the tiers above it as they are, read off the
        store's sampled curve, anchored at the hit rate the node really had with all its
        tiers (nothing while a tier holds nothing to say how large its blocks are)."""
        reuse = self.store.reuse
        if not all(stats.num_blocks for stats in tiers):
            return
        # In blocks of the room each tier's blocks take on average; the reads the node
        # served came from all of them together.
        sizes = [s.capacity_bytes * s.num_blocks / max(s.used_bytes, 1) for s in tiers]
        above = 0.0  # blocks the faster tiers hold at capacity
        for stats, blocks in zip(tiers, sizes, strict=True):
            capacities = [above + scale * blocks for scale in ESTIMATE_SCALES]
            reuse.cover(capacities[-1])
            rates = reuse.hit_rates(capacities, anchor=sum(sizes))
            stats.estimates = [
                HitRateEstimate(scale=scale, hit_rate=round(rate, 4))
                for scale, rate in zip(ESTIMATE_SCALES, rates, strict=True)
                if rate is not None
            ]
            above += blocks

    def prefetch_stats(self) -> PrefetchStats:
        stats = self.prefetched
        holds = self.holds
        stats.useful = holds.counters.useful
        stats.wasted = holds.counters.wasted
        stats.held_blocks = len(holds)
        stats.held_bytes = holds.held_bytes
        return stats
