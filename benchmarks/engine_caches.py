"""Two levels: N engines, each with its own prefix cache, above one pool — when the
connector saves (``eager``, ``evicting`` or ``auto``: :mod:`kvpool.integrations.vllm.saving`)
and what it buys, on a Mooncake-format trace.

    .venv/bin/python -m benchmarks.engine_caches --trace TRACE|agents --engines 1 \\
        --engine-cache 3M --pool 3M,10M [--routing round-robin,prefix,prefix-balanced] \\
        [--save eager,evicting,auto] [--eviction lru,learned] [--requests N] [--json]

The model, in this process:

- an engine's own cache is a block LRU of ``--engine-cache`` tokens, as vLLM's free queue: a
  request's blocks are touched leaf first, so that among blocks used together a prefix's
  leaves are dropped before its root (vLLM frees a request's blocks in that order);
- the pool is the node's own store (:class:`~kvpool.store.block_store.BlockStore`, the
  policy ``--eviction`` names) holding ``--pool`` tokens, every block one arena page;
- per request, routed to an engine (``round-robin``; ``prefix``: the engine whose cache
  holds the longest prefix of it, ties in turn; ``prefix-balanced``: that engine where its
  prefix covers at least half the request, else the one that has had the fewest requests):
  the engine's longest cached prefix is its own hit; the pool's longest run of blocks
  after it is loaded (the pool's hit); the rest is computed; loaded and computed blocks
  enter the engine's cache;
- ``eager`` puts every computed block into the pool at once; ``evicting`` puts a block
  when the engine's cache drops it, unless the pool holds it; ``auto`` runs the connector's
  own decision (:class:`~kvpool.integrations.vllm.saving.SavePlan`) per engine;
- full blocks only (the partial last block is neither looked up nor stored); the first half
  of the trace warms the caches, the second half is measured: the pool's hit rate is the
  tokens it served over the input tokens (``pool``), beside the engines' own (``engines``).

``agents``: a synthetic long-prompt agent trace (:func:`agent_trace`): agents of a few kinds,
each kind's system prompt and tool descriptions shared (8k-32k tokens), sessions whose
context grows by a tool call's result between calls, many sessions interleaved.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from benchmarks.trace_models import Trace, TraceRequest, blocks_for
from benchmarks.traces import STAND_IN_BYTES, _sizes, block_hash, key_of
from kvpool.config import PAGE_BYTES
from kvpool.integrations.vllm.saving import AUTO, EAGER, EVICTING, SavePlan
from kvpool.keys import BlockOrigin
from kvpool.store.block_store import BlockStore
from kvpool.store.policies import new_policy

ROUTINGS = ("round-robin", "prefix", "prefix-balanced")


def agent_trace(num_requests: int = 10_000, seed: int = 0, block_tokens: int = 512) -> Trace:
    """Agents of 8 kinds, each kind's prompt (system prompt and tools) shared, 8k-32k
    tokens; 48 sessions at a time, interleaved, each 5-20 calls whose context grows by
    0.5k-2k tokens (a tool's result) per call; a session that ends is replaced by a new one."""
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 62))
    kinds = [rng.randrange(8_000, 32_001) for _ in range(8)]
    kind_ids = [[next(next_id) for _ in range(n // block_tokens)] for n in kinds]

    def new_session() -> dict[str, Any]:
        kind = rng.randrange(len(kinds))
        return {
            "kind": kind,
            "length": kinds[kind] + rng.randrange(200, 2_000),  # the task
            "calls": rng.randrange(5, 21),
            "ids": list(kind_ids[kind]),
        }

    sessions = [new_session() for _ in range(48)]
    requests = []
    timestamp = 0
    while len(requests) < num_requests:
        i = rng.randrange(len(sessions))
        session = sessions[i]
        full = session["length"] // block_tokens
        while len(session["ids"]) < full:  # the session's own blocks, once full
            session["ids"].append(next(next_id))
        partial = [next(next_id)] if session["length"] % block_tokens else []
        requests.append(TraceRequest(timestamp, session["length"], (*session["ids"], *partial)))
        timestamp += 100
        session["length"] += rng.randrange(500, 2_001)
        session["calls"] -= 1
        if session["calls"] == 0:
            sessions[i] = new_session()
    return Trace(requests, block_tokens)


def load_trace(name: str, num_requests: int) -> Trace:
    if name == "agents":
        return agent_trace(num_requests or 10_000)
    return Trace.read(name, num_requests)


class EngineCache:
    """An engine's own prefix cache: an LRU of block ids."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for block_id in ids:
            if block_id not in self.blocks:
                break
            n += 1
        return n

    def use(self, ids: Sequence[int]) -> list[int]:
        """Touch (or insert) ``ids``, leaf first; the blocks dropped to make room."""
        blocks = self.blocks
        for block_id in reversed(ids):
            blocks[block_id] = None
            blocks.move_to_end(block_id)
        dropped = []
        while len(blocks) > self.capacity:
            dropped.append(blocks.popitem(last=False)[0])
        return dropped


@dataclass
class Counts:
    input_tokens: int = 0
    engine_tokens: int = 0
    pool_tokens: int = 0
    decisions: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        total = max(self.input_tokens, 1)
        return {
            "engines": round(self.engine_tokens / total, 4),
            "pool": round(self.pool_tokens / total, 4),
            "total": round((self.engine_tokens + self.pool_tokens) / total, 4),
        }


class Pool:
    """The node's store, in this process."""

    def __init__(self, capacity_blocks: int, eviction: str):
        self.store = BlockStore(
            capacity_blocks * PAGE_BYTES,
            eviction=new_policy(eviction),
            high_watermark=1.0,
            low_watermark=1.0,
        )

    def run(self, ids: Sequence[int]) -> int:
        """The longest run of ``ids`` the pool holds, read (pinned and unpinned)."""
        keys = [key_of(i) for i in ids]
        num_found, _ = self.store.lookup(keys)
        if not num_found:
            return 0
        pinned = self.store.pin(keys[:num_found], owner=1, prefix=True)
        num = sum(1 for block in pinned.blocks if block is not None)
        if pinned.pin_id:
            self.store.unpin(pinned.pin_id)
        return num

    def put(self, ids: Sequence[int], parents: dict[int, int]) -> None:
        held = self.store.lookup_mask([key_of(i) for i in ids], count=False)
        missing = [i for i, is_held in zip(ids, held, strict=True) if not is_held]
        if not missing:
            return
        keys = [key_of(i) for i in missing]
        reserved = self.store.reserve(keys, [STAND_IN_BYTES] * len(keys), owner=1)
        if not reserved.reservation_id:
            return
        origins = [
            BlockOrigin(token_ids=[], parent=block_hash(parents[i]) if i in parents else b"")
            for i in missing
        ]
        self.store.commit(reserved.reservation_id, [0] * len(keys), 1, origins)


def _route(
    routing: str, engines: list[EngineCache], ids: Sequence[int], n: int, routed: list[int]
) -> int:
    """The engine request ``n`` goes to: in turn; to the longest cached prefix (ties in
    turn); or to the longest cached prefix where it covers at least half the request, else
    to the engine that has had the fewest requests (SGLang's cache-aware router balances
    so: plain ``prefix`` sends every conversation that starts alike to one engine)."""
    num_engines = len(engines)
    if routing == "round-robin":
        return n % num_engines
    lengths = [e.prefix(ids) for e in engines]
    best = max(lengths)
    if routing == "prefix-balanced" and 2 * best < len(ids):
        return min(range(num_engines), key=lambda k: (routed[k], (k - n) % num_engines))
    candidates = [k for k, length in enumerate(lengths) if length == best]
    return min(candidates, key=lambda k: (k - n) % num_engines)


def replay(
    trace: Trace,
    num_engines: int,
    engine_blocks: int,
    pool_blocks: int,
    routing: str,
    save: str,
    eviction: str,
) -> dict[str, Any]:
    engines = [EngineCache(engine_blocks) for _ in range(num_engines)]
    plans = [SavePlan(save) for _ in range(num_engines)]
    for plan in plans:  # what vLLM's block pool tells the connector: caching on
        plan.bind(SimpleNamespace(enable_caching=True, num_gpu_blocks=engine_blocks), 0)
    pool = Pool(pool_blocks, eviction)
    parents: dict[int, int] = {}
    counts = Counts()
    measured_from = len(trace.requests) // 2
    routed = [0] * num_engines
    bt = trace.block_tokens
    for n, (request, ids) in enumerate(trace.sequence(store_partial=False)):
        for i in range(1, len(ids)):
            parents.setdefault(ids[i], ids[i - 1])
        which = _route(routing, engines, ids, n, routed)
        routed[which] += 1
        engine, plan = engines[which], plans[which]
        num_local = engine.prefix(ids)
        num_pool = pool.run(ids[num_local:])
        loaded = ids[num_local : num_local + num_pool]
        computed = ids[num_local + num_pool :]
        if loaded:
            plan.loaded([block_hash(i) for i in loaded])
        was_eager = plan.is_eager
        dropped = engine.use(ids)
        if was_eager and computed:
            pool.put(computed, parents)
            plan.saved(block_hash(i) for i in computed)
        elif not was_eager and dropped:
            pool.put(dropped, parents)
            plan.saved(block_hash(i) for i in dropped)
        if n >= measured_from:
            counts.input_tokens += request.input_length
            local_tokens = min(num_local * bt, request.input_length)
            counts.engine_tokens += local_tokens
            counts.pool_tokens += (
                min((num_local + num_pool) * bt, request.input_length) - local_tokens
            )
    out = counts.as_dict()
    out["busiest_engine_share"] = round(max(routed) / max(sum(routed), 1), 3)
    if save == AUTO:
        out["auto_chose"] = [plan.current for plan in plans]
        out["auto_decisions"] = sum(plan.num_decisions for plan in plans)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="a Mooncake-format trace, or 'agents'")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--engine-cache", default="3M", help="tokens each engine caches")
    parser.add_argument("--pool", default="3M", help="the pool's tokens, comma-separated")
    parser.add_argument("--routing", default="round-robin", help="round-robin,prefix")
    parser.add_argument("--save", default=f"{EAGER},{EVICTING},{AUTO}")
    parser.add_argument("--eviction", default="lru", help="the pool's policies: lru,learned")
    parser.add_argument("--requests", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, args.requests)
    (engine_tokens,) = _sizes(args.engine_cache)
    engine_blocks = blocks_for(engine_tokens, trace.block_tokens)
    rows = []
    for pool_tokens in _sizes(args.pool):
        for routing in args.routing.split(","):
            for eviction in args.eviction.split(","):
                row: dict[str, Any] = {
                    "engines": args.engines,
                    "engine_cache_tokens": engine_tokens,
                    "pool_tokens": pool_tokens,
                    "routing": routing,
                    "eviction": eviction,
                }
                for save in args.save.split(","):
                    started = time.perf_counter()
                    row[save] = replay(
                        trace,
                        args.engines,
                        engine_blocks,
                        blocks_for(pool_tokens, trace.block_tokens),
                        routing,
                        save,
                        eviction,
                    )
                    row[save]["seconds"] = round(time.perf_counter() - started, 1)
                rows.append(row)
                if not args.json:
                    print(json.dumps(row), flush=True)
    if args.json:
        sys.stdout.write(json.dumps({"trace": args.trace, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
