"""A Mooncake-format trace, and the caches it is replayed against in this process: a plain
block LRU and Belady's optimum, the yardsticks of ``benchmarks/traces.py``.

The trace (Mooncake, FAST'25; see ``../shared/traces/README.md`` of the project's notes):
JSON lines, one request each, ``{"timestamp": ms, "input_length": tokens, "hash_ids": [...]}``,
where ``hash_ids`` are chained prefix-block ids (the same id means the same whole prefix up to
that block) of ``block_tokens`` tokens each; the last block is partial when the input is not
a whole number of blocks.

The replay rules, the same for every cache here and for a real node:

- per request, the longest stored prefix of its blocks is a hit (read); the blocks after it
  are stored (put), in order; a hit block is touched (read) in order before the put;
- an engine saves full blocks only: the partial last block is neither looked up nor stored,
  unless ``store_partial`` (the trace README's plain LRU curve stores it);
- the hit rate in tokens counts ``min(hit blocks x block_tokens, input_length)`` over the
  input tokens; in full blocks, the hit full blocks over the full blocks of the inputs.
"""

from __future__ import annotations

import heapq
import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_TOKENS = 512  # the Mooncake traces' block
NEVER = 1 << 62  # the next use of a block that is not used again


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    block_tokens: int = BLOCK_TOKENS

    @classmethod
    def read(cls, path: str | Path, limit: int = 0, block_tokens: int = BLOCK_TOKENS) -> Trace:
        """The first ``limit`` requests (0: all) of a JSON-lines trace file."""
        requests = []
        with open(path) as f:
            for line in f:
                if limit and len(requests) == limit:
                    break
                if not line.strip():
                    continue
                record = json.loads(line)
                requests.append(
                    TraceRequest(
                        int(record.get("timestamp", 0)),
                        int(record["input_length"]),
                        tuple(int(i) for i in record["hash_ids"]),
                    )
                )
        return cls(requests, block_tokens)

    def stored_ids(self, request: TraceRequest, store_partial: bool) -> tuple[int, ...]:
        """The blocks of a request that are looked up and stored (see the module's rules)."""
        if store_partial or request.input_length % self.block_tokens == 0:
            return request.hash_ids
        return request.hash_ids[:-1]

    def sequence(self, store_partial: bool) -> Iterator[tuple[TraceRequest, tuple[int, ...]]]:
        for request in self.requests:
            yield request, self.stored_ids(request, store_partial)

    def distinct_blocks(self, store_partial: bool) -> int:
        return len({i for _, ids in self.sequence(store_partial) for i in ids})


@dataclass
class HitCounter:
    """Hit rates of a replay, in tokens (capped at the input) and in full blocks."""

    block_tokens: int = BLOCK_TOKENS
    hit_tokens: int = 0
    input_tokens: int = 0
    hit_full_blocks: int = 0
    full_blocks: int = 0
    num_requests: int = 0

    def add(self, request: TraceRequest, num_hit: int) -> None:
        full = request.input_length // self.block_tokens
        self.hit_tokens += min(num_hit * self.block_tokens, request.input_length)
        self.input_tokens += request.input_length
        self.hit_full_blocks += min(num_hit, full)
        self.full_blocks += full
        self.num_requests += 1

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / max(self.input_tokens, 1)

    @property
    def block_rate(self) -> float:
        return self.hit_full_blocks / max(self.full_blocks, 1)

    def as_dict(self) -> dict[str, float]:
        return {"tokens": round(self.token_rate, 4), "full_blocks": round(self.block_rate, 4)}


@dataclass
class Curve:
    """What a model gave at each capacity (in blocks)."""

    name: str
    points: dict[int, HitCounter] = field(default_factory=dict)


