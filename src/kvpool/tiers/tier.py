"""What every tier below DRAM is to the node: the :class:`Tier` protocol, the event sink the
tiers report through, and :class:`RemoteSource`, other nodes read as one more source.

The chain (:mod:`kvpool.tiers.chain`) holds the lower tiers in order, fastest first (disk,
then the object store), and reads a block from the first that holds it; other nodes come
after every local tier, and only prefetches ask them.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import msgspec

from kvpool.keys import BlockOrigin
from kvpool.stats import TierStats
from kvpool.store.accounts import Accounts, Resource

MEDIUM_DRAM = "CPU"  # the medium of the DRAM arena's KV events
MEDIUM_STORAGE = "STORAGE"  # the disk tier's

# Reads blocks from other nodes of the cluster: per key, its bytes or None.
# Other nodes' blocks for these keys, at most ``max_bytes`` of them in all (None: absent
# or past the bound, decided from the sizes the nodes announce before sending).
RemoteFetch = Callable[[list[bytes], int], Awaitable[list[bytes | None]]]

# ``(key, offset, size, checksum)`` of each live block of a disk segment.
SegmentBlocks = list[tuple[bytes, int, int, int]]


class TierEvents(Protocol):
    """Where the tiers report what they hold (the node's KV events: its
    :class:`~kvpool.node.events.KVEventPublisher`).  Passed to a tier's constructor, never
    assigned later.  Both methods are thread-safe and never block: a tier may call them
    from its I/O threads, under its own lock."""

    def stored_key(self, key: bytes, origin: BlockOrigin | None, medium: str) -> None: ...

    def removed_keys(self, keys: list[bytes], medium: str) -> None: ...


class SegmentSink(Protocol):
    """The tier below the disk: it is handed each segment the disk evicts."""

    def offer_segment(self, path: Path, blocks: SegmentBlocks) -> bool: ...


class Tier(Protocol):
    """A tier below DRAM, found by key (:class:`~kvpool.tiers.disk.DiskTier`,
    :class:`~kvpool.tiers.objects.ObjectTier`).

    What a caller guarantees:

    - ``contains``, ``may_hold``, ``size_of``, ``stored`` and ``stats`` may come from the
      event loop;
      ``read_many``, ``delete`` and ``close`` come from a worker thread (they block on I/O).
    - Each destination given to ``read_many`` is at least the block's size and is not read
      by anyone until ``read_many`` returns.
    - ``close`` is called once, after the last read.

    What an implementation must do:

    - Answer ``contains``, ``may_hold``, ``size_of`` and ``stored`` from memory alone:
      never I/O, never a request.
    - Make a ``delete`` last: the block is not served again, after a restart either, nor
      by another node reading a shared tier (its bytes may go later, with its segment or
      pack); it leaves the index before ``delete`` returns.
    - Serve only verified bytes: ``read_many`` checks each block against the checksum it
      was stored with (xxh3-64, the one DRAM keeps) and returns that checksum, or ``None``
      for a block it does not hold, could not read in time, or found corrupt (which it then
      drops from its index and counts).
    - Take blocks from the tier above only through the intake it was built with (the disk:
      the write-back's ``write``; the object store: the disk's evicted segments,
      :class:`SegmentSink`) and never make the tier above wait.
    - Report blocks stored and removed through the :class:`TierEvents` it was given at
      construction, if any, under ``medium`` (the object store, which every node shares,
      takes none: each node would announce the same blocks).
    - Keep ``stats`` cheap: counters, no I/O.  The chain adds what only it sees (lookup
      hits, promotions, the write-back's refusals).
    """

    tier_id: int  # kvpool.stats.TIER_*: how lookups name the tier
    medium: str  # of its KV events
    capacity: int  # bytes
    resource: Resource  # its tenants' bytes in the tenant ledger (DISK_BYTES, OBJECT_BYTES)

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def may_hold(self, keys: Sequence[bytes]) -> bool:
        """Whether a ``delete`` of ``keys`` may have anything to do here: one of them is
        held, or on its way in (from memory only: the event loop asks, so that a DELETE of
        blocks no lower tier has needs no thread)."""

    def size_of(self, key: bytes) -> int | None: ...

    def stored(self, key: bytes) -> tuple[int, int] | None:
        """The block's size and checksum, from memory (None: not held)."""

    def read_many(self, jobs: Sequence[tuple[bytes, memoryview]]) -> list[int | None]: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def recount_quotas(self, accounts: Accounts) -> None:
        """The tenants' shares of the tier are ``accounts``' limits of its ``resource``
        (set by :meth:`~kvpool.store.accounts.Accounts.set_tenants`; none: no tenants
        here); count what each holds here again, into that ledger, through a
        :class:`~kvpool.store.quotas.Quotas`.  A tenant past its share loses its own blocks
        first, and no write or capacity limit takes the blocks of a tenant within its
        share (the store's rule 11, on this tier)."""

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


class RemoteSource:
    """Other nodes of the cluster as a read-only source: no index here (``contains`` is
    unknown until asked), so only prefetches ask it, in the background, and at most
    ``max_keys`` keys at a time.  ``fetch`` runs on the event loop (the cluster agent's
    requests are asynchronous); the bytes it returns are not verified against a checksum
    (the agent's client checked them as they arrived)."""

    def __init__(self, fetch: RemoteFetch, max_keys: int = 64) -> None:
        self._fetch = fetch
        self.max_keys = max_keys

    async def fetch(self, keys: list[bytes], max_bytes: int) -> list[tuple[bytes, bytes]]:
        """``(key, bytes)`` of the keys some other node holds, ``max_bytes`` at most."""
        values = await self._fetch(keys, max_bytes)
        return [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]


class _Located(Protocol):
    @property
    def size(self) -> int: ...

    @property
    def checksum(self) -> int: ...


L = TypeVar("L", bound=_Located)


class KeyIndex(Generic[L]):
    """The in-memory index a lower tier answers lookups from: key → where its block is.
    ``_lock`` guards it (and whatever else the tier puts under it); it is never held
    during I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[bytes, L] = {}

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def location(self, key: bytes) -> L | None:
        with self._lock:
            return self._index.get(key)

    def size_of(self, key: bytes) -> int | None:
        location = self.location(key)
        return None if location is None else location.size

    def stored(self, key: bytes) -> tuple[int, int] | None:
        location = self.location(key)
        return None if location is None else (location.size, location.checksum)

    def __len__(self) -> int:
        return len(self._index)

    def held_keys(self) -> list[bytes]:
        """Every key held now (a snapshot: O(blocks held), for a drain, never a request)."""
        with self._lock:
            return list(self._index)

    def _stats(self, name: str, capacity: int, used_bytes: int, **moved: int) -> TierStats:
        """The tier's :class:`~kvpool.stats.TierStats`: what it holds (from the index), and
        ``moved``, its counters of what went through it."""
        held = TierStats(
            name=name, capacity_bytes=capacity, used_bytes=used_bytes, num_blocks=len(self)
        )
        return msgspec.structs.replace(held, **moved)
