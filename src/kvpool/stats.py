"""Statistics records that the store keeps and the wire carries (``NodeStats``), and the
names of the tiers a block can live in.  Plain data, below both the store and the protocol.
"""

from __future__ import annotations

from typing import Annotated

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
    # When its engine saves (kvpool.integrations.vllm.saving), as it last said: "eager",
    # "evicting", or "" (not said).
    saving: str = ""
    num_blocks: int = 0
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0


# The capacities, as multiples of a tier's own, at which a node estimates its hit rate.
ESTIMATE_SCALES = (0.5, 1.0, 2.0, 4.0)


class HitRateEstimate(_Record):
    """The hit rate (blocks found in this tier or a faster one) the node estimates it would
    have had with this tier at ``scale`` times its capacity (the tiers above it as they
    are), from its sampled accesses (:mod:`kvpool.store.reuse`): what an LRU of that size
    would have kept."""

    scale: float
    hit_rate: float


class TierStats(_Record):
    """One tier of a node: what it holds and what moved through it."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0  # blocks lookups found in this tier
    reads: int = 0  # blocks read out of it (for the DRAM tier: pins, sends, directory reads)
    writes: int = 0  # blocks written into it (for lower tiers: write-backs)
    refused: int = 0  # write-backs its admission policy turned down
    dropped: int = 0  # write-backs dropped because the queue was full
    slowed: int = 0  # writes held (backpressure) until the write-back caught up
    promotions: int = 0  # blocks copied from it back into DRAM
    served: int = 0  # blocks read from it straight into a reply (DRAM had no room)
    evictions: int = 0
    corrupt: int = 0  # blocks found not to match their checksum (never served)
    recovered: int = 0  # blocks found at start (adopted, or re-indexed from disk)
    errors: int = 0  # requests to the tier that failed or ran out of time
    # What more or less of this tier would buy, at ESTIMATE_SCALES.
    estimates: Annotated[list[HitRateEstimate], msgspec.Meta(max_length=8)] = []


class FormatStats(_Record):
    """One of a node's persistent formats (:mod:`kvpool.formats`): the version it writes,
    the release writing it, and what the start found there ("": a new file)."""

    name: str
    version: int
    writer: str
    found: str = ""  # e.g. "1 (kvpool 0.1.0 or earlier)": adopted, and migrated in place


class PrefetchStats(_Record):
    """A node's prefetches: what was asked, what came up into DRAM, and whether it paid."""

    issued: int = 0  # blocks named by prefetches
    in_dram: int = 0  # already in DRAM (held from then on)
    started: int = 0  # brought up from a lower tier, or joined one already coming up
    completed: int = 0  # brought up and verified
    refused: int = 0  # past the bound on bytes in flight or held
    absent: int = 0  # in no tier the node reads
    useful: int = 0  # prefetched blocks read while held
    wasted: int = 0  # prefetched blocks whose hold lapsed unread
    held_blocks: int = 0  # held now, for queued requests
    held_bytes: int = 0


class AccountStats(_Record):
    """One tenant's account (:mod:`kvpool.store.accounts`): what it holds of each shared
    resource, its limit of each, and how often each refused it, by resource name."""

    tenant: str
    used: dict[str, int] = {}
    limits: dict[str, int] = {}
    refused: dict[str, int] = {}
