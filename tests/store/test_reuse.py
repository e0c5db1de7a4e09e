"""The node's online miss-ratio curve (kvpool.store.reuse) against an exact LRU: stack
distances computed for every access of a generated trace."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict

import numpy as np

from kvpool.store.reuse import ReuseSampler

NUM_ACCESSES = 120_000


def generated_trace(seed: int = 5) -> list[bytes]:
    """Conversations as a pool sees them: each turn re-reads its conversation's blocks
    and adds a few; some conversations come back soon, most late or never; a shared first
    block; and a stream of one-off blocks (scans)."""
    rng = random.Random(seed)
    accesses: list[bytes] = []
    conversations: list[list[bytes]] = []
    fresh = 0
    while len(accesses) < NUM_ACCESSES:
        if conversations and rng.random() < 0.45:
            # Recent conversations come back more often (a heavy-tailed pick by age).
            age = min(len(conversations) - 1, int(rng.paretovariate(0.7)) - 1)
            chain = conversations[-1 - age]
        else:
            chain = [b"root"]
            conversations.append(chain)
        for _ in range(rng.randint(1, 12)):
            fresh += 1
            chain.append(b"c%d" % fresh)
        accesses += chain
        if rng.random() < 0.3:
            accesses += [b"scan%d" % (fresh + i) for i in range(rng.randint(1, 20))]
            fresh += 20
    return accesses[:NUM_ACCESSES]


def exact_hit_rates(accesses: list[bytes], capacities: list[int]) -> list[float]:
    """An LRU of each capacity, from each access's exact stack distance (the distinct keys
    accessed since the key's last access; Mattson et al.), counted with a Fenwick tree over
    positions that marks each key's last access."""
    n = len(accesses)
    tree = [0] * (n + 1)

    def add(position: int, delta: int) -> None:
        position += 1
        while position <= n:
            tree[position] += delta
            position += position & -position

    def prefix(position: int) -> int:  # marks at positions < position
        total = 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total

    last: dict[bytes, int] = {}
    distances = []
    for i, key in enumerate(accesses):
        before = last.get(key)
        if before is None:
            distances.append(sys.maxsize)  # a first access: a miss at any capacity
        else:
            distances.append(prefix(i) - prefix(before + 1))
            add(before, -1)
        add(i, 1)
        last[key] = i
    array = np.asarray(distances)
    return [float(np.mean(array < c)) for c in capacities]


def test_the_estimate_is_within_003_of_an_exact_lru_at_every_capacity():
    accesses = generated_trace()
    capacities = [250, 1000, 4000, 16_000]
    exact = exact_hit_rates(accesses, capacities)
    sampler = ReuseSampler()
    sampler.set_horizon(4 * capacities[-1])
    for key in accesses:
        sampler.access(hash(key), False)
    assert sampler.stride >= 3  # it sampled: a fraction of the 120,000 accesses
    estimated = sampler.hit_rates(capacities)
    assert 0.2 < exact[0] < exact[-1] < 0.95  # a curve, not a flat line
    for got, want in zip(estimated, exact, strict=True):
        assert got is not None and abs(got - want) <= 0.03, (estimated, exact)


def test_one_hot_key_does_not_swing_the_estimate():
    """A block every request reads (a shared first block) is a tenth of the accesses: its
    share of the samples is its share of the accesses, whatever its hash."""
    accesses = generated_trace(seed=9)
    capacities = [250, 4000]
    exact = exact_hit_rates(accesses, capacities)
    for seed in range(3):
        sampler = ReuseSampler(seed=seed)
        sampler.set_horizon(4 * capacities[-1])
        for key in accesses:
            sampler.access(hash(key), False)
        for got, want in zip(sampler.hit_rates(capacities), exact, strict=True):
            assert got is not None and abs(got - want) <= 0.03


def test_memory_stays_bounded_whatever_the_keys():
    sampler = ReuseSampler(max_samples=1000)
    for i in range(200_000):
        sampler.access(hash(b"k%d" % i), False)
    assert sampler.num_followed <= 1000
    for i in range(200_000, 400_000):
        sampler.access(hash(b"k%d" % i), False)
    assert sampler.num_followed <= 1000
    assert sampler.nbytes() < 1000 * 200  # what it says it may take, and that is bounded


def test_no_reuse_seen_says_nothing_and_a_changed_workload_is_followed():
    sampler = ReuseSampler(half_life=5_000)
    sampler.set_horizon(100_000)
    assert sampler.hit_rates([100.0]) == [None]
    for i in range(200_000):  # a loop over 100 keys: all hits in 200 blocks
        sampler.access(hash(b"a%d" % (i % 100)), True)
    assert (sampler.hit_rates([200.0])[0] or 0) > 0.95
    for i in range(1_000_000):  # then a loop over 10,000 keys: 200 blocks hit nothing
        sampler.access(hash(b"b%d" % (i % 10_000)), False)
    low, high = sampler.hit_rates([200.0, 20_000.0])
    assert low is not None and high is not None
    assert low < 0.2 and high > 0.8


def lru_hits(accesses: list[bytes], capacity: int) -> list[bool]:
    """Whether each access hit an LRU of ``capacity``."""
    held: OrderedDict[bytes, None] = OrderedDict()
    hits = []
    for key in accesses:
        hits.append(key in held)
        held[key] = None
        held.move_to_end(key)
        if len(held) > capacity:
            held.popitem(last=False)
    return hits


def test_anchored_at_what_the_node_hit_the_curve_is_within_003_around_it():
    """As a node reports it: the accesses it served with 1,000 blocks, and the hit rate it
    would have with half, twice and four times that."""
    accesses = generated_trace(seed=11)
    capacity = 1000
    scales = [0.5, 1.0, 2.0, 4.0]
    exact = exact_hit_rates(accesses, [int(s * capacity) for s in scales])
    sampler = ReuseSampler()
    sampler.cover(4 * capacity)
    for key, hit in zip(accesses, lru_hits(accesses, capacity), strict=True):
        sampler.access(hash(key), hit)
    estimated = sampler.hit_rates([s * capacity for s in scales], anchor=capacity)
    assert estimated[1] == sampler.observed_hit_rate  # the anchor: what it really hit
    for got, want in zip(estimated, exact, strict=True):
        assert got is not None and abs(got - want) <= 0.03, (estimated, exact)
