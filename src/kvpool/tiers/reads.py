"""A read across the tiers: its promotion, its pin in DRAM, and what is served from below DRAM
when DRAM has no room for the whole read.

One room, one object per read:

- :meth:`Reads.pin` (a PIN: the pin is the client's): the read's promotion
  (:meth:`~kvpool.tiers.promotion.Promotions.on_read`), then :meth:`Reads.pin_promoted`:
  pin what DRAM holds (with ``prefix``, only the leading run of blocks held) and say
  which of the others a lower tier serves (:class:`Below`): those their promotion found
  no room for.  A block still coming up, or that failed to, is a miss for this read, and
  so is every one when the promotion ran out of the read's time (the tier is slow, the
  read's deadline near).
- :meth:`Reads.open` (a GET: the node sends the bytes): the same, then a stage, as one
  :class:`Read`, an async context manager that owns the pin and the stage until it
  exits.  :attr:`Read.leading` are the arena's blocks that go out with the reply's header;
  :meth:`Read.rest` yields the rest in the keys' order as each :class:`Part` is ready:
  runs of arena views as they are, and runs of lower-tier blocks read into the stage,
  verified (a block its tier lost in between goes out as zeros, which the reader's check
  refuses).  The reply announces each block's size and checksum (the tier's index has
  both) before its bytes.

The stages (:class:`Stages`): a read's stage is ``STAGE_BYTES`` (or one block); without
tenants at most ``MAX_STAGED_BYTES`` are staged on the node at once, with tenants each
tenant's reads at most its share of them (its account's ``STAGED_BYTES``: by quota, at
least one stage), so that one tenant's reads never take another's; a read that finds no
stage left is served what DRAM holds.  A stage is held only while its bytes go out: a
stage's :class:`Part` must be sent within ``STAGE_SEND_S`` (its ``send_within_s``), or the
sender closes the connection, and the read gives its stage back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpool.errors import Status
from kvpool.store.accounts import NODE, Accounts, Resource
from kvpool.store.arena import Arena
from kvpool.store.block import Block, PinResult
from kvpool.store.block_store import BlockStore
from kvpool.tiers.lower import LowerTiers
from kvpool.tiers.prefetch import Prefetches
from kvpool.tiers.promotion import Promotions

STAGE_BYTES = 8 << 20  # a read's stage for blocks served from below DRAM (or one block)
MAX_STAGED_BYTES = 128 << 20  # every read's stages together, at most (shared by tenants)
STAGE_SEND_S = 5.0  # a stage's bytes go out within this, or the connection closes


@dataclass(slots=True)
class Below:
    """A block of a read that a lower tier serves (DRAM had no room for it)."""

    index: int  # in the read's keys
    size: int
    checksum: int
    tier_id: int


@dataclass(frozen=True, slots=True)
class Part:
    """Bytes of a read that are ready to send, in the reply's order.  Their views stay valid
    until the next part is asked for (a stage is read into again)."""

    views: list[memoryview]
    # None: arena views, bound by the read's lease; else a stage's, which must go out
    # within this many seconds (or the connection closes and the stage is given back).
    send_within_s: float | None = None


class Stages:
    """The node's staging budget for reads served from below DRAM, charged per tenant to
    its account's ``STAGED_BYTES`` (the node's own reads: ``MAX_STAGED_BYTES`` in all)."""

    def __init__(self, accounts: Accounts) -> None:
        self.accounts = accounts
        self.num_bytes = 0  # staged now, by every read

    def take(self, below: Sequence[Below], keys: Sequence[bytes]) -> bytearray | None:
        """Room to read ``below`` (blocks of ``keys``) through, a stage at a time, charged to
        the keys' tenant (None: no stage is left for it: the read is served what DRAM
        holds).  Give it back with :meth:`give_back`."""
        if not below:
            return None
        largest = max(b.size for b in below)
        num_bytes = max(min(STAGE_BYTES, sum(b.size for b in below)), largest)
        accounts = self.accounts
        account = accounts.account_of(keys[below[0].index])
        # One block larger than the bound still goes when nothing else is staged (for the
        # node, or for the tenant): it came from this node's DRAM, so it is no larger than
        # the arena.
        if account == NODE:
            if self.num_bytes and self.num_bytes + num_bytes > MAX_STAGED_BYTES:
                return None
        elif not accounts.charge(account, Resource.STAGED_BYTES, num_bytes):
            if accounts.used(account, Resource.STAGED_BYTES):
                return None
            accounts.count(account, Resource.STAGED_BYTES, num_bytes)
        self.num_bytes += num_bytes
        return bytearray(num_bytes)

    def give_back(self, stage: bytearray, keys: Sequence[bytes], below: Sequence[Below]) -> None:
        self.num_bytes -= len(stage)
        account = self.accounts.account_of(keys[below[0].index])
        if account != NODE:
            self.accounts.credit(account, Resource.STAGED_BYTES, len(stage))


class Reads:
    """Reads across the tiers: promoted, pinned, and (for a GET) served from below DRAM
    through a stage.  ``lane``: the read threads."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        lower: LowerTiers,
        promotions: Promotions,
        prefetches: Prefetches,
        lane: ThreadPoolExecutor,
    ) -> None:
        self.store = store
        self.arena = arena
        self.lower = lower
        self.promotions = promotions
        self.prefetches = prefetches
        self.lane = lane
        self.stages = Stages(store.accounts)
        self.served = {tier.tier_id: 0 for tier in lower.chain}  # straight into replies

    async def pin(
        self, keys: Sequence[bytes], prefix: bool, owner: int, lease_s: float, wait_s: float
    ) -> tuple[PinResult, list[Below]]:
        """A PIN: promote, then :meth:`pin_promoted`; the pin is ``owner``'s to unpin."""
        in_time = await self.promotions.on_read(keys, prefix, wait_s)
        return self.pin_promoted(keys, prefix, owner, lease_s, in_time=in_time)

    @contextlib.asynccontextmanager
    async def open(
        self, keys: Sequence[bytes], prefix: bool, owner: int, wait_s: float
    ) -> AsyncIterator[Read]:
        """A GET: promote, pin, take a stage for what comes from below; the :class:`Read`,
        whose pin and stage are given back as the context exits."""
        result, below = await self.pin(keys, prefix, owner, 0.0, wait_s)
        read = Read(self, keys, result, below, self.stages.take(below, keys))
        try:
            yield read
        finally:
            read.close()

    def pin_promoted(
        self,
        keys: Sequence[bytes],
        prefix: bool,
        owner: int,
        lease_s: float = 0.0,
        *,
        in_time: bool = True,
    ) -> tuple[PinResult, list[Below]]:
        """Pin what DRAM holds of ``keys`` once their promotion is done (or ran out of
        time: ``in_time`` false), and say which of the others a lower tier serves; the
        blocks pinned count as read for the prefetch holds."""
        below: list[Below] = []
        if not self.lower.chain or not in_time:
            result = self.store.pin(keys, owner, lease_s, prefix=prefix)
        else:
            result, below = self._pin_with_below(keys, prefix, owner, lease_s)
        self.prefetches.note_read([b.key for b in result.blocks if b is not None])
        return result, below

    def _pin_with_below(
        self, keys: Sequence[bytes], prefix: bool, owner: int, lease_s: float
    ) -> tuple[PinResult, list[Below]]:
        store, promotions = self.store, self.promotions
        below: list[Below] = []
        end = len(keys)
        in_dram = store.lookup_mask(keys, count=False)
        for i, (key, held) in enumerate(zip(keys, in_dram, strict=True)):
            if held:
                continue
            found = self.lower.stored(key) if promotions.found_no_room(key) else None
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
        checksums = await loop.run_in_executor(
            self.lane, lambda: self.lower.read(wanted, slots, served)
        )
        for view, block, checksum, tier_id in zip(views, below, checksums, served, strict=True):
            if tier_id is None or checksum != block.checksum:
                view[:] = bytes(len(view))
            else:
                self.served[tier_id] += 1
        return views


