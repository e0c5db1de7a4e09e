"""Lookups across the tiers: a block on disk or in the object store counts as present, and
the answer says which tier holds each block of the prefix.

They read in-memory indexes only (the store's, and each lower tier's), on the event loop:
never a request to the object store.  The walk past DRAM asks the lower tiers
``LOOKUP_CHUNK`` keys at a time and stops at the first key held nowhere, so that what it
costs is what it finds.  A block coming up from a lower tier is reserved in DRAM but
nobody writes it (:meth:`~kvpool.tiers.promotion.Promotions.is_promoting`): it counts as
held where it comes from, not as pending.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.stats import TIER_DRAM
from kvpool.store.block_store import BlockStore
from kvpool.tiers.lower import LowerTiers
from kvpool.tiers.promotion import Promotions

# A lookup past DRAM asks the lower tiers this many keys at a time, up to the first miss.
LOOKUP_CHUNK = 256


class Lookups:
    """Which tier holds each block of a prefix, and the hits each tier had."""

    def __init__(self, store: BlockStore, lower: LowerTiers, promotions: Promotions) -> None:
        self.store = store
        self.lower = lower
        self.promotions = promotions
        self.hits = {TIER_DRAM: 0} | {tier.tier_id: 0 for tier in lower.chain}

    def lookup(self, keys: Sequence[bytes], start: int = 0) -> tuple[int, bool, bytes]:
        """The longest prefix held in any tier, whether the key after it is being written,
        and the tier of each block of the prefix from ``start`` on (the first ``start``
        keys are known to be held: a lookup woken for the key it waited on goes on from
        there)."""
        store, promotions = self.store, self.promotions
        num_prefix, pending = store.lookup(keys, count=False, start=start)
        tiers = bytearray([TIER_DRAM]) * (num_prefix - start)
        pending = pending and not promotions.is_promoting(keys[num_prefix])
        if not self.lower.chain or num_prefix == len(keys) or pending:
            return num_prefix, pending, bytes(tiers)
        for at in range(num_prefix, len(keys), LOOKUP_CHUNK):
            chunk = keys[at : at + LOOKUP_CHUNK]
            found = 0
            for in_dram, lower in zip(
                store.lookup_mask(chunk, count=False), self.lower.fastest(chunk), strict=True
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
            pending = store.pending_mask([after])[0] and not promotions.is_promoting(after)
        return num_prefix, pending, bytes(tiers)

    def record(self, keys: Sequence[bytes], num_prefix: int, tiers: bytes) -> None:
        """Count a lookup's answer: the store's hits and misses, each tier's hits."""
        self.store.record_lookup(keys, num_prefix)
        for tier in self.hits:
            self.hits[tier] += tiers.count(tier)

    def presence(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool], bytes]:
        """Per key: held in some tier, being written, and the tier (DRAM if absent)."""
        present = self.store.lookup_mask(keys)
        promotions = self.promotions
        pending = [
            p and not promotions.is_promoting(k)
            for k, p in zip(keys, self.store.pending_mask(keys), strict=True)
        ]
        tiers = bytearray(len(keys))
        if self.lower.chain:
            missing = [i for i, p in enumerate(present) if not p]
            for i, lower in zip(
                missing, self.lower.fastest([keys[i] for i in missing]), strict=True
            ):
                if lower is not None:
                    present[i] = True
                    tiers[i] = lower
        return present, pending, bytes(tiers)
