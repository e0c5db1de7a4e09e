"""Holds: blocks that requests waiting in a queue will read, kept in DRAM until then.

A prefetch (from the router as soon as it has chosen an engine, or from the connector when
vLLM first sees a request) names the blocks a request will read.  Each is *held*:

- until it is read (``read``: the request ran), or until its deadline passes (the request
  went elsewhere, or was cancelled), whichever comes first;
- eviction skips held blocks (:class:`QueueAwareEviction`): it takes every block no queued
  request needs before any block one does, and a held block not at all before its hold
  lapses;
- bounded: at most ``max_bytes`` are held at once (half the DRAM), and each tenant at
  most its share of that, within its quota (its account's ``HELD_BYTES``,
  :mod:`kvpool.store.accounts`); a hold past either is refused, so holds can never fill
  the store or stop it from taking writes, and no tenant's holds take another's share.

Counters say whether prefetching pays: of the blocks a prefetch brought up from a lower
tier, how many were read while held (*useful*) and how many lapsed or left unread
(*wasted*).

Each hold is a lease of the node's ledger (:mod:`kvpool.store.leases`, kind ``HOLD``, owner
``Owner.PREFETCHER``): its time is clamped to the ledger's ``hold_s`` (0: the default
hold), and the ledger's ``expire`` drops the lapsed ones.

Synchronous, touched from one thread (the daemon's event loop), as the store is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvpool.store.accounts import Accounts, Resource
from kvpool.store.eviction import Allowed, EvictionPolicy, PolicyWrapper
from kvpool.store.leases import LeaseBook, LeaseKind, LeaseLedger, Owner


@dataclass(slots=True, eq=False)
class Hold:
    """One block kept for queued requests until ``deadline`` (a second hold extends it)."""

    hold_id: int
    key: bytes
    size: int
    fetched: bool  # brought up by a prefetch (counts as useful or wasted)
    deadline: float
    account: bytes  # the tenant's whose share it takes
    owner: int = Owner.PREFETCHER


@dataclass(slots=True)
class HoldCounters:
    held: int = 0  # holds granted
    refused: int = 0  # past the bound on held bytes (the node's, or the tenant's share)
    useful: int = 0  # prefetched blocks read while held
    wasted: int = 0  # prefetched blocks whose hold lapsed, or that left, unread


class Holds:
    def __init__(
        self, max_bytes: int, ledger: LeaseLedger | None = None, accounts: Accounts | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.ledger = ledger if ledger is not None else LeaseLedger()
        self.accounts = accounts if accounts is not None else Accounts()
        self.counters = HoldCounters()
        self.held_bytes = 0
        self._key_to_hold: dict[bytes, Hold] = {}
        self._book: LeaseBook[Hold] = self.ledger.open_book(LeaseKind.HOLD, self._lapsed)

    def __len__(self) -> int:
        return len(self._key_to_hold)

    def hold(self, key: bytes, size: int, hold_s: float, *, fetched: bool) -> bool:
        """Keep ``key`` for a queued request for ``hold_s`` (0: the default hold), at most the
        ledger's bound; a second hold extends the first."""
        _, deadline = self.ledger.deadline(LeaseKind.HOLD, hold_s)
        current = self._key_to_hold.get(key)
        if current is not None:
            current.deadline = max(current.deadline, deadline)
            current.fetched = current.fetched or fetched
            return True
        account = self.accounts.account_of(key)
        if self.held_bytes + size > self.max_bytes or not self.accounts.charge(
            account, Resource.HELD_BYTES, size
        ):
            self.counters.refused += 1
            return False
        hold = Hold(self.ledger.new_id(), key, size, fetched, deadline, account)
        self._key_to_hold[key] = hold
        self._book.add(hold.hold_id, hold)
        self.held_bytes += size
        self.counters.held += 1
        return True

    def is_held(self, key: bytes) -> bool:
        hold = self._key_to_hold.get(key)
        if hold is None:
            return False
        if hold.deadline > self.ledger.clock():
            return True
        self._drop(hold)
        return False

    def read(self, keys: Sequence[bytes]) -> None:
        """The request ran: its blocks need no protection any more."""
        for key in keys:
            hold = self._key_to_hold.pop(key, None)
            if hold is not None:
                self._book.pop(hold.hold_id)
                self.held_bytes -= hold.size
                self.accounts.credit(hold.account, Resource.HELD_BYTES, hold.size)
                self.counters.useful += hold.fetched

    def release(self, keys: Sequence[bytes]) -> None:
        """Not needed after all (a cancelled prefetch, a block that left or never came)."""
        for key in keys:
            hold = self._key_to_hold.get(key)
            if hold is not None:
                self._drop(hold)

    def _drop(self, hold: Hold) -> None:
        if self._book.pop(hold.hold_id) is not None:
            self._lapsed(hold.hold_id, hold)

    def _lapsed(self, hold_id: int, hold: Hold) -> None:
        """The hold ended unread (its book dropped the record already)."""
        del self._key_to_hold[hold.key]
        self.held_bytes -= hold.size
        self.accounts.credit(hold.account, Resource.HELD_BYTES, hold.size)
        self.counters.wasted += hold.fetched


class QueueAwareEviction(PolicyWrapper):
    """An eviction policy that never picks a held block: the inner policy's order among
    the blocks no queued request needs.  The caller guarantees what
    :class:`~kvpool.store.eviction.EvictionPolicy` asks; holds lapse by themselves."""

    def __init__(self, inner: EvictionPolicy, holds: Holds) -> None:
        super().__init__(inner)
        self.holds = holds

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        # A held block skipped here is moved behind the others by the inner policy.
        is_held, key_of = self.holds.is_held, self.key_of
        if not self.holds:
            return self.inner.victims(allowed)
        return (slot for slot in self.inner.victims(allowed) if not is_held(key_of(slot)))
