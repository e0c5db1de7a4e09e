"""The pool's value on real traffic: a Mooncake-format trace replayed against real nodes
through the SDK, beside a plain LRU and Belady's optimum of the same capacity computed in
this process over the same sequence (``benchmarks/trace_models.py``).

    .venv/bin/python -m benchmarks.traces replay --trace TRACE --capacity 3M,10M,50M \\
        [--eviction lru,POLICY] [--requests N] [--store-partial] [--transport shm|tcp] [--json]
    .venv/bin/python -m benchmarks.traces cluster --trace TRACE --nodes 10 --capacity 3M \\
        [--eviction lru] [--json]

``replay``: one node per capacity (given in tokens: ``3M`` is 3,000,000 tokens, a block of
the trace's 512 tokens each) and policy.  The node's arena holds exactly that many blocks:
stand-in blocks of one 4 KiB page each, and eviction on demand only (both watermarks at 1),
so that its capacity is the models'.  Per request: a lookup of the request's blocks, a get
of the hit prefix (what is delivered counts: the hit), a put of the rest (the replay rules
are ``trace_models``'s).  It reports the hit rate in tokens and in full blocks, the plain
LRU's and the optimum's, and the latency of each kind of call (p50, p99, max).

``cluster``: the paper's Figure 10.  ``--nodes`` separate single nodes of ``--capacity``
each, the requests dealt round-robin among them (each node sees every N-th request, as an
engine that only has its host's cache); then the same nodes as one cluster on loopback
(``--peers``), each request through a client whose local node is its engine's, as users run
a cluster (writes land locally and are written through to the keys' homes; reads try the
local node, then the homes).  Beside them, the in-process LRU of one node and of all of
their memory as one cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.trace_models import HitCounter, Trace, belady, blocks_for, lru
from kvpool import Client, Namespace
from kvpool.config import PAGE_BYTES
from kvpool.harness.process import NodeProcess
from kvpool.keys import BlockOrigin
from kvpool.stats import ESTIMATE_SCALES
from kvpool.store.block_store import BlockStore
from kvpool.store.policies import new_policy

STAND_IN_BYTES = PAGE_BYTES  # a block's payload: one arena page
NAMESPACE = Namespace(model="mooncake-trace")
CALL_TIMEOUT_S = 30.0


@dataclass
class CallTimes:
    """Per kind of call, how long each took (seconds)."""

    kind_to_seconds: dict[str, list[float]] = field(default_factory=dict)

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.kind_to_seconds.setdefault(kind, []).append(time.perf_counter() - started)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind, seconds in self.kind_to_seconds.items():
            values = np.asarray(seconds) * 1000
            out[kind] = {
                "calls": len(values),
                "p50_ms": round(float(np.percentile(values, 50)), 3),
                "p99_ms": round(float(np.percentile(values, 99)), 3),
                "max_ms": round(float(values.max()), 3),
            }
        return out


def block_hash(block_id: int) -> bytes:
    return block_id.to_bytes(8, "big")


def key_of(block_id: int) -> bytes:
    return NAMESPACE.key(block_hash(block_id))


def origins_of(ids: Sequence[int], start: int) -> list[BlockOrigin | None]:
    """What an engine tells the pool of each block it saves from ``ids[start]`` on: the
    block before it in its prefix (no tokens: the trace has none)."""
    return [
        BlockOrigin(token_ids=[], parent=block_hash(ids[i - 1]) if i else b"")
        for i in range(start, len(ids))
    ]


def replay(
    trace: Trace,
    client_of: Callable[[int], Client],
    store_partial: bool = False,
    times: CallTimes | None = None,
) -> HitCounter:
    """Replay ``trace`` through the clients (``client_of(i)`` serves request ``i``): per
    request a lookup, a get of the hit prefix, a put of the rest."""
    counter = HitCounter(trace.block_tokens)
    times = times if times is not None else CallTimes()
    payload = np.zeros(STAND_IN_BYTES, dtype=np.uint8)
    buffers = [np.empty(STAND_IN_BYTES, dtype=np.uint8) for _ in range(_longest(trace))]
    for i, (request, ids) in enumerate(trace.sequence(store_partial)):
        client = client_of(i)
        keys = [key_of(block_id) for block_id in ids]
        with times.timed("lookup"):
            num_found = client.lookup(keys)
        num_hit = 0
        if num_found:
            with times.timed("get"):
                got = client.get(keys[:num_found], buffers[:num_found], prefix=True)
            num_hit = got.num_prefix
        counter.add(request, num_hit)
        rest = keys[num_hit:]
        if rest:
            origins = origins_of(ids, num_hit)
            with times.timed("put"):
                client.put(rest, [payload] * len(rest), origins=origins)
    return counter


def replay_store(
    trace: Trace, capacity_blocks: int, eviction: str, store_partial: bool = False
) -> HitCounter:
    """The replay against the node's store in this process (no daemon, no sockets): the
    same policy code, for quick sweeps; the figures come from real nodes."""
    store = BlockStore(
        capacity_blocks * PAGE_BYTES,
        eviction=new_policy(eviction),
        high_watermark=1.0,
        low_watermark=1.0,
    )
    counter = HitCounter(trace.block_tokens)
    for request, ids in trace.sequence(store_partial):
        keys = [key_of(block_id) for block_id in ids]
        num_found, _ = store.lookup(keys)
        pinned = store.pin(keys[:num_found], owner=1, prefix=True)
        num_hit = sum(1 for block in pinned.blocks if block is not None)
        if pinned.pin_id:
            store.unpin(pinned.pin_id)
        counter.add(request, num_hit)
        rest = keys[num_hit:]
        if rest:
            reserved = store.reserve(rest, [STAND_IN_BYTES] * len(rest), owner=1)
            if reserved.reservation_id:
                origins = origins_of(ids, num_hit)
                store.commit(reserved.reservation_id, [0] * len(rest), 1, origins)
    return counter


def _longest(trace: Trace) -> int:
    return max((len(r.hash_ids) for r in trace.requests), default=0)


def node_args(capacity_blocks: int, eviction: str) -> tuple[int, list[str]]:
    """The arena of a node that holds exactly ``capacity_blocks`` stand-in blocks, and the
    flags that make it evict on demand only, with ``eviction``'s policy."""
    memory = capacity_blocks * STAND_IN_BYTES
    extra = ["--high-watermark", "1", "--low-watermark", "1", "--eviction", eviction]
    extra += ["--scrub-rate", "0"]
    return memory, extra


