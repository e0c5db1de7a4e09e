"""Statistics records that the store keeps and the wire carries (``NodeStats``), and the
names of the tiers a block can live in.  Plain data, below both the store and the protocol.
"""

from __future__ import annotations

import msgspec

# Where a block lives, as lookups report it, fastest first.
TIER_DRAM = 0
TIER_DISK = 1
TIER_OBJECT = 2
TIER_REMOTE = 3  # another node of the cluster
TIER_NAMES = {TIER_DRAM: "dram", TIER_DISK: "disk", TIER_OBJECT: "object", TIER_REMOTE: "remote"}


class _Record(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    pass


class NamespaceStats(_Record):
    namespace_id: str
    label: str = ""
    num_blocks: int = 0
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0


class TierStats(_Record):
    """One tier of a node: what it holds and what moved through it."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0  # blocks lookups found in this tier
    reads: int = 0  # blocks read out of it (for the DRAM tier: pins and sends)
    writes: int = 0  # blocks written into it (for lower tiers: write-backs)
    refused: int = 0  # write-backs its admission policy turned down
    dropped: int = 0  # write-backs dropped because the queue was full
    promotions: int = 0  # blocks copied from it back into DRAM
    evictions: int = 0
    corrupt: int = 0  # blocks found not to match their checksum (never served)
    recovered: int = 0  # blocks found at start (adopted, or re-indexed from disk)
