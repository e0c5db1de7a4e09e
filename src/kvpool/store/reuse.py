"""What more (or less) memory would buy: the node's miss-ratio curve, estimated online.

The store tells :class:`ReuseSampler` of every block a client reads (a pin, a read through
the shared directory) or writes (a commit): the stream of accesses an LRU cache of any size
would see.  From it the sampler estimates the hit rate an LRU of any capacity would have,
without simulating one:

- **Sampled reuse times**: about one access in ``stride`` starts a sample (a random gap
  between samples, so that no periodic pattern aliases with it): its key is followed until
  its next access, whose distance in accesses is the sample's *reuse time*.  Every access
  checks whether its key is followed (one dictionary probe), and a sampled one adds it: O(1)
  per access.  Accesses, not keys, are sampled: see *Sampling*, below.
- **Bounded memory**: at most ``max_samples`` keys are followed; past it the oldest sample
  is given up, *censored* at its age (its reuse time is longer: it may never come).  The
  stride is set from the horizon the curve must see (:meth:`set_horizon`: a multiple of the
  blocks held), so that samples are rarely given up before that age.
- **Reuse times to a curve** (the AET model: Hu et al., "Kinetic modeling of data eviction
  in cache", ATC'16): with ``P(t)`` the share of accesses whose reuse time exceeds ``t``
  (Kaplan-Meier over the reuse times and the censored samples), an LRU cache of ``c``
  blocks keeps a block for the time ``T`` at which the integral of ``P`` reaches ``c``, and
  an access hits if its reuse time is under ``T``: the hit rate is ``1 - P(T)``.  Reuse
  times are kept in a log-scale histogram; a curve is computed on demand (status, metrics)
  in O(buckets).
- **Recent, not forever**: the histograms halve every ``half_life`` samples, so the curve
  follows the workload as it changes.

Capacities are in blocks; a caller with a capacity in bytes divides by the bytes a block
takes (what the node holds per block, on average).  Synchronous, touched from the store's
thread.

**Sampling**, decided here for every estimate the store makes from a sample (this curve,
and the learned policy's tuner, :mod:`kvpool.store.learned`):

- *Deterministic*: a sample depends on the stream of keys alone, never on the process or
  the clock, so that one trace replayed twice gives one result.  Python's ``hash`` is
  salted per process: the learned policy's hit rate, sampled by it, moved 0.002-0.004
  between replays of one trace.  Every choice is drawn from one seed, ``SAMPLE_SEED``.
- *What is sampled follows what the estimate needs*.  A reuse time needs only the access
  that begins it, so this sampler samples accesses, at gaps drawn from a generator seeded
  with ``SAMPLE_SEED``: one hot key, such as a prompt's shared first block, then weighs by
  how often it is accessed, not by whether it happened to fall in the sample.  A miniature
  simulation needs every access of each key it follows, so the tuner samples keys
  (SHARDS' spatial sampling): a key is in the sample if its :func:`sample_hash`, a stable
  hash of its bytes from the same seed, falls under the sampling rate's share of
  ``2**SAMPLE_HASH_BITS``.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvpool.keys import MIN_COLUMN_KEYS

SUB_BUCKETS = 8  # histogram buckets per doubling of the reuse time
MAX_REUSE_LOG2 = 48
NUM_BUCKETS = MAX_REUSE_LOG2 * SUB_BUCKETS + 1
DEFAULT_MAX_SAMPLES = 16_384  # keys followed at most: ~120 bytes each
DEFAULT_HALF_LIFE = 1 << 16  # samples
HORIZON_PER_CAPACITY = 2  # reuse times sampled up to, per block of the largest capacity
ENTRY_BYTES = 120  # an ordered dictionary's entry, its tuple and integers, about
SAMPLE_SEED = 0x6B76706F  # every sample's ("kvpo"): see the module, *Sampling*
SAMPLE_HASH_BITS = 32


def sample_hash(key: bytes) -> int:
    """The stable hash a sample of keys goes by (see the module, *Sampling*): CRC-32 of the
    key's bytes from ``SAMPLE_SEED``, as fast as Python's ``hash`` and the same in every
    process (keys are digests already: any hash that mixes their bytes samples evenly)."""
    return zlib.crc32(key, SAMPLE_SEED)


def bucket_of(reuse_time: int) -> int:
    """The histogram bucket of a reuse time of at least 1."""
    return min(NUM_BUCKETS - 1, int(math.log2(reuse_time) * SUB_BUCKETS))


# The reuse times each bucket spans: [EDGES[b], EDGES[b + 1]).
EDGES = np.exp2(np.arange(NUM_BUCKETS + 1) / SUB_BUCKETS)


class ReuseSampler:
    """Sampled reuse times of the accesses it is told of, and the LRU hit rate they imply
    at any capacity (see the module's docstring)."""

    def __init__(
        self,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        half_life: int = DEFAULT_HALF_LIFE,
        seed: int = SAMPLE_SEED,
    ):
        self.max_samples = max(1, max_samples)
        self.half_life = max(1, half_life)
        self.stride = 1  # accesses per sample, on average
        self.horizon = 0  # the reuse times sampling covers, in accesses
        self.num_accesses = 0  # every access: the clock of reuse times
        self._random = random.Random(seed)
        self._countdown = 1  # accesses until the next sample
        # Followed key hash -> when it was sampled, and the halvings done by then (a sample
        # counts 2**-(halvings since), whenever it ends: each weighs by when it began).
        self._followed: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._halvings = 0
        self._reused = np.zeros(NUM_BUCKETS)  # completed samples, by reuse time
        self._censored = np.zeros(NUM_BUCKETS)  # samples given up, by age
        self._num_samples = 0
        self._observed = np.zeros(2)  # the accesses that were reads, and all of them

    def cover(self, capacity: float) -> None:
        """Make the curve good up to ``capacity`` blocks (and every capacity asked before):
        reuse times up to ``HORIZON_PER_CAPACITY`` times it, which an LRU of that size keeps
        a block for unless more than half its accesses hit."""
        self.set_horizon(max(self.horizon, int(HORIZON_PER_CAPACITY * capacity)))

    def set_horizon(self, num_accesses: int) -> None:
        """Sample so that ``max_samples`` followed keys cover reuse times up to about
        ``num_accesses`` (what the largest capacity asked of the curve needs)."""
        self.horizon = num_accesses
        self.stride = max(1, num_accesses // self.max_samples)

    def access(self, key_hash: int, hit: bool) -> None:
        """One access of the key whose hash (Python's ``hash`` of its bytes, as the index
        keeps it) is ``key_hash``: a read of a block held (``hit``), or a write."""
        self.num_accesses += 1
        self._observe(1, hit)
        followed = self._followed
        if followed:
            sample = followed.pop(key_hash, None)
            if sample is not None:
                self._reused[bucket_of(self.num_accesses - sample[0])] += self._weight(sample)
        self._countdown -= 1
        if self._countdown <= 0:
            self._follow(key_hash)

    def access_many(self, key_hashes: Sequence[int], hit: bool) -> None:
        """:meth:`access` of each key in turn (a request's blocks).  What a batch changes
        is only the keys followed that come back in it and the accesses sampled in it (a
        few): those are found at once (a set intersection, the positions of the sampled
        accesses counted down) and taken in the batch's order; the other accesses only
        move the clock."""
        n = len(key_hashes)
        named = set(key_hashes) if n >= MIN_COLUMN_KEYS else ()
        if len(named) != n:  # a few keys, or a key twice (it may come back in the batch)
            for key_hash in key_hashes:
                self.access(key_hash, hit)
            return
        followed = self._followed
        back = followed.keys() & named if followed else ()
        returns = [i for i, key_hash in enumerate(key_hashes) if key_hash in back] if back else []
        start, observed = self.num_accesses, 0
        sample_at = self._countdown - 1  # the position of the next sampled access
        next_return = 0
        while True:
            at = returns[next_return] if next_return < len(returns) else n
            if at <= sample_at and at < n:  # a followed key came back (before any sample there)
                self.num_accesses = start + at + 1
                sample = followed.pop(key_hashes[at], None)  # (a sample may have dropped it)
                if sample is not None:
                    self._reused[bucket_of(self.num_accesses - sample[0])] += self._weight(sample)
                next_return += 1
            elif sample_at < n:
                self.num_accesses = start + sample_at + 1
                self._observe(sample_at + 1 - observed, hit)
                observed = sample_at + 1
                self._follow(key_hashes[sample_at])
                sample_at += self._countdown
            else:
                break
        self.num_accesses = start + n
        self._observe(n - observed, hit)
        self._countdown = sample_at - n + 1

    def _observe(self, num_accesses: int, hit: bool) -> None:
        if num_accesses:
            self._observed[0] += num_accesses if hit else 0
            self._observed[1] += num_accesses

    def _weight(self, sample: tuple[int, int]) -> float:
        """What a sample counts when it ends: halved since it began as the others were."""
        return 0.5 ** (self._halvings - sample[1])

    def _follow(self, key_hash: int) -> None:
        """Sample the access just made: follow its key until it comes back."""
        followed = self._followed
        self._countdown = self._random.randint(1, 2 * self.stride - 1)
        followed[key_hash] = (self.num_accesses, self._halvings)
        if len(followed) > self.max_samples:
            _, oldest = followed.popitem(last=False)
            self._censored[bucket_of(max(1, self.num_accesses - oldest[0]))] += self._weight(oldest)
        self._num_samples += 1
        if self._num_samples % self.half_life == 0:
            self._reused *= 0.5
            self._censored *= 0.5
            self._observed *= 0.5
            self._halvings += 1

    @property
    def num_followed(self) -> int:
        return len(self._followed)

    def nbytes(self) -> int:
        """The memory it takes at most, about (as many followed keys as it may follow, and
        the histograms): a node's sample fills up to it and stays there."""
        return ENTRY_BYTES * self.max_samples + self._reused.nbytes + self._censored.nbytes

    @property
    def observed_hit_rate(self) -> float:
        """The share of the accesses that were reads of blocks held (recent ones weigh more,
        as in the curve)."""
        hits, total = self._observed
        return float(hits / total) if total else 0.0

    def hit_rates(self, capacities: list[float], anchor: float | None = None) -> list[float | None]:
        """The hit rate an LRU of each capacity (in blocks) would have had on the accesses
        seen (None: no reuse seen yet to say).  ``anchor``: the capacity the accesses were
        served with; the curve is then scaled through the hit rate they really had there
        (the model gives the curve's shape, the node's own reads its level)."""
        if self._reused.sum() <= 0:
            return [None] * len(capacities)
        rates = self._model(capacities + ([anchor] if anchor else []))
        if not anchor:
            return list(rates)
        at_anchor = rates.pop()
        scale = self.observed_hit_rate / at_anchor if at_anchor > 0 else 1.0
        return [min(1.0, rate * scale) for rate in rates]

    def _model(self, capacities: list[float]) -> list[float]:
        """The AET model's hit rate at each capacity (see the module)."""
        # Kaplan-Meier: P(reuse time > the end of each bucket), the followed keys counted
        # as censored at their age now.
        censored = self._censored.copy()
        for started, halvings in self._followed.values():
            weight = 0.5 ** (self._halvings - halvings)
            censored[bucket_of(max(1, self.num_accesses - started))] += weight
        at_risk = np.cumsum((self._reused + censored)[::-1])[::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            survive = np.where(at_risk > 0, 1.0 - self._reused / at_risk, 1.0)
        above = np.cumprod(survive)  # past the end of each bucket
        below = np.concatenate(([1.0], above[:-1]))  # before each bucket
        # The blocks an LRU keeps over a bucket's span of time: the area under P(t), with P
        # falling linearly through the bucket.  Reuse times start at 1, before which P is 1.
        areas = 0.5 * (below + above) * np.diff(EDGES)
        filled = 1.0 + np.concatenate(([0.0], np.cumsum(areas)))  # at each edge
        return [self._hit_rate(c, filled, below, above) for c in capacities]

    @staticmethod
    def _hit_rate(
        capacity: float, filled: np.ndarray, below: np.ndarray, above: np.ndarray
    ) -> float:
        if capacity <= 1.0:
            return 0.0
        b = int(np.searchsorted(filled, capacity, side="right")) - 1
        if b >= len(below):  # keeps every block that comes back
            return float(1.0 - above[-1])
        # Within bucket b: how far into it the capacity is filled, and P(t) there.
        share = (capacity - filled[b]) / max(filled[b + 1] - filled[b], 1e-12)
        miss = below[b] + (above[b] - below[b]) * min(max(share, 0.0), 1.0)
        return float(1.0 - miss)