def replay_node(
    trace: Trace,
    capacity_blocks: int,
    eviction: str,
    run_dir: str,
    store_partial: bool = False,
    transport: str = "shm",
) -> dict[str, Any]:
    """One node of ``capacity_blocks`` with ``eviction``, the trace replayed against it."""
    memory, extra = node_args(capacity_blocks, eviction)
    node = NodeProcess.private(f"trace-{eviction}", memory, run_dir=run_dir, extra=extra)
    times = CallTimes()
    with node:
        address = node.unix_address if transport == "shm" else node.tcp_address
        with Client(address, use_shm=transport == "shm", timeout=CALL_TIMEOUT_S) as client:
            started = time.perf_counter()
            counter = replay(trace, lambda i: client, store_partial, times)
            seconds = time.perf_counter() - started
            stats = client.stats()
    dram = stats.tiers[0] if stats.tiers else None
    return {
        "eviction": eviction,
        **counter.as_dict(),
        "held_blocks": stats.num_blocks,
        "evictions": stats.evictions,
        "estimates": {f"{e.scale:g}": e.hit_rate for e in dram.estimates} if dram else {},
        "seconds": round(seconds, 1),
        "calls": times.summary(),
    }


def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    trace = Trace.read(args.trace, args.requests)
    run_dir = tempfile.mkdtemp(prefix="kvpool-traces-", dir="/dev/shm")
    rows = []
    try:
        for tokens in _sizes(args.capacity):
            blocks = blocks_for(tokens, trace.block_tokens)
            row: dict[str, Any] = {"capacity_tokens": tokens, "capacity_blocks": blocks}
            row["lru"] = lru(trace, blocks, args.store_partial).as_dict()
            row["optimum"] = belady(trace, blocks, args.store_partial).as_dict()
            if args.in_process:
                row["nodes"] = [
                    {"eviction": policy, **replay_store(trace, blocks, policy).as_dict()}
                    for policy in args.eviction.split(",")
                ]
            else:
                row["nodes"] = [
                    replay_node(trace, blocks, policy, run_dir, args.store_partial, args.transport)
                    for policy in args.eviction.split(",")
                ]
            # What the node's online curve said more or less memory would buy, against the
            # LRU of that capacity (in blocks: the curve counts blocks read and written).
            row["lru_at_scales"] = {
                f"{scale:g}": lru(trace, max(1, int(scale * blocks)), args.store_partial).as_dict()[
                    "full_blocks"
                ]
                for scale in ESTIMATE_SCALES
            }
            rows.append(row)
            _print_row(row, args.json)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "trace": str(args.trace),
        "requests": len(trace.requests),
        "store_partial": args.store_partial,
        "transport": args.transport,
        "rows": rows,
    }


