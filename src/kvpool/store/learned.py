"""``--eviction learned``: least recently used, weighted by what the node learns of which
blocks are read again, and never a prefix before its extensions.

Measured on Mooncake's conversation trace (docs/benchmarks-log.md, "The pool's value on real
traffic"), the one signal the pool sees that separates blocks read again from the rest is
how often a block was read since it was written: a block never read comes back about a
quarter of the time, one read once four times in ten, one read three times or more three
times in four.  Signals of a request's shape (its new blocks, their place) separate less.

- **Classes**: a block's class is how often it was read since it was written (0, 1, 2, 3 or
  more: ``NUM_CLASSES``).  Each (tenant group, class) is an LRU list (one of
  :class:`~kvpool.store.lru_lists.LRULists`, as LRU's groups are), and the victim is the
  head, among the lists a pass may take from, whose age (touches since its last) divided by
  its class's *weight* is largest: a class twice as likely to be read again keeps its
  blocks twice as long.
- **Weights, learned**: :class:`Tuner` follows a spatial sample of the keys (a key is
  sampled if its stable hash falls under a threshold, SHARDS-style; why keys, and why that
  hash, is decided once for the store's samples: :mod:`kvpool.store.reuse`, *Sampling*)
  and counts, per class, how often a sampled block is used again (read, or written again
  after it left) within a horizon of a few times what the node holds.  A class's weight is
  its odds of that, raised to a *strength*, relative to the mean.
- **Strength, chosen by measurement**: the tuner also runs miniature simulations of the
  cache on the sampled keys (Waldspurger et al., "Cache Modeling and Optimization using
  Miniature Simulations", ATC'17), one per candidate strength, each as large as the node's
  memory times the sampling rate; the node follows the candidate whose miniature hit the
  most lately.  Strength 0 is plain LRU, so where weighting does not pay (a cache large
  enough for nearly everything that comes back) the node falls back to LRU.
- **Prefixes last**: a block whose writer named its parent (the block before it in its
  prefix: ``BlockOrigin.parent``) is that parent's *extension*, and an extension is no use
  without its prefix.  When a block is chosen, its extensions are offered first, leaves
  first (:meth:`LearnedPolicy._leaves_first`), and the block after them: where one of them
  stays (pinned, held for a queued request, or the caller has evicted enough), so does
  every block it extends.  So a parent never leaves before a descendant still held, and
  the dead extensions of a prefix that goes leave with it.

Cost: per touch, O(1) (a stable hash of the key and a dictionary probe for the sample; a sampled
key costs a step of each miniature, O(candidates x classes)); per victim, O(tenant groups x
classes), and an extension is visited as it is evicted.  Memory: 17 bytes a slot of columns
(touches, and the prefix tree's parent, first child and siblings), and the sample's bounded
tables (at most ``MAX_FOLLOWED`` keys, miniatures of at most ``MINI_BLOCKS`` blocks each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from kvpool.store.eviction import Allowed, Group, GroupOf, KeyOf
from kvpool.store.index import Reserved
from kvpool.store.lru_lists import NONE, LRULists
from kvpool.store.reuse import SAMPLE_HASH_BITS, sample_hash

NUM_CLASSES = 4  # reads since written: 0, 1, 2, 3 or more
STRENGTHS = (0.0, 0.25, 0.5, 0.75)  # candidate exponents of the classes' odds
MINI_BLOCKS = 1024  # blocks a miniature holds at most (the sampling rate follows from it)
MAX_FOLLOWED = 8 * MINI_BLOCKS  # sampled keys followed at most (a read-again horizon of 8x)
RETUNE_EVERY = 2048  # sampled accesses between choices of the weights
DECAY = 0.7  # of the miniatures' hits, at each choice
ODDS_DECAY = 0.95  # of the classes' counts, at each choice


class Miniature:
    """A cache of ``capacity`` sampled keys run by the weighted-age rule with one set of
    class weights: how many of the sampled accesses it would have hit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.lists: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(NUM_CLASSES)]
        self.where: dict[int, int] = {}  # key -> its class
        self.reads: dict[int, int] = {}  # key -> reads since it came in
        self.hits = 0.0

    def access(self, key: int, now: int, weights: list[float]) -> None:
        cls = self.where.get(key)
        if cls is not None:
            self.hits += 1
            del self.lists[cls][key]
            reads = self.reads[key] = self.reads[key] + 1
        else:
            if len(self.where) >= self.capacity:
                self._evict(now, weights)
            reads = self.reads[key] = 0
        cls = min(reads, NUM_CLASSES - 1)
        self.where[key] = cls
        self.lists[cls][key] = now

    def _evict(self, now: int, weights: list[float]) -> None:
        best, best_score = -1, -1.0
        for cls, ordered in enumerate(self.lists):
            if ordered:
                score = (now - next(iter(ordered.values()))) / weights[cls]
                if score > best_score:
                    best, best_score = cls, score
        key, _ = self.lists[best].popitem(last=False)
        del self.where[key]
        del self.reads[key]


