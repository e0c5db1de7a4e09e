"""The tier chain over a real arena, store and disk tier: one promotion path for reads from
the lower tiers and for prefetches from other nodes; events through the sink the tiers were
built with."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from kvpool.buffers import copy_with_checksum
from kvpool.errors import Status
from kvpool.keys import BlockOrigin
from kvpool.stats import TIER_DISK, TIER_OBJECT, TierStats
from kvpool.store.accounts import Accounts, Resource
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.tiers.chain import MAX_STAGED_BYTES, STAGE_BYTES, STAGE_SEND_S, LowerTiers, Tiers
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.tier import MEDIUM_STORAGE, RemoteSource, Tier
from tests.helpers import key
from tests.tiers.test_disk import blocks as disk_blocks

BLOCK = 64 << 10
SEGMENT = 4 << 20


class Recorder:
    """A KV-event sink that keeps what it is told (the node's is a ZMQ publisher)."""

    def __init__(self) -> None:
        self.stored: list[tuple[bytes, BlockOrigin | None, str]] = []
        self.removed: list[tuple[bytes, str]] = []

    def stored_key(self, key: bytes, origin: BlockOrigin | None, medium: str) -> None:
        self.stored.append((key, origin, medium))

    def removed_keys(self, keys: list[bytes], medium: str) -> None:
        self.removed += [(k, medium) for k in keys]


class MemoryTier:
    """A :class:`Tier` in memory, standing for the object store below the disk."""

    tier_id = TIER_OBJECT
    medium = "OBJECT"
    capacity = 1 << 30
    resource = Resource.OBJECT_BYTES

    def __init__(self, held: list[tuple[bytes, memoryview, int]]) -> None:
        self.blocks = {k: (bytes(data), checksum) for k, data, checksum in held}
        self.num_reads = 0

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.blocks for k in keys]

    def may_hold(self, keys: Sequence[bytes]) -> bool:
        return any(self.contains(keys))

    def size_of(self, key: bytes) -> int | None:
        return len(self.blocks[key][0]) if key in self.blocks else None

    def stored(self, key: bytes) -> tuple[int, int] | None:
        if key not in self.blocks:
            return None
        data, checksum = self.blocks[key]
        return len(data), checksum

    def read_many(self, jobs: Sequence[tuple[bytes, memoryview]]) -> list[int | None]:
        out: list[int | None] = []
        for k, dst in jobs:
            data, checksum = self.blocks.get(k, (b"", None))
            copied = copy_with_checksum(dst[: len(data)], memoryview(data))
            out.append(checksum if data and copied == checksum else None)
            self.num_reads += 1
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def recount_quotas(self, accounts: Accounts) -> None:
        pass  # no tenants' shares here

    def stats(self) -> TierStats:
        return TierStats(name="memory", num_blocks=len(self.blocks))

    def close(self) -> None:
        pass


def in_dram(tiers: Tiers, k: bytes) -> bytes | None:
    block = tiers.store.get_block(k)
    return None if block is None else bytes(tiers.arena.slice(block.offset, block.size))


def chain(tmp_path: Path, disk: DiskTier | None, remote: RemoteSource | None = None) -> Tiers:
    arena = Arena(tmp_path / "arena", 16 << 20)
    lower = LowerTiers([disk], None, disk) if disk is not None else LowerTiers()
    return Tiers(BlockStore(arena.num_bytes), arena, lower, remote=remote)


def larger_than_dram(
    tmp_path: Path, name: str, num_blocks: int = 48, size: int = 1 << 20
) -> tuple[Tiers, list[bytes], list[tuple[bytes, bytes, int]]]:
    """``num_blocks`` blocks of ``size`` on disk behind the 16 MiB arena of :func:`chain`:
    the tiers, the keys in order, and what was written."""
    disk = DiskTier(tmp_path / "disk", 128 << 20, segment_bytes=16 << 20)
    written = disk_blocks(name, num_blocks, size)
    disk.write(written)
    return chain(tmp_path, disk), [k for k, _, _ in written], written