def _print_row(row: dict[str, Any], quiet: bool) -> None:
    if quiet:
        return
    cells = [f"{row['capacity_tokens']:.0e} tokens ({row['capacity_blocks']} blocks)"]
    cells.append(f"lru {row['lru']['tokens']:.4f}")
    cells.append(f"optimum {row['optimum']['tokens']:.4f}")
    for node in row["nodes"]:
        calls = node.get("calls", {})
        latency = " ".join(
            f"{kind} p50/p99/max {c['p50_ms']}/{c['p99_ms']}/{c['max_ms']} ms"
            for kind, c in calls.items()
        )
        cells.append(f"node[{node['eviction']}] {node['tokens']:.4f} ({latency})")
        estimates = node.get("estimates")
        if estimates:
            cells.append(
                "estimated/lru at "
                + " ".join(
                    f"{scale}x {estimates.get(scale, '-')}/{row['lru_at_scales'][scale]}"
                    for scale in row["lru_at_scales"]
                )
            )
    print(" | ".join(cells), flush=True)


# -- N nodes: local caches against one pool ------------------------------------------------


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start_nodes(
    stack: ExitStack,
    count: int,
    capacity_blocks: int,
    eviction: str,
    run_dir: str,
    clustered: bool,
) -> list[NodeProcess]:
    memory, extra = node_args(capacity_blocks, eviction)
    # Every port chosen before any node starts (a node's own choice of a free admin port
    # could take one another node is about to bind).
    free = _free_ports(2 * count)
    ports, admin_ports = free[:count], free[count:]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports) if clustered else ""
    nodes = []
    for n, (port, admin_port) in enumerate(zip(ports, admin_ports, strict=True)):
        # The last --port wins: the port chosen here, which the peer list names.
        flags = [*extra, "--host-id", f"trace-host-{n}", "--port", str(port)]
        flags += ["--admin-port", str(admin_port)]
        if clustered:
            flags += ["--peers", peers]
        node = NodeProcess.private(f"n{n}", memory, run_dir=run_dir, extra=flags)
        nodes.append(stack.enter_context(node))
    return nodes


