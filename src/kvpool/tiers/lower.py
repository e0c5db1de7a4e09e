"""The tiers below DRAM as one object, fastest first (the disk, then the object store): which
of them holds a key, and reading blocks from them in that order.

- :meth:`LowerTiers.fastest`, :meth:`~LowerTiers.source` and :meth:`~LowerTiers.stored`
  read the tiers' in-memory indexes only: they may come from the event loop.
- :meth:`LowerTiers.read` blocks on I/O: it runs on a worker thread (a promotion's fill,
  :mod:`kvpool.tiers.promotion`, or a stage of a read, :mod:`kvpool.tiers.reads`).  A block
  its tier lost (or found corrupt) since it was asked for is tried in the tiers after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.tiers.disk import DiskTier
from kvpool.tiers.objects import ObjectTier
from kvpool.tiers.tier import Tier
from kvpool.tiers.writeback import WriteBack

# A block wanted from below: ``(key, size, tier_id)``, the tier being the first that holds it.
Wanted = tuple[bytes, int, int]


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

    def fastest(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, the fastest lower tier that holds it (``None``: none does)."""
        found: list[int | None] = [None] * len(keys)
        for tier in self.chain:
            for i, held in enumerate(tier.contains(keys)):
                if held and found[i] is None:
                    found[i] = tier.tier_id
        return found

    def source(self, key: bytes) -> tuple[int, int] | None:
        """The size of the block and the first lower tier that holds it."""
        for tier in self.chain:
            size = tier.size_of(key)
            if size is not None:
                return size, tier.tier_id
        return None

    def stored(self, key: bytes) -> tuple[int, int, int] | None:
        """The size and checksum of the block and the first lower tier that holds it."""
        for tier in self.chain:
            found = tier.stored(key)
            if found is not None:
                return (*found, tier.tier_id)
        return None

    def read(
        self,
        wanted: Sequence[Wanted],
        slots: Sequence[tuple[int, memoryview]],
        served: list[int | None],
    ) -> list[int | None]:
        """Read each slot's block (``wanted[index]``) from its tier into the slot's
        destination, verified; one that tier lost meanwhile is tried in the tiers after it.
        Per slot, its checksum (None: no tier had it intact); notes in ``served`` the tier
        each block came from.  Blocks on I/O: call it on a worker thread."""
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
