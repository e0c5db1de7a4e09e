"""Eviction policies.

The interface (:class:`EvictionPolicy`) speaks of *slots*, the rows of the store's index
(:mod:`kvpool.store.index`): ``bind(num_slots, key_of)`` once, before use; ``touch(slot)``
when a block becomes evictable (committed, or its last pin dropped) or is read,
``touch_many(slots)`` for distinct slots at once (a commit's blocks, a read's: ``touch`` of
each, in order), ``remove(slot)`` when it leaves the store or stops being evictable (pinned;
``remove_many`` for a read's distinct slots at once),
``forget(slot)`` after ``remove`` when it left the store, ``link(slot, parent)`` when a
committed block is known to extend the prefix that ends at ``parent`` (a live slot: its
writer said so; only for a policy that ``follows_prefixes``), and ``victims()`` yields
candidate slots, the best victim first.  The caller touches only live slots and removes
each slot it touched before the slot is reused.  A candidate the caller neither removes nor
touches before asking for the next one (a block a queued request holds) is moved behind the
others, so that no pass, and no later one, visits it again before the rest: an eviction of
k blocks visits O(k) entries, never the whole index.

Policies: :class:`LRUPolicy` (the reference, ``--eviction lru``), :class:`NoEviction`, and
:class:`~kvpool.store.learned.LearnedPolicy` (``--eviction learned``); a node builds the one
its configuration names with :func:`kvpool.store.policies.new_policy`.  LRU and the learned
policy keep their lists in one structure, :class:`~kvpool.store.lru_lists.LRULists`, each
through its public methods; a :class:`PolicyWrapper` changes another policy's choices
(holds, retention priorities).  tests/store/test_policy_conformance.py holds every policy,
and each wrapped, to this contract.

Blocks fall into *groups* (a tenant's keys, when the store has quotas: ``regroup``), each
its own LRU list, so that a pass limited to some groups (``victims(allowed)``, e.g. one
tenant's own blocks) never walks another group's entries.  An implementation yields every
slot of the allowed groups at most once per ``victims()`` pass and tolerates ``remove`` and
``touch`` during that pass.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

import numpy as np

from kvpool.keys import MIN_COLUMN_KEYS
from kvpool.store.lru_lists import NONE, LRULists

Group = Hashable
GroupOf = Callable[[int], Group]  # the group of a slot's block
Allowed = Callable[[Group], bool]  # whether a pass may take blocks of a group now
KeyOf = Callable[[int], bytes]


class EvictionPolicy(Protocol):
    @property
    def follows_prefixes(self) -> bool:
        """Whether ``link`` tells it anything (else the store does not look parents up)."""
        ...

    def bind(self, num_slots: int, key_of: KeyOf) -> None: ...

    def touch(self, slot: int) -> None: ...

    def touch_many(self, slots: np.ndarray) -> None: ...

    def remove(self, slot: int) -> None: ...

    def remove_many(self, slots: np.ndarray) -> None: ...

    def forget(self, slot: int) -> None: ...

    def link(self, slot: int, parent: int) -> None: ...

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]: ...

    def regroup(self, group_of: GroupOf | None) -> None: ...

    def adopt(self, slots: np.ndarray) -> None: ...

    def recency(self, slots: np.ndarray) -> np.ndarray: ...

    def nbytes(self, num_slots: int) -> int: ...

    def __len__(self) -> int: ...


def _one_group(slot: int) -> Group:
    return None


class LRUPolicy:
    """Least recently used first: one LRU list per group (:class:`LRULists`), merged by
    recency (the lists' clock, stamped at each touch)."""

    follows_prefixes = False

    def __init__(self) -> None:
        self._group_of: GroupOf = _one_group
        self._lists: LRULists[Group] = LRULists(None)  # list 0: the keys of no tenant
        self.num_visited = 0  # candidates yielded, ever (what an eviction costs)

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        """Columns for ``num_slots`` slots (the store's index)."""
        self._lists.bind(num_slots)

    def __len__(self) -> int:
        return len(self._lists)

    def nbytes(self, num_slots: int) -> int:
        return self._lists.nbytes(num_slots)

    def touch(self, slot: int) -> None:
        number = self._lists.where(slot)
        if number == NONE:
            number = self._lists.list_of(self._group_of(slot))
        self._lists.push(slot, number)

    def touch_many(self, slots: np.ndarray) -> None:
        """Touch distinct slots at once, in order: those listed leave their places (a run
        of neighbours in one step), then all join their groups' lists together."""
        if len(slots) < MIN_COLUMN_KEYS:
            for slot in slots.tolist():
                self.touch(slot)
            return
        if self._group_of is _one_group:
            self._lists.push_many(slots)
            return
        list_of, group_of = self._lists.list_of, self._group_of
        self._lists.push_many(slots, np.array([list_of(group_of(s)) for s in slots.tolist()]))

    def remove(self, slot: int) -> None:
        self._lists.remove(slot)

    def is_listed(self, slot: int) -> bool:
        return self._lists.is_listed(slot)

    def remove_many(self, slots: np.ndarray) -> None:
        """Take distinct slots out of their lists, those listed."""
        self._lists.remove_many(slots)

    def forget(self, slot: int) -> None:
        """The slot's block left the store (LRU keeps nothing more of it)."""

    def link(self, slot: int, parent: int) -> None:
        """A block extends another's prefix (LRU orders by recency alone)."""

    def adopt(self, slots: np.ndarray) -> None:
        """Touch ``slots`` in order (the blocks of a warm restart, oldest first), in bulk."""
        if not len(slots):
            return
        if len(self._lists) or len(self._lists.labels) > 1:
            for slot in slots.tolist():
                self.touch(slot)
            return
        self._lists.push_many(slots)

    def regroup(self, group_of: GroupOf | None) -> None:
        """Sort the listed slots into new groups, keeping their order (at a reload of the
        tenants, not on the request path: it visits every listed slot once)."""
        self._group_of = group_of or _one_group
        self._lists.relist(group_of)

    def recency(self, slots: np.ndarray) -> np.ndarray:
        """When each slot was last touched (larger: more recent)."""
        return self._lists.stamps(slots)

    def _head(self, allowed: Allowed | None) -> tuple[int, int]:
        """The least recent slot of the groups ``allowed`` admits now, and its group's
        number (NONE, NONE: none)."""
        best, best_number, best_stamp = NONE, NONE, 0
        stamp, groups = self._lists.stamp, self._lists.labels
        for number, head in enumerate(self._lists.heads):
            if head == NONE or (allowed is not None and not allowed(groups[number])):
                continue
            head_stamp = stamp(head)
            if best == NONE or head_stamp < best_stamp:
                best, best_number, best_stamp = head, number, head_stamp
        return best, best_number

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        # Always the head of a list: the caller removes it (evicted) or it is moved behind
        # the others (kept), so no pass rescans what it skipped.  At most one visit kept per
        # entry listed at the start, so that a pass over blocks all kept ends.
        budget = len(self._lists)
        heads = self._lists.heads
        while budget > 0:
            slot, number = self._head(allowed)
            if slot == NONE:
                return
            self.num_visited += 1
            yield slot
            if heads[number] == slot:
                budget -= 1
                self._lists.push(slot, number)  # kept: behind the others


class PolicyWrapper:
    """An eviction policy around another (``inner``): every call goes to it, and a wrapper
    overrides only what it changes (:class:`~kvpool.store.holds.QueueAwareEviction`,
    :class:`~kvpool.store.retention.Retention`).  ``key_of`` is the store's, once bound."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.key_of: KeyOf = bytes

    @property
    def follows_prefixes(self) -> bool:
        return self.inner.follows_prefixes

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        self.key_of = key_of
        self.inner.bind(num_slots, key_of)

    def touch(self, slot: int) -> None:
        self.inner.touch(slot)

    def touch_many(self, slots: np.ndarray) -> None:
        self.inner.touch_many(slots)

    def remove(self, slot: int) -> None:
        self.inner.remove(slot)

    def remove_many(self, slots: np.ndarray) -> None:
        self.inner.remove_many(slots)

    def forget(self, slot: int) -> None:
        self.inner.forget(slot)

    def link(self, slot: int, parent: int) -> None:
        self.inner.link(slot, parent)

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        return self.inner.victims(allowed)

    def regroup(self, group_of: GroupOf | None) -> None:
        self.inner.regroup(group_of)

    def adopt(self, slots: np.ndarray) -> None:
        self.inner.adopt(slots)

    def recency(self, slots: np.ndarray) -> np.ndarray:
        return self.inner.recency(slots)

    def nbytes(self, num_slots: int) -> int:
        return self.inner.nbytes(num_slots)

    def __len__(self) -> int:
        return len(self.inner)


class NoEviction:
    """Never evicts: a full store refuses new blocks (for tests and pinned-memory modes)."""

    follows_prefixes = False

    def __init__(self) -> None:
        self._stamps = np.zeros(0, dtype=np.uint64)

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        self._stamps = np.zeros(0, dtype=np.uint64)

    def touch(self, slot: int) -> None:
        pass

    def touch_many(self, slots: np.ndarray) -> None:
        pass

    def remove(self, slot: int) -> None:
        pass

    def remove_many(self, slots: np.ndarray) -> None:
        pass

    def forget(self, slot: int) -> None:
        pass

    def link(self, slot: int, parent: int) -> None:
        pass

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        return iter(())

    def regroup(self, group_of: GroupOf | None) -> None:
        pass

    def adopt(self, slots: np.ndarray) -> None:
        pass

    def recency(self, slots: np.ndarray) -> np.ndarray:
        return np.zeros(len(slots), dtype=np.uint64)

    def nbytes(self, num_slots: int) -> int:
        return 0

    def __len__(self) -> int:
        return 0
