"""Retention priorities on top of any eviction policy (:mod:`kvpool.retention`).

:class:`Retention` is an :class:`~kvpool.store.eviction.EvictionPolicy` that wraps the
node's own (``--eviction``): blocks at the default priority are the inner policy's, as if
there were no hints; a block given another priority leaves it for an LRU list of its
priority (one per priority and group, in one :class:`~kvpool.store.eviction.LRUPolicy`).
A pass (``victims``) offers the priorities below the default first, lowest first, then the
inner policy's order, then the priorities above the default, lowest first: pressure evicts
even when every block is retained.  Within a priority the least recently used goes first;
a hint's blocks join their list leaf first, so that a prefix's leaves go before its root.

Rules (tests/store/test_retention.py):

1. ``set_priority`` moves a block between the lists; the default priority is the inner
   policy's.  A priority with a deadline reverts to the default at the deadline, as if the
   block were touched then (the deadlines are a heap, served before each pass and each
   hint: O(blocks reverting)).
2. What a block above the default costs is charged to its tenant's ``RETAINED_BYTES``
   account before it moves (:class:`~kvpool.store.accounts.Accounts`; the node's own
   account is bounded by ``max_node_bytes``), and credited back when it reverts or leaves
   the store.  A block the account cannot take stays where it is: ``set_priority`` says so.
3. ``forget`` (the block left the store) resets the slot to the default priority.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator

import numpy as np

from kvpool.retention import DEFAULT_PRIORITY
from kvpool.store.accounts import NODE, Accounts, Resource
from kvpool.store.eviction import Allowed, EvictionPolicy, GroupOf, KeyOf, LRUPolicy, PolicyWrapper
from kvpool.store.index import Reserved

Clock = Callable[[], float]
Slots = Callable[[np.ndarray], None]  # a policy's call on many slots at once


def _no_group(slot: int) -> object:
    return None


class Retention(PolicyWrapper):
    """The inner policy, with blocks of other priorities in lists of their own (a
    restarted node's blocks, ``adopt``, are all at the default: the inner policy's)."""

    def __init__(
        self,
        inner: EvictionPolicy,
        accounts: Accounts | None = None,
        *,
        max_node_bytes: int = 0,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(inner)
        self.accounts = accounts if accounts is not None else Accounts()
        self.max_node_bytes = max_node_bytes  # the node's own account's bound (0: none)
        self.clock = clock
        self._lists = LRUPolicy()
        self._group_of: GroupOf = _no_group
        self._num_at: dict[int, int] = {}  # slots per priority other than the default
        self._charged: dict[int, tuple[bytes, int]] = {}  # slot -> (account, bytes)
        self._deadlines: list[tuple[float, int]] = []  # (deadline, slot), a heap
        self.node_bytes = 0  # held above the default by the node's own account
        self.num_refused = 0  # blocks an account could not take
        self.bind(0, bytes)
        self.regroup(None)

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        super().bind(num_slots, key_of)
        self._lists.bind(num_slots, key_of)
        space = Reserved(num_slots)
        self._priority_column, self._priority = space.column(np.uint8)
        self._priority_column[:] = DEFAULT_PRIORITY
        self._deadline, _ = space.column(np.float64)

    def __len__(self) -> int:
        return len(self.inner) + len(self._lists)

    def nbytes(self, num_slots: int) -> int:
        return self.inner.nbytes(num_slots) + self._lists.nbytes(num_slots) + num_slots * 9

    # -- hints ----------------------------------------------------------------------------

    def priority_of(self, slot: int) -> int:
        return int(self._priority[slot])

    def set_priority(
        self, slot: int, priority: int, duration_s: float, num_bytes: int, *, is_listed: bool
    ) -> bool:
        """Give ``slot``'s block ``priority`` (for ``duration_s``; 0: until it leaves);
        ``is_listed``: the block is evictable now (not pinned).  False: its account could
        not take it (rule 2); it keeps its priority."""
        self.expire()
        now_default = self._priority[slot] == DEFAULT_PRIORITY
        if priority == DEFAULT_PRIORITY:
            if not now_default:
                self._revert(slot, touch=is_listed)
            return True
        if priority > DEFAULT_PRIORITY and slot not in self._charged:
            if not self._charge(slot, num_bytes):
                self.num_refused += 1
                return False
        elif priority < DEFAULT_PRIORITY:
            self._credit(slot)
        if is_listed:
            self._unlist(slot)
        self._count(slot, -1)
        self._priority[slot] = priority
        self._count(slot, +1)
        deadline = self.clock() + duration_s if duration_s > 0 else 0.0
        self._deadline[slot] = deadline
        if deadline:
            heapq.heappush(self._deadlines, (deadline, slot))
        if is_listed:
            self._lists.touch(slot)
        return True

    def _charge(self, slot: int, num_bytes: int) -> bool:
        account = self.accounts.account_of(self.key_of(slot))
        if account == NODE:
            if self.max_node_bytes and self.node_bytes + num_bytes > self.max_node_bytes:
                return False
            self.node_bytes += num_bytes
        elif not self.accounts.charge(account, Resource.RETAINED_BYTES, num_bytes):
            return False
        self._charged[slot] = (account, num_bytes)
        return True

    def _credit(self, slot: int) -> None:
        charged = self._charged.pop(slot, None)
        if charged is None:
            return
        account, num_bytes = charged
        if account == NODE:
            self.node_bytes -= num_bytes
        else:
            self.accounts.credit(account, Resource.RETAINED_BYTES, num_bytes)

    def _count(self, slot: int, step: int) -> None:
        priority = int(self._priority[slot])
        if priority == DEFAULT_PRIORITY:
            return
        num = self._num_at.get(priority, 0) + step
        if num:
            self._num_at[priority] = num
        else:
            del self._num_at[priority]

    def _unlist(self, slot: int) -> None:
        if self._priority[slot] == DEFAULT_PRIORITY:
            self.inner.remove(slot)
        else:
            self._lists.remove(slot)

    def _revert(self, slot: int, *, touch: bool) -> None:
        """Back to the default priority (rule 1): the inner policy's again."""
        listed = self._lists.is_listed(slot)
        self._lists.remove(slot)
        self._to_default(slot)
        if listed or touch:
            self.inner.touch(slot)

    def _to_default(self, slot: int) -> None:
        """The slot's priority, its charge and its deadline back to the default's (none)."""
        self._credit(slot)
        self._count(slot, -1)
        self._priority[slot] = DEFAULT_PRIORITY
        self._deadline[slot] = 0.0

    def expire(self) -> int:
        """Revert every block whose deadline has passed; how many."""
        now = self.clock()
        deadlines = self._deadlines
        num = 0
        while deadlines and deadlines[0][0] <= now:
            deadline, slot = heapq.heappop(deadlines)
            if self._deadline[slot] == deadline:  # else: a later hint or a reused slot
                self._revert(slot, touch=False)
                num += 1
        if len(deadlines) > 2 * max(len(self._charged), 1024):  # hints renewed often
            self._deadlines = [(d, s) for d, s in deadlines if self._deadline[s] == d]
            heapq.heapify(self._deadlines)
        return num

    @property
    def num_retained(self) -> int:
        """Blocks at a priority other than the default now."""
        return sum(self._num_at.values())

    def retained_bytes(self, account: bytes) -> int:
        if account == NODE:
            return self.node_bytes
        return self.accounts.used(account, Resource.RETAINED_BYTES)

    # -- the policy interface ------------------------------------------------------------

    def touch(self, slot: int) -> None:
        if self._priority[slot] == DEFAULT_PRIORITY:
            self.inner.touch(slot)
        else:
            self._lists.touch(slot)

    def touch_many(self, slots: np.ndarray) -> None:
        self._by_priority(slots, self.inner.touch_many, self._lists.touch_many)

    def remove(self, slot: int) -> None:
        self._unlist(slot)

    def remove_many(self, slots: np.ndarray) -> None:
        self._by_priority(slots, self.inner.remove_many, self._lists.remove_many)

    def _by_priority(self, slots: np.ndarray, at_default: Slots, retained: Slots) -> None:
        """Hand the slots at the default priority to ``at_default`` (the inner policy's),
        the others to ``retained`` (the priority lists')."""
        if not self._num_at:
            at_default(slots)
            return
        is_retained = self._priority_column[slots] != DEFAULT_PRIORITY
        at_default(slots[~is_retained])
        retained(slots[is_retained])

    def forget(self, slot: int) -> None:
        """The block left the store (rule 3)."""
        if self._priority[slot] != DEFAULT_PRIORITY:
            self._to_default(slot)
        self.inner.forget(slot)

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        self.expire()
        if not self._num_at:
            yield from self.inner.victims(allowed)
            return
        priorities = sorted(self._num_at)
        for priority in [p for p in priorities if p < DEFAULT_PRIORITY]:
            yield from self._lists.victims(_at(priority, allowed))
        yield from self.inner.victims(allowed)
        for priority in [p for p in priorities if p > DEFAULT_PRIORITY]:
            yield from self._lists.victims(_at(priority, allowed))

    def regroup(self, group_of: GroupOf | None) -> None:
        self.inner.regroup(group_of)
        self._group_of = group_of or _no_group
        inner_group = self._group_of

        def group(slot: int) -> object:
            return (int(self._priority[slot]), inner_group(slot))

        self._lists.regroup(group)

    def recency(self, slots: np.ndarray) -> np.ndarray:
        """The inner policy's recency; a retained block counts as the most recent."""
        stamps = self.inner.recency(slots).copy()
        retained = self._priority_column[slots] != DEFAULT_PRIORITY
        if retained.any():
            stamps[retained] = np.iinfo(np.uint64).max - 1
        return stamps


def _at(priority: int, allowed: Allowed | None) -> Allowed:
    """The groups of the priority lists a pass at ``priority`` may take from."""

    def admits(group: object) -> bool:
        assert isinstance(group, tuple)
        return group[0] == priority and (allowed is None or allowed(group[1]))

    return admits