def replay_nodes(
    trace: Trace,
    count: int,
    capacity_blocks: int,
    eviction: str,
    run_dir: str,
    clustered: bool,
    store_partial: bool,
) -> dict[str, Any]:
    """``count`` nodes of ``capacity_blocks`` each, request ``i`` served by node ``i % count``
    (its engine's host): separate nodes, or one cluster (``clustered``)."""
    times = CallTimes()
    with ExitStack() as stack:
        nodes = _start_nodes(stack, count, capacity_blocks, eviction, run_dir, clustered)
        peers = tuple(node.tcp_address for node in nodes) if clustered else ()
        clients = [
            stack.enter_context(
                Client(
                    node.unix_address,
                    peers=peers,
                    host_id=f"trace-host-{n}",
                    timeout=CALL_TIMEOUT_S,
                )
            )
            for n, node in enumerate(nodes)
        ]
        started = time.perf_counter()
        counter = replay(trace, lambda i: clients[i % count], store_partial, times)
        seconds = time.perf_counter() - started
        held = sum(client.stats().num_blocks for client in clients)
    return {
        "mode": "cluster" if clustered else "separate",
        **counter.as_dict(),
        "held_blocks": held,
        "seconds": round(seconds, 1),
        "calls": times.summary(),
    }


def _dealt(trace: Trace, count: int, which: int) -> Trace:
    return Trace(trace.requests[which::count], trace.block_tokens)


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    trace = Trace.read(args.trace, args.requests)
    count = args.nodes
    rows = []
    run_dir = tempfile.mkdtemp(prefix="kvpool-traces-", dir="/dev/shm")
    try:
        for tokens in _sizes(args.capacity):
            blocks = blocks_for(tokens, trace.block_tokens)
            # The models: each node's LRU over its share of the requests, and one LRU of
            # all their memory over every request.
            local = HitCounter(trace.block_tokens)
            for which in range(count):
                part = lru(_dealt(trace, count, which), blocks, args.store_partial)
                local.hit_tokens += part.hit_tokens
                local.input_tokens += part.input_tokens
                local.hit_full_blocks += part.hit_full_blocks
                local.full_blocks += part.full_blocks
            row: dict[str, Any] = {
                "nodes": count,
                "capacity_tokens_per_node": tokens,
                "capacity_blocks_per_node": blocks,
                "lru_local": local.as_dict(),
                "lru_global": lru(trace, count * blocks, args.store_partial).as_dict(),
                "runs": [],
            }
            for clustered in (False, True):
                row["runs"].append(
                    replay_nodes(
                        trace, count, blocks, args.eviction, run_dir, clustered, args.store_partial
                    )
                )
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"trace": str(args.trace), "requests": len(trace.requests), "rows": rows}


def _sizes(text: str) -> list[float]:
    """Capacities in tokens: ``3M,10M`` or ``3e6``."""
    sizes = []
    for part in text.split(","):
        size = part.strip()
        if size[-1:].upper() in ("K", "M", "G"):
            scale = {"K": 1e3, "M": 1e6, "G": 1e9}[size[-1].upper()]
            sizes.append(float(size[:-1]) * scale)
        else:
            sizes.append(float(size))
    return sizes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("replay", "cluster"):
        p = sub.add_parser(name)
        p.add_argument("--trace", required=True)
        p.add_argument("--capacity", default="3M", help="tokens, comma-separated: 3M,10M,50M")
        p.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
        p.add_argument("--store-partial", action="store_true", help="store partial last blocks")
        p.add_argument("--json", action="store_true")
    sub.choices["replay"].add_argument(
        "--eviction", default="lru", help="policies, comma-separated"
    )
    sub.choices["replay"].add_argument("--transport", choices=("shm", "tcp"), default="shm")
    sub.choices["replay"].add_argument(
        "--in-process", action="store_true", help="the store in this process, no daemon"
    )
    sub.choices["cluster"].add_argument("--eviction", default="lru")
    sub.choices["cluster"].add_argument("--nodes", type=int, default=10)
    args = parser.parse_args(argv)
    result = run_replay(args) if args.command == "replay" else run_cluster(args)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
