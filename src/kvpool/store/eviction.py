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
its configuration names with :func:`kvpool.store.policies.new_policy`.

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
from kvpool.store.index import Reserved

Group = Hashable
GroupOf = Callable[[int], Group]  # the group of a slot's block
Allowed = Callable[[Group], bool]  # whether a pass may take blocks of a group now
KeyOf = Callable[[int], bytes]
NONE = -1  # no slot (the end of a list)


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
    """Least recently used first: one doubly linked list per group, through columns by slot
    (no Python object per block), merged by recency (a clock stamped at each touch)."""

    follows_prefixes = False

    def __init__(self) -> None:
        self._group_of: GroupOf = _one_group
        # Per group: its number (0 is the group of keys of no tenant), its list's ends.
        self._numbers: dict[Group, int] = {None: 0}
        self._groups: list[Group] = [None]
        self._heads: list[int] = [NONE]
        self._tails: list[int] = [NONE]
        self._clock = 0
        self._size = 0
        self.num_visited = 0  # candidates yielded, ever (what an eviction costs)
        self.bind(0, bytes)

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        """Columns for ``num_slots`` slots (the store's index)."""
        space = Reserved(num_slots)
        self._prev_column, self._prev = space.column(np.int32)
        self._next_column, self._next = space.column(np.int32)
        self._stamps, self._stamp = space.column(np.uint64)
        # Per slot: its group's number + 1 while it is listed, else 0.
        self._listed_column, self._listed = space.column(np.int16)

    def __len__(self) -> int:
        return self._size

    def nbytes(self, num_slots: int) -> int:
        return num_slots * (4 + 4 + 8 + 2)

    def touch(self, slot: int) -> None:
        listed = self._listed[slot]
        if listed:
            number = listed - 1
            self._unlink(slot, number)
        else:
            number = self._number(self._group_of(slot))
        self._clock += 1
        self._stamp[slot] = self._clock
        self._append(slot, number)

    def touch_many(self, slots: np.ndarray) -> None:
        """Touch distinct slots at once, in order: those listed leave their places (a run
        of neighbours in one step), then all join their groups' lists together."""
        if len(slots) < MIN_COLUMN_KEYS:
            for slot in slots.tolist():
                self.touch(slot)
            return
        self.remove_many(slots)
        if self._group_of is _one_group:
            self._append_run(slots, 0)
            return
        numbers = np.array([self._number(self._group_of(s)) for s in slots.tolist()])
        stamps = np.arange(self._clock + 1, self._clock + len(slots) + 1, dtype=np.uint64)
        for number in np.unique(numbers).tolist():
            members = numbers == number
            self._append_run(slots[members], number, stamps[members])
        self._clock += len(slots)

    def remove(self, slot: int) -> None:
        listed = self._listed[slot]
        if listed:
            self._unlink(slot, listed - 1)

    def is_listed(self, slot: int) -> bool:
        return bool(self._listed[slot])

    def remove_many(self, slots: np.ndarray) -> None:
        """Take distinct slots out of their lists, those listed.  A list's order is its
        stamps' (each touch appends with a later one), so the slots sorted by stamp fall
        into runs of neighbours (a prefix's blocks, written and read together), and each
        run is cut out in one step."""
        if len(slots) < MIN_COLUMN_KEYS:
            for slot in slots.tolist():
                self.remove(slot)
            return
        listed = slots[self._listed_column[slots] > 0]
        if not len(listed):
            return
        order = listed[np.argsort(self._stamps[listed], kind="stable")]
        numbers = (self._listed_column[order] - 1).tolist()
        ends = np.flatnonzero(self._next_column[order[:-1]] != order[1:])
        firsts = [0, *(ends + 1).tolist()]
        lasts = [*ends.tolist(), len(order) - 1]
        runs = order.tolist()
        for first, last in zip(firsts, lasts, strict=True):
            self._cut(runs[first], runs[last], numbers[first])
        self._listed_column[order] = 0
        self._size -= len(order)

    def _cut(self, first: int, last: int, number: int) -> None:
        """Unlink the run of neighbours from ``first`` to ``last`` of list ``number``."""
        before, after = self._prev[first], self._next[last]
        if before == NONE:
            self._heads[number] = after
        else:
            self._next[before] = after
        if after == NONE:
            self._tails[number] = before
        else:
            self._prev[after] = before

    def forget(self, slot: int) -> None:
        """The slot's block left the store (LRU keeps nothing more of it)."""

    def link(self, slot: int, parent: int) -> None:
        """A block extends another's prefix (LRU orders by recency alone)."""

    def _number(self, group: Group) -> int:
        number = self._numbers.get(group)
        if number is None:
            number = self._numbers[group] = len(self._groups)
            self._groups.append(group)
            self._heads.append(NONE)
            self._tails.append(NONE)
        return number

    def _append(self, slot: int, number: int) -> None:
        tail = self._tails[number]
        self._prev[slot] = tail
        self._next[slot] = NONE
        if tail == NONE:
            self._heads[number] = slot
        else:
            self._next[tail] = slot
        self._tails[number] = slot
        self._listed[slot] = number + 1
        self._size += 1

    def _unlink(self, slot: int, number: int) -> None:
        self._cut(slot, slot, number)
        self._listed[slot] = 0
        self._size -= 1

    def adopt(self, slots: np.ndarray) -> None:
        """Touch ``slots`` in order (the blocks of a warm restart, oldest first), in bulk."""
        if not len(slots):
            return
        if self._size or len(self._groups) > 1:
            for slot in slots.tolist():
                self.touch(slot)
            return
        self._append_run(slots, 0)

    def _append_run(self, slots: np.ndarray, number: int, stamps: np.ndarray | None = None) -> None:
        """Append ``slots`` (distinct, none listed now), in order, to group ``number``'s
        list: the most recent now (``stamps``: theirs, already counted by the clock, where
        the slots of several groups are touched together)."""
        n = len(slots)
        tail = self._tails[number]
        self._prev_column[slots[1:]] = slots[:-1]
        self._prev_column[slots[0]] = tail
        self._next_column[slots[:-1]] = slots[1:]
        self._next_column[slots[-1]] = NONE
        if tail == NONE:
            self._heads[number] = int(slots[0])
        else:
            self._next[tail] = int(slots[0])
        self._tails[number] = int(slots[-1])
        if stamps is None:
            stamps = np.arange(self._clock + 1, self._clock + n + 1, dtype=np.uint64)
            self._clock += n
        self._stamps[slots] = stamps
        self._listed_column[slots] = number + 1
        self._size += n

    def regroup(self, group_of: GroupOf | None) -> None:
        """Sort the listed slots into new groups, keeping their order (at a reload of the
        tenants, not on the request path: it visits every listed slot once)."""
        listed = np.flatnonzero(self._listed_column)
        order = listed[np.argsort(self._stamps[listed], kind="stable")]
        self._listed_column[order] = 0
        self._group_of = group_of or _one_group
        self._numbers, self._groups = {None: 0}, [None]
        self._heads, self._tails = [NONE], [NONE]
        self._size = 0
        if group_of is None:
            if len(order):
                self._append_run(order, 0)
            return
        for slot in order.tolist():
            self._append(slot, self._number(group_of(slot)))

    def recency(self, slots: np.ndarray) -> np.ndarray:
        """When each slot was last touched (larger: more recent)."""
        return self._stamps[slots]

    def _head(self, allowed: Allowed | None) -> tuple[int, int]:
        """The least recent slot of the groups ``allowed`` admits now, and its group's
        number (NONE, NONE: none)."""
        best, best_number, best_stamp = NONE, NONE, 0
        stamp = self._stamp
        for number, head in enumerate(self._heads):
            if head == NONE or (allowed is not None and not allowed(self._groups[number])):
                continue
            if best == NONE or stamp[head] < best_stamp:
                best, best_number, best_stamp = head, number, stamp[head]
        return best, best_number

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        # Always the head of a list: the caller removes it (evicted) or it is moved behind
        # the others (kept), so no pass rescans what it skipped.  At most one visit kept per
        # entry listed at the start, so that a pass over blocks all kept ends.
        budget = self._size
        while budget > 0:
            slot, number = self._head(allowed)
            if slot == NONE:
                return
            self.num_visited += 1
            yield slot
            if self._heads[number] == slot:
                budget -= 1
                self._requeue(slot)  # kept: behind the others

    def _requeue(self, slot: int) -> None:
        """A candidate the caller kept goes behind the others."""
        self.touch(slot)


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