class Read:
    """One GET's blocks across the tiers, from its pin to its last byte: what the reply
    announces (:attr:`statuses`, :attr:`sizes`, :attr:`checksums`, :attr:`num_bytes`), and
    its payload, :attr:`leading` then :meth:`rest`.  Built by :meth:`Reads.open`, which
    gives its pin and its stage back."""

    def __init__(
        self,
        reads: Reads,
        keys: Sequence[bytes],
        result: PinResult,
        below: list[Below],
        stage: bytearray | None,
    ) -> None:
        self._reads = reads
        self.keys = keys
        self.pin_id = result.pin_id
        self.lease_s = result.lease_s
        self.blocks: list[Block | None] = result.blocks
        self._found_below = below  # what the stage was taken for (given back by it)
        self.stage = stage
        # No stage: none was free, and DRAM's blocks are all the reply has.
        self.below = below if stage is not None else []
        blocks = self.blocks
        self.sizes = [b.size if b is not None else 0 for b in blocks]
        self.checksums = [b.checksum if b is not None else 0 for b in blocks]
        self.statuses = [int(Status.OK if b is not None else Status.NOT_FOUND) for b in blocks]
        for block in self.below:
            self.sizes[block.index], self.checksums[block.index] = block.size, block.checksum
            self.statuses[block.index] = int(Status.OK)
        self.num_bytes = sum(self.sizes)
        # The arena's blocks before the first from below (all of them, if none is).
        self._num_leading = self.below[0].index if self.below else len(blocks)
        arena = reads.arena
        self.leading = [
            arena.slice(b.offset, b.size) for b in blocks[: self._num_leading] if b is not None
        ]

    async def rest(self) -> AsyncIterator[Part]:
        """The payload after :attr:`leading`, in the keys' order, a :class:`Part` at a
        time: runs of arena views, and runs of lower-tier blocks read into the stage (at
        most its size at a time).  Each part's views stay valid until the next is asked
        for."""
        if not self.below:
            return
        assert self.stage is not None
        stage, arena = self.stage, self._reads.arena
        index_to_below = {b.index: b for b in self.below}
        views: list[memoryview] = []  # arena views not yielded yet
        run: list[Below] = []  # lower-tier blocks not read yet
        run_bytes = 0
        for i in range(self._num_leading, len(self.blocks)):
            block = self.blocks[i]
            lower = index_to_below.get(i)
            if block is not None:
                if run:
                    yield await self._staged(run)
                    run, run_bytes = [], 0
                views.append(arena.slice(block.offset, block.size))
            elif lower is not None:
                if views:
                    yield Part(views)
                    views = []
                if run and run_bytes + lower.size > len(stage):
                    yield await self._staged(run)
                    run, run_bytes = [], 0
                run.append(lower)
                run_bytes += lower.size
        if views:
            yield Part(views)
        if run:
            yield await self._staged(run)

    async def _staged(self, run: Sequence[Below]) -> Part:
        assert self.stage is not None
        views = await self._reads.read_below(self.keys, run, self.stage)
        return Part(views, STAGE_SEND_S)

    def close(self) -> None:
        """Unpin, and give the stage back (once: :meth:`Reads.open` calls it)."""
        if self.pin_id:
            self._reads.store.unpin(self.pin_id)
            self.pin_id = 0
        if self.stage is not None:
            self._reads.stages.give_back(self.stage, self.keys, self._found_below)
            self.stage = None
