"""LRU lists of slots: the one structure every recency-ordered eviction policy keeps.

A slot (a row of the store's index, :mod:`kvpool.store.index`) is on at most one list at
a time.  Each list is doubly linked through columns by slot (no Python object per block),
least recent first, and named by a *label* (a tenant group for
:class:`~kvpool.store.eviction.LRUPolicy`; a tenant group and a class for
:class:`~kvpool.store.learned.LearnedPolicy`).  Lists are numbered in the order their
labels are first named, list 0 being ``first_label``'s.  One clock stamps each slot as it
joins a list (``push``), so a list's order is its stamps' and lists compare by them.

- ``push(slot, number)``: the slot (listed or not) becomes the most recent of list
  ``number``; ``push_many`` does so for distinct slots at once, in order.
- ``remove``, ``remove_many``: off its list, if on one (a run of neighbours in one step).
- ``heads``, ``where``, ``stamp``, ``labels``: what a policy reads to choose a victim.
- ``relist(label_of)``: the labels start over and every listed slot joins the list of its
  new label, keeping its order and stamp (at a reload of the tenants: it visits every
  listed slot once).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numpy as np

from kvpool.keys import MIN_COLUMN_KEYS
from kvpool.store.index import Reserved

NONE = -1  # no slot (the end of a list), no list
SLOT_BYTES = 4 + 4 + 8 + 2  # previous, next, stamp, list number + 1

Label = TypeVar("Label", bound=Hashable)


class LRULists(Generic[Label]):
    """Numbered LRU lists of slots, labelled, stamped by one clock (see the module)."""

    def __init__(self, first_label: Label) -> None:
        self._first_label = first_label
        self._label_to_number: dict[Label, int] = {}
        # Read by the policies, written only here: plain lists, not properties, since a
        # victim pass reads them once a block it evicts.
        self.labels: list[Label] = []  # each list's label, by number
        self.heads: list[int] = []  # each list's least recent slot, by number (NONE: empty)
        self._tails: list[int] = []
        self._start_lists()
        self.clock = 0  # the stamp of the latest push
        self._size = 0
        self.bind(0)

    def bind(self, num_slots: int) -> None:
        """Columns for ``num_slots`` slots, none listed."""
        space = Reserved(num_slots)
        self._prev_column, self._prev = space.column(np.int32)
        self._next_column, self._next = space.column(np.int32)
        self._stamps, self._stamp = space.column(np.uint64)
        # Per slot: its list's number + 1 while it is listed, else 0.
        self._listed_column, self._listed = space.column(np.int16)
        self._size = 0
        self._start_lists()

    def nbytes(self, num_slots: int) -> int:
        return num_slots * SLOT_BYTES

    def __len__(self) -> int:
        """Slots listed."""
        return self._size

    # -- reading ----------------------------------------------------------------------------

    def list_of(self, label: Label) -> int:
        """The number of ``label``'s list (a new, empty one the first time)."""
        number = self._label_to_number.get(label)
        if number is None:
            number = self._label_to_number[label] = len(self.labels)
            self.labels.append(label)
            self.heads.append(NONE)
            self._tails.append(NONE)
        return number

    def where(self, slot: int) -> int:
        """The number of the slot's list (NONE: not listed)."""
        return self._listed[slot] - 1

    def is_listed(self, slot: int) -> bool:
        return bool(self._listed[slot])

    def stamp(self, slot: int) -> int:
        """The clock when the slot last joined a list."""
        return self._stamp[slot]

    def stamps(self, slots: np.ndarray) -> np.ndarray:
        return self._stamps[slots]

    # -- changing ---------------------------------------------------------------------------

    def push(self, slot: int, number: int) -> None:
        """The slot becomes the most recent of list ``number`` (leaving its own first)."""
        listed = self._listed[slot]
        if listed:
            self._unlink(slot, listed - 1)
        self.clock += 1
        self._stamp[slot] = self.clock
        self._append(slot, number)

    def push_many(self, slots: np.ndarray, numbers: np.ndarray | int = 0) -> None:
        """:meth:`push` of distinct slots, in order, each to its list (``numbers``: one per
        slot, or one for all): those listed leave their places, then all join together, a
        run per list."""
        self.remove_many(slots)
        if isinstance(numbers, int):
            self._append_run(slots, numbers)
            return
        stamps = np.arange(self.clock + 1, self.clock + len(slots) + 1, dtype=np.uint64)
        for number in np.unique(numbers).tolist():
            members = numbers == number
            self._append_run(slots[members], number, stamps[members])
        self.clock += len(slots)

    def remove(self, slot: int) -> None:
        """Off its list, if on one."""
        listed = self._listed[slot]
        if listed:
            self._unlink(slot, listed - 1)

    def remove_many(self, slots: np.ndarray) -> None:
        """:meth:`remove` of distinct slots.  A list's order is its stamps' (each push
        appends with a later one), so the slots sorted by stamp fall into runs of
        neighbours (a prefix's blocks, written and read together), and each run is cut out
        in one step."""
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

    def relist(self, label_of: Callable[[int], Label] | None) -> None:
        """The labels start over, and every listed slot joins the list of ``label_of(slot)``
        (None: ``first_label``'s), keeping the slots' order and stamps."""
        listed = np.flatnonzero(self._listed_column)
        order = listed[np.argsort(self._stamps[listed], kind="stable")]
        self._listed_column[order] = 0
        self._size = 0
        self._start_lists()
        if label_of is None:
            if len(order):
                self._append_run(order, 0, self._stamps[order])
            return
        for slot in order.tolist():
            self._append(slot, self.list_of(label_of(slot)))

    # -- the links --------------------------------------------------------------------------

    def _start_lists(self) -> None:
        """Only ``first_label``'s list, empty (in place: ``heads`` and ``labels`` stay the
        caller's views)."""
        self._label_to_number.clear()
        self.labels.clear()
        self.heads.clear()
        self._tails.clear()
        self.list_of(self._first_label)

    def _append(self, slot: int, number: int) -> None:
        """Append the slot (not listed) to list ``number``, keeping its stamp."""
        tail = self._tails[number]
        self._prev[slot] = tail
        self._next[slot] = NONE
        if tail == NONE:
            self.heads[number] = slot
        else:
            self._next[tail] = slot
        self._tails[number] = slot
        self._listed[slot] = number + 1
        self._size += 1

    def _append_run(self, slots: np.ndarray, number: int, stamps: np.ndarray | None = None) -> None:
        """Append ``slots`` (distinct, none listed now), in order, to list ``number``: the
        most recent now (``stamps``: theirs, already counted by the clock)."""
        n = len(slots)
        if not n:
            return
        tail = self._tails[number]
        self._prev_column[slots[1:]] = slots[:-1]
        self._prev_column[slots[0]] = tail
        self._next_column[slots[:-1]] = slots[1:]
        self._next_column[slots[-1]] = NONE
        if tail == NONE:
            self.heads[number] = int(slots[0])
        else:
            self._next[tail] = int(slots[0])
        self._tails[number] = int(slots[-1])
        if stamps is None:
            stamps = np.arange(self.clock + 1, self.clock + n + 1, dtype=np.uint64)
            self.clock += n
        self._stamps[slots] = stamps
        self._listed_column[slots] = number + 1
        self._size += n

    def _unlink(self, slot: int, number: int) -> None:
        self._cut(slot, slot, number)
        self._listed[slot] = 0
        self._size -= 1

    def _cut(self, first: int, last: int, number: int) -> None:
        """Unlink the run of neighbours from ``first`` to ``last`` of list ``number``."""
        before, after = self._prev[first], self._next[last]
        if before == NONE:
            self.heads[number] = after
        else:
            self._next[before] = after
        if after == NONE:
            self._tails[number] = before
        else:
            self._prev[after] = before