def synthetic_trace(num_requests: int, seed: int = 0) -> Trace:
    """A Mooncake-format trace of multi-turn conversations, shaped like the published
    conversation trace (a shared first block; about 4 in 10 requests continue an earlier
    conversation, late or soon, by a heavy-tailed gap; a few new blocks per turn, many for a
    first turn; a partial last block, which the next turn extends into a new one): for
    tests, which must not need the real file."""
    rng = random.Random(seed)
    next_id = 1
    conversations: list[list[int]] = []  # full blocks of each, by when last used
    requests = []
    for n in range(num_requests):
        if conversations and rng.random() < 0.4:
            gap = min(len(conversations), 1 + int(rng.lognormvariate(4.0, 1.2)))
            full = conversations.pop(len(conversations) - gap)
            added = rng.choice((1, 1, 2, 3, 5, 8, 13))
        else:
            full = [0]
            added = rng.randint(2, 40)
        ids = full + list(range(next_id, next_id + added))
        next_id += added
        partial = rng.randrange(BLOCK_TOKENS)  # tokens short of a whole last block
        conversations.append(ids[:-1] if partial else ids)
        requests.append(TraceRequest(n * 100, len(ids) * BLOCK_TOKENS - partial, tuple(ids)))
    return Trace(requests)


def blocks_for(tokens: float, block_tokens: int = BLOCK_TOKENS) -> int:
    """A capacity in tokens as whole blocks."""
    return max(1, int(tokens // block_tokens))


def lru(trace: Trace, capacity: int, store_partial: bool = False) -> HitCounter:
    """A plain block LRU of ``capacity`` blocks under the replay rules."""
    cache: OrderedDict[int, None] = OrderedDict()
    counter = HitCounter(trace.block_tokens)
    for request, ids in trace.sequence(store_partial):
        num_hit = _prefix_in(ids, cache)
        counter.add(request, num_hit)
        for block in ids:
            if block in cache:
                cache.move_to_end(block)
                continue
            cache[block] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return counter


def belady(trace: Trace, capacity: int, store_partial: bool = False) -> HitCounter:
    """Belady's optimum of ``capacity`` blocks: on a miss, the block used farthest in the
    future leaves (one never used again is not admitted at all).  It knows the future: an
    upper bound, never a policy."""
    sequence = list(trace.sequence(store_partial))
    next_uses = _next_uses([ids for _, ids in sequence])
    held: dict[int, int] = {}  # block -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), lazily pruned
    counter = HitCounter(trace.block_tokens)
    position = 0
    for (request, ids), uses in zip(sequence, next_uses, strict=True):
        counter.add(request, _prefix_in(ids, held))
        for block, next_use in zip(ids, uses, strict=True):
            position += 1
            if block in held:
                held[block] = next_use
                heapq.heappush(farthest, (-next_use, block))
                continue
            if next_use == NEVER:
                continue
            if len(held) >= capacity and not _make_room(held, farthest, next_use):
                continue
            held[block] = next_use
            heapq.heappush(farthest, (-next_use, block))
    return counter


def _make_room(held: dict[int, int], farthest: list[tuple[int, int]], next_use: int) -> bool:
    """Evict the held block used farthest ahead if it is used later than ``next_use``;
    whether room was made (else the new block is not worth admitting)."""
    while farthest:
        negative, block = farthest[0]
        if held.get(block) != -negative:
            heapq.heappop(farthest)  # stale
            continue
        if -negative <= next_use:
            return False
        heapq.heappop(farthest)
        del held[block]
        return True
    return False


def _next_uses(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per reference, the position of the block's next reference (NEVER: none)."""
    total = sum(len(ids) for ids in sequences)
    following: dict[int, int] = {}
    flat = [0] * total
    position = total
    for ids in reversed(sequences):
        for block in reversed(ids):
            position -= 1
            flat[position] = following.get(block, NEVER)
            following[block] = position
    out = []
    position = 0
    for ids in sequences:
        out.append(flat[position : position + len(ids)])
        position += len(ids)
    return out


def _prefix_in(ids: Iterable[int], held: dict[int, int] | OrderedDict[int, None]) -> int:
    num = 0
    for block in ids:
        if block not in held:
            break
        num += 1
    return num