def test_a_read_promotes_verified_blocks_and_a_lost_one_stays_a_miss(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", 32 << 20, segment_bytes=SEGMENT)
    written = disk_blocks("a", 8, BLOCK)
    disk.write(written)
    tiers = chain(tmp_path, disk)
    lost = written[3][0]
    disk.delete([lost])

    async def run() -> None:
        num_prefix, _, where = tiers.lookup([k for k, _, _ in written])
        assert num_prefix == 3 and where == bytes([TIER_DISK]) * 3  # lookups: memory only
        await tiers.promote([k for k, _, _ in written], prefix=False)
        await tiers.stop()

    asyncio.run(run())
    for k, data, _ in written:
        assert in_dram(tiers, k) == (None if k == lost else bytes(data))
    disk_stats = tiers.stats()[1]
    assert disk_stats.name == "disk" and disk_stats.promotions == 7
    assert not tiers.store.reserved_bytes  # every reservation of the promoter was settled


def test_a_block_its_tier_found_corrupt_is_read_from_the_tiers_after_it(
    tmp_path: Path,
) -> None:
    disk = DiskTier(tmp_path / "disk", 32 << 20, segment_bytes=SEGMENT)
    written = disk_blocks("b", 6, BLOCK)
    disk.write(written[:4])
    below = MemoryTier(written[2:])  # holds the last four; the disk the first four
    arena = Arena(tmp_path / "arena", 16 << 20)
    chain: list[Tier] = [disk, below]
    tiers = Tiers(BlockStore(arena.num_bytes), arena, LowerTiers(chain, None, disk))
    keys = [k for k, _, _ in written]
    assert tiers.lookup(keys)[2] == bytes([TIER_DISK] * 4 + [TIER_OBJECT] * 2)
    garbled = disk.location(keys[3])
    assert garbled is not None
    with open(tmp_path / "disk" / f"seg-{garbled.segment_id:08d}.kvs", "r+b") as f:
        f.seek(garbled.offset + 100)
        f.write(b"garbage")

    async def run() -> None:
        await tiers.promote(keys, prefix=True)
        await tiers.stop()

    asyncio.run(run())
    assert all(in_dram(tiers, k) == bytes(data) for k, data, _ in written)
    assert tiers.promotions.promoted == {TIER_DISK: 3, TIER_OBJECT: 3} and below.num_reads == 3
    assert disk.counters.corrupt == 1


def test_a_prefetch_from_other_nodes_comes_up_through_the_same_path(tmp_path: Path) -> None:
    held = {k: bytes(data) for k, data, _ in disk_blocks("r", 4, BLOCK)}
    asked: list[list[bytes]] = []

    async def fetch(keys: list[bytes], max_bytes: int) -> list[bytes | None]:  # another node
        asked.append(keys)
        return [held.get(k) for k in keys]

    tiers = chain(tmp_path, None, RemoteSource(fetch, max_keys=3))
    keys = [*held, key("nowhere")]

    async def run() -> None:
        answer = tiers.prefetch(keys, hold_s=5.0)
        assert answer.num_started == 3  # at most max_keys go to other nodes
        while tiers.prefetches.promoted_remote + len(asked) < 4:
            await asyncio.sleep(0.01)
        await tiers.stop()

    asyncio.run(run())
    assert asked == [keys[:3]]
    assert [in_dram(tiers, k) for k in keys[:3]] == [held[k] for k in keys[:3]]
    assert tiers.prefetches.promoted_remote == 3 and len(tiers.holds) == 3
    assert not tiers.store.reserved_bytes


def test_the_disk_reports_to_the_sink_it_was_built_with(tmp_path: Path) -> None:
    events = Recorder()
    disk = DiskTier(tmp_path, 8 << 20, segment_bytes=SEGMENT, events=events)
    written = disk_blocks("e", 160, BLOCK)  # 10 MiB through 8 MiB of 4 MiB segments
    origin = BlockOrigin(token_ids=[1, 2, 3])
    disk.write(written[:40], {written[0][0]: origin})
    disk.write(written[40:])
    stored = {k: (o, m) for k, o, m in events.stored}
    assert stored[written[0][0]] == (origin, MEDIUM_STORAGE)
    assert stored[written[1][0]] == (None, MEDIUM_STORAGE)
    disk.delete([written[-1][0]])
    assert (written[-1][0], MEDIUM_STORAGE) in events.removed
    evicted = {k for k, _ in events.removed} - {written[-1][0]}
    assert evicted and not any(disk.contains(list(evicted)))
    disk.close()


def test_a_read_larger_than_dram_is_served_from_below_in_bounded_stages(tmp_path: Path) -> None:
    """48 blocks of 1 MiB on disk behind a 16 MiB arena: the promotion brings up what
    fits (and never evicts the read's own blocks), the rest is read from the disk in stages
    of at most STAGE_BYTES, verified, and no read may stage past MAX_STAGED_BYTES while
    another holds its stages."""
    size = 1 << 20
    tiers, keys, written = larger_than_dram(tmp_path, "big", 48, size)

    async def run() -> None:
        assert await tiers.promote(keys, prefix=True)
        reads, stages = tiers.reads, tiers.reads.stages
        result, below = reads.pin_promoted(keys, prefix=True, owner=1)
        in_dram = [i for i, b in enumerate(result.blocks) if b is not None]
        assert 8 <= len(in_dram) <= 16 and len(in_dram) + len(below) == len(keys)
        stage = stages.take(below, keys)
        assert stage is not None and len(stage) == STAGE_BYTES
        run = below[: STAGE_BYTES // size]
        views = await reads.read_below(keys, run, stage)
        for block, view in zip(run, views, strict=True):
            assert bytes(view) == bytes(written[block.index][1])
        others = [stages.take(below, keys) for _ in range(MAX_STAGED_BYTES // STAGE_BYTES)]
        assert others[-1] is None  # the node's bound, counted before anything is allocated
        assert stages.num_bytes <= MAX_STAGED_BYTES
        for taken in [stage, *others]:
            if taken is not None:
                stages.give_back(taken, keys, below)
        assert stages.num_bytes == 0
        tiers.store.unpin(result.pin_id)
        await tiers.stop()

    asyncio.run(run())
    assert tiers.stats()[1].served == STAGE_BYTES // size


def test_overlapping_reads_of_the_same_blocks_are_each_served_them_from_below(tmp_path):
    """Two reads larger than DRAM, of the same blocks: the second's promotion starts (and
    finds no room again) between the first's promotion and its pin.  The first is still
    served every block, from below what DRAM has no room for (before the fix, the second
    promotion took the first's no-room entries: it was served only what DRAM held)."""
    size = 1 << 20
    tiers, keys, _ = larger_than_dram(tmp_path, "overlap", 48, size)

    async def run() -> None:
        assert await tiers.promote(keys, prefix=True)  # the first read's promotion
        second = asyncio.ensure_future(tiers.promote(keys, prefix=True))
        await asyncio.sleep(0)  # the second read's promotion has started
        result, below = tiers.reads.pin_promoted(keys, prefix=True, owner=1)  # the first's
        in_dram = [i for i, b in enumerate(result.blocks) if b is not None]
        assert len(in_dram) + len(below) == len(keys), (len(in_dram), len(below))
        tiers.store.unpin(result.pin_id)
        await second
        result, below = tiers.reads.pin_promoted(keys, prefix=True, owner=2)  # the second's
        assert sum(b is not None for b in result.blocks) + len(below) == len(keys)
        tiers.store.unpin(result.pin_id)
        await tiers.stop()

    asyncio.run(run())


def test_a_read_larger_than_dram_yields_every_block_in_order_and_gives_back_its_stage(
    tmp_path: Path,
) -> None:
    """One GET's :class:`Read` over 48 blocks of 1 MiB behind a 16 MiB arena: what it
    announces is every block's size and checksum; its payload (the leading arena blocks,
    then the parts as they are ready) is every block's bytes, in the keys' order, each
    stage at most STAGE_BYTES and bound by STAGE_SEND_S; once it exits, its pin and its
    stage are given back."""
    size = 1 << 20
    tiers, keys, written = larger_than_dram(tmp_path, "read", 48, size)

    async def run() -> int:
        async with tiers.read(keys, prefix=True, owner=1, wait_s=0.0) as read:
            assert read.below and read.stage is not None
            num_below = len(read.below)
            assert read.statuses == [int(Status.OK)] * len(keys)
            assert read.sizes == [size] * len(keys)
            assert read.checksums == [checksum for _, _, checksum in written]
            payload = [bytes(view) for view in read.leading]
            async for part in read.rest():
                staged = part.send_within_s is not None
                assert part.send_within_s in (None, STAGE_SEND_S)
                assert not staged or sum(len(v) for v in part.views) <= STAGE_BYTES
                payload += [bytes(view) for view in part.views]
            assert sum(map(len, payload)) == read.num_bytes
            assert tiers.store.num_pinned
        assert payload == [bytes(data) for _, data, _ in written]
        assert tiers.reads.stages.num_bytes == 0 and not tiers.store.num_pinned
        await tiers.stop()

        return num_below

    num_below = asyncio.run(run())
    assert tiers.stats()[1].served == num_below


def test_a_tenants_keys_asked_of_other_nodes_are_charged_to_its_account(tmp_path: Path) -> None:
    """The keys a tenant's prefetches ask of other nodes are its account's REMOTE_KEYS: at
    most REMOTE_KEYS_PER_TENANT in flight (the rest refused, and the refusal counted in
    the ledger), another tenant's keys still go, and each is credited back once its fetch
    ends."""
    from kvpool.store.accounts import REMOTE_KEYS_PER_TENANT, Resource
    from kvpool.tenants import Tenant

    alpha = Tenant("alpha", b"salt-alpha-0123456789", 4 << 20)
    beta = Tenant("beta", b"salt-beta-0123456789", 4 << 20)
    answered = asyncio.Event()

    async def fetch(keys: list[bytes], max_bytes: int) -> list[bytes | None]:
        await answered.wait()  # in flight until the test lets them come back
        return [None] * len(keys)

    num = REMOTE_KEYS_PER_TENANT + 10
    tiers = chain(tmp_path, None, RemoteSource(fetch, max_keys=num))
    accounts = tiers.store.accounts
    accounts.set_tenants([alpha, beta], held_bytes=8 << 20, prefetch_bytes=512 << 20)
    alpha_keys = alpha.scope_all([key(f"a{i}") for i in range(num)])
    beta_keys = beta.scope_all([key(f"b{i}") for i in range(4)])

    async def run() -> None:
        first = tiers.prefetch(alpha_keys[:REMOTE_KEYS_PER_TENANT], hold_s=5.0)
        assert first.num_started == REMOTE_KEYS_PER_TENANT
        assert accounts.used(alpha.tag, Resource.REMOTE_KEYS) == REMOTE_KEYS_PER_TENANT
        more = tiers.prefetch(alpha_keys[REMOTE_KEYS_PER_TENANT:], hold_s=5.0)
        assert (more.num_started, more.num_refused) == (0, 10)
        [row] = accounts.usage(alpha.tag)
        assert row.refused.get(Resource.REMOTE_KEYS.value) == 1
        assert tiers.prefetch(beta_keys, hold_s=5.0).num_started == 4  # its own budget
        answered.set()
        while accounts.used(alpha.tag, Resource.REMOTE_KEYS) or accounts.used(
            beta.tag, Resource.REMOTE_KEYS
        ):
            await asyncio.sleep(0.01)
        await tiers.stop()

    asyncio.run(run())


def test_a_tenants_disk_bytes_are_its_account_within_its_share_of_the_disk(tmp_path: Path) -> None:
    """The disk's tenants' shares are the ledger's DISK_BYTES: what a tenant's segments
    take is counted there, found again at a reload, and shown by the ledger's usage."""
    from kvpool.tenants import Tenant

    alpha = Tenant("alpha", b"salt-alpha-0123456789", 4 << 20)
    beta = Tenant("beta", b"salt-beta-0123456789", 12 << 20)

    def alpha_blocks(name: str, n: int) -> list[tuple[bytes, memoryview, int]]:
        return [(alpha.scope(k), data, c) for k, data, c in disk_blocks(name, n, BLOCK)]

    disk = DiskTier(tmp_path / "disk", 32 << 20, segment_bytes=SEGMENT)
    disk.write(alpha_blocks("before", 4))  # before alpha is a tenant: nobody's segment
    tiers = chain(tmp_path, disk)
    accounts = tiers.store.accounts
    accounts.set_tenants([alpha, beta], 8 << 20, 512 << 20, tier_bytes=tiers.capacities())
    tiers.recount_quotas()
    [row] = accounts.usage(alpha.tag)
    assert row.limits["disk_bytes"] == 8 << 20  # a quarter of the disk: 4 of 16 MiB of quotas
    assert row.limits["arena_bytes"] == 4 << 20
    found = row.used["disk_bytes"]
    assert found >= 4 * BLOCK  # the segment its blocks lead, counted again
    disk.write(alpha_blocks("after", 4))  # its own segment from here on
    assert accounts.used(alpha.tag, Resource.DISK_BYTES) >= found + 4 * BLOCK
    [other] = accounts.usage(beta.tag)
    assert other.used["disk_bytes"] == 0 and other.limits["disk_bytes"] == 24 << 20
    asyncio.run(tiers.stop())