class Tuner:
    """Learns the class weights from a spatial sample of the keys (see the module)."""

    def __init__(self, capacity: int) -> None:
        self._start(capacity)

    def _start(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.rate = min(1.0, MINI_BLOCKS / self.capacity)
        self._threshold = int(self.rate * (1 << SAMPLE_HASH_BITS))
        self.now = 0  # sampled accesses
        # Sampled key -> (class at its last access, when): oldest first.
        self._followed: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._accesses = np.zeros(NUM_CLASSES)  # sampled accesses that left a block in a class
        self._again = np.zeros(NUM_CLASSES)  # ... and whose key was used again within the horizon
        self.miniatures = [Miniature(round(self.rate * self.capacity)) for _ in STRENGTHS]
        self.strength = 0.0
        self.weights = [1.0] * NUM_CLASSES
        self._candidate_weights = [self.weights] * len(STRENGTHS)

    def resize(self, capacity: int) -> None:
        """The node holds about ``capacity`` blocks: sample for miniatures of that times the
        rate (starting over, if the rate changes much)."""
        if capacity < 2 * self.capacity and 2 * capacity > self.capacity:
            return
        self._start(capacity)

    def access(self, key_hash: int, cls: int) -> None:
        """A touch of the key whose :func:`~kvpool.store.reuse.sample_hash` is ``key_hash``
        that leaves it in class ``cls`` (``cls`` > 0: it was a read)."""
        if key_hash >= self._threshold:
            return
        self.now += 1
        now = self.now
        followed = self._followed
        last = followed.pop(key_hash, None)
        if last is not None:  # used again within the horizon (read, or written again)
            self._again[last[0]] += 1
        followed[key_hash] = (cls, now)
        self._accesses[cls] += 1
        horizon = len(self.miniatures[0].where) * (MAX_FOLLOWED // MINI_BLOCKS)
        while len(followed) > MAX_FOLLOWED or (
            followed and now - next(iter(followed.values()))[1] > max(horizon, 1)
        ):
            followed.popitem(last=False)
        for miniature, weights in zip(self.miniatures, self._candidate_weights, strict=True):
            miniature.access(key_hash, now, weights)
        if now % RETUNE_EVERY == 0:
            self._retune()

    def nbytes(self) -> int:
        """About the memory it takes: the followed keys and the miniatures' tables."""
        entries = len(self._followed) + 3 * sum(len(m.where) for m in self.miniatures)
        return 100 * entries

    def _retune(self) -> None:
        """Weights for every candidate strength from the classes' odds of a read again;
        the node's from the candidate whose miniature hit the most lately."""
        chances = (self._again + 1) / (self._accesses + 2)
        odds = np.minimum(chances, 0.95) / (1 - np.minimum(chances, 0.95))
        share = self._accesses / max(self._accesses.sum(), 1)
        self._candidate_weights = []
        for strength in STRENGTHS:
            raw = odds**strength
            mean = float((raw * share).sum()) or 1.0
            self._candidate_weights.append([float(w) / mean for w in raw])
        best = max(range(len(STRENGTHS)), key=lambda i: self.miniatures[i].hits)
        self.strength = STRENGTHS[best]
        self.weights = self._candidate_weights[best]
        for miniature in self.miniatures:
            miniature.hits *= DECAY
        self._accesses *= ODDS_DECAY
        self._again *= ODDS_DECAY


class LearnedPolicy:
    """See the module's docstring."""

    follows_prefixes = True

    def __init__(self) -> None:
        self._group_of: GroupOf = _nobody
        # One list per (tenant group, class); list 0: nobody's, class 0.
        self._lists: LRULists[tuple[Group, int]] = LRULists((None, 0))
        self.tuner = Tuner(1)
        self._key_of: KeyOf = bytes
        self._num_held = 0
        self._resume: tuple[int, int] | None = None  # (root, block) where a walk stopped
        self.num_visited = 0  # candidates yielded and steps down the prefix tree, ever
        self.bind(0, bytes)

    def bind(self, num_slots: int, key_of: KeyOf) -> None:
        self._lists.bind(num_slots)
        self._key_of = key_of
        space = Reserved(num_slots)
        # Per slot: touches since written (saturating; 0: not held); the prefix tree of the
        # blocks whose writers named their parents: parent, first child, next and previous
        # sibling, each a slot + 1 (0: none, so that untouched pages stay unused).
        self._touches_column, self._touches = space.column(np.uint8)
        _, self._parent = space.column(np.int32)
        _, self._first_child = space.column(np.int32)
        _, self._next_sibling = space.column(np.int32)
        _, self._prev_sibling = space.column(np.int32)
        self.tuner = Tuner(num_slots)
        self._num_held = 0

    def __len__(self) -> int:
        return len(self._lists)

    def nbytes(self, num_slots: int) -> int:
        columns = num_slots * (1 + 4 * 4)
        return self._lists.nbytes(num_slots) + columns + self.tuner.nbytes()

    def _label_of(self, slot: int) -> tuple[Group, int]:
        """The slot's list: its tenant group's, of its class."""
        return self._group_of(slot), min(self._touches[slot] - 1, NUM_CLASSES - 1)

    # -- what the store tells -------------------------------------------------------------

    def touch(self, slot: int) -> None:
        touches = self._touches[slot]
        if not touches:  # a block the store holds from now on
            self._num_held += 1
            touches = 1
        elif touches < 255:
            touches += 1
        self._touches[slot] = touches
        self.tuner.access(sample_hash(self._key_of(slot)), min(touches - 1, NUM_CLASSES - 1))
        self._lists.push(slot, self._lists.list_of(self._label_of(slot)))

    def touch_many(self, slots: np.ndarray) -> None:
        # Each touch counts towards the block's class and the tuner's odds: one at a time.
        for slot in slots.tolist():
            self.touch(slot)

    def remove(self, slot: int) -> None:
        self._lists.remove(slot)

    def remove_many(self, slots: np.ndarray) -> None:
        self._lists.remove_many(slots)

    def forget(self, slot: int) -> None:
        if self._resume is not None and slot in self._resume:
            self._resume = None
        if self._touches[slot]:
            self._num_held -= 1
        self._touches[slot] = 0
        self._detach(slot)
        child = self._first_child[slot] - 1  # a deleted prefix's extensions: roots now
        while child >= 0:
            following = self._next_sibling[child] - 1
            self._parent[child] = self._prev_sibling[child] = self._next_sibling[child] = 0
            child = following
        self._first_child[slot] = 0

    def _detach(self, slot: int) -> None:
        """Take the slot out of its parent's children."""
        parent = self._parent[slot] - 1
        if parent < 0:
            return
        before, after = self._prev_sibling[slot], self._next_sibling[slot]  # (+ 1)
        if before:
            self._next_sibling[before - 1] = after
        else:
            self._first_child[parent] = after
        if after:
            self._prev_sibling[after - 1] = before
        self._parent[slot] = self._prev_sibling[slot] = self._next_sibling[slot] = 0

    def link(self, slot: int, parent: int) -> None:
        if parent == slot or not self._touches[parent] or self._parent[slot]:
            return
        if self._first_child[slot]:
            return  # (a block with extensions already is not a new one: no cycles)
        first = self._first_child[parent]
        self._parent[slot] = parent + 1
        self._next_sibling[slot] = first
        if first:
            self._prev_sibling[first - 1] = slot + 1
        self._first_child[parent] = slot + 1

    # -- choosing victims -------------------------------------------------------------------

    def victims(self, allowed: Allowed | None = None) -> Iterator[int]:
        # The miniatures simulate the memory the node really holds (known once it evicts).
        self.tuner.resize(self._num_held)
        # LRUPolicy.victims' pass over the lists' heads, with the leaves first: written out
        # again, since a shared pass (a generator and a callback) cost ~3% of an evicting
        # put, measured (docs/benchmarks-log.md, "One house, second pass").
        budget = len(self._lists)
        heads = self._lists.heads
        while budget > 0:
            slot, number = self._head(allowed)
            if slot == NONE:
                return
            yield from self._leaves_first(slot)
            if self._touches[slot] and heads[number] == slot:
                budget -= 1
                self._requeue(slot)  # kept (or an extension of it is): behind the others

    def _leaves_first(self, root: int) -> Iterator[int]:
        """``root``'s extensions, each after its own (they are no use without it), then
        ``root``; it stops at the first the caller keeps, with whatever it extends.  Where
        the caller stopped after an eviction, the next walk from ``root`` goes on from
        there (one block at a time, a chain is walked down once, not once a block)."""
        node = root
        if self._resume is not None and self._resume[0] == root:
            node = self._resume[1]
        self._resume = None
        while True:
            child = self._first_child[node] - 1
            while child >= 0:  # (each step down is a visit too: counted)
                self.num_visited += 1
                node, child = child, self._first_child[child] - 1
            parent = self._parent[node] - 1
            self.num_visited += 1
            try:
                yield node
            except GeneratorExit:
                if not self._touches[node] and node != root and parent >= 0:
                    self._resume = (root, parent)
                raise
            if node == root:
                return
            if self._touches[node]:  # kept: so is every block it extends, behind the others
                self._requeue_path(parent, root)
                return
            node = parent

    def _requeue_path(self, node: int, root: int) -> None:
        """Move the blocks from ``node`` up to ``root`` (not included) behind the others of
        their lists: they stay with an extension kept, and a later pass must not walk down
        to it again from each of them."""
        while node >= 0 and node != root:
            self.num_visited += 1
            if self._lists.is_listed(node):
                self._requeue(node)
            node = self._parent[node] - 1

    def _head(self, allowed: Allowed | None) -> tuple[int, int]:
        """The head, among the lists of the groups ``allowed`` admits now, whose age over
        its class's weight is largest, and its list's number (NONE, NONE: none)."""
        best, best_number, best_score = NONE, NONE, -1.0
        stamp, clock, weights = self._lists.stamp, self._lists.clock, self.tuner.weights
        labels = self._lists.labels
        for number, head in enumerate(self._lists.heads):
            if head == NONE:
                continue
            group, cls = labels[number]
            if allowed is not None and not allowed(group):
                continue
            score = (clock - stamp(head)) / weights[cls]
            if score > best_score:
                best, best_number, best_score = head, number, score
        return best, best_number

    def _requeue(self, slot: int) -> None:
        """A candidate the caller kept goes behind the others of its list (not a read)."""
        self._lists.push(slot, self._lists.where(slot))

    # -- groups and restarts ----------------------------------------------------------------

    def regroup(self, group_of: GroupOf | None) -> None:
        """Sort the listed slots into new groups, keeping their order and classes (at a
        reload of the tenants: it visits every listed slot once)."""
        self._group_of = group_of or _nobody
        self._lists.relist(self._label_of)

    def adopt(self, slots: np.ndarray) -> None:
        """A warm restart's blocks, oldest first: held, never read (what they were is not
        kept), listed in order."""
        if not len(slots):
            return
        self._touches_column[slots] = 1
        self._num_held += len(slots)
        if len(self._lists) or len(self._lists.labels) > 1:
            for slot in slots.tolist():
                self._lists.push(slot, self._lists.list_of(self._label_of(slot)))
            return
        self._lists.push_many(slots)

    def recency(self, slots: np.ndarray) -> np.ndarray:
        """When each slot was last touched or kept (larger: more recent)."""
        return self._lists.stamps(slots)


def _nobody(slot: int) -> Group:
    return None
