"""Cluster benchmark: aggregate put/get throughput with 1, 2 and 3 nodes, and the latency of
a lookup that crosses nodes.

    .venv/bin/python -m benchmarks.cluster [--json]

Each node runs on its own simulated host (a network namespace, when the machine allows it;
see tests/cluster/fabric.py), with one client process per host writing into its own node
(shared memory), each node writing through to the keys' homes over TCP; then every client
reads every key, most of them from other nodes.  Aggregate GB/s is the total payload over the
wall time of the phase.  On a machine with few cores, the nodes and clients share them:
the curve shows what the cluster costs, not how it scales on real hosts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np

BLOCK_BYTES = 512 << 10
BLOCKS_PER_CLIENT = 256  # 128 MiB per client
BATCH = 32
LOOKUP_KEYS = 1000
LOOKUP_ROUNDS = 300


def _client_phase(
    options: dict[str, Any], my_index: int, num_hosts: int, start: Any, results: Any
) -> None:
    from kvpool import Client
    from kvpool.keys import Namespace

    ns = Namespace(model="cluster-bench")
    payload = np.random.default_rng(my_index).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
    with Client(**options) as client:
        mine = [ns.key(f"{my_index}-{i}".encode()) for i in range(BLOCKS_PER_CLIENT)]
        everyone = [
            ns.key(f"{h}-{i}".encode()) for h in range(num_hosts) for i in range(BLOCKS_PER_CLIENT)
        ]
        client.lookup(mine[:1])  # connect before the clock starts
        start.wait()
        t0 = time.perf_counter()
        for i in range(0, len(mine), BATCH):
            client.put(mine[i : i + BATCH], [payload] * len(mine[i : i + BATCH]))
        put_s = time.perf_counter() - t0
        start.wait()
        buffers = [np.empty(BLOCK_BYTES, np.uint8) for _ in range(BATCH)]
        t0 = time.perf_counter()
        found = 0
        for i in range(0, len(everyone), BATCH):
            chunk = everyone[i : i + BATCH]
            found += client.get(chunk, buffers[: len(chunk)]).num_found
        get_s = time.perf_counter() - t0
        results.put(
            {
                "index": my_index,
                "put_s": put_s,
                "get_s": get_s,
                "found": found,
                "wanted": len(everyone),
            }
        )


def run_cluster(num_hosts: int) -> dict[str, Any]:
    from tests.cluster.fabric import Fabric

    fabric = Fabric()
    try:
        hosts = [fabric.add_host(chr(ord("a") + i)) for i in range(num_hosts)]
        peers = [h.tcp_address for h in hosts]
        for host in hosts:
            host.start_node(peers=peers if num_hosts > 1 else None, memory="1GiB")
        ctx = multiprocessing.get_context("spawn")
        start = ctx.Barrier(num_hosts)
        results = ctx.Queue()
        procs = []
        for i, host in enumerate(hosts):
            options = host.client_options(peers=tuple(peers) if num_hosts > 1 else (), timeout=60)
            procs.append(
                ctx.Process(target=_client_phase, args=(options, i, num_hosts, start, results))
            )
        for p in procs:
            p.start()
        rows = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        time.sleep(1)  # let write-through settle before the lookup measurement
        lookup = _cross_node_lookup(hosts, peers) if num_hosts > 1 else None
    finally:
        fabric.close()
    put_bytes = num_hosts * BLOCKS_PER_CLIENT * BLOCK_BYTES
    get_bytes = sum(r["found"] for r in rows) * BLOCK_BYTES
    return {
        "nodes": num_hosts,
        "put_gbps": round(put_bytes / max(r["put_s"] for r in rows) / 1e9, 3),
        "get_gbps": round(get_bytes / max(r["get_s"] for r in rows) / 1e9, 3),
        "get_found_fraction": round(
            sum(r["found"] for r in rows) / sum(r["wanted"] for r in rows), 4
        ),
        "cross_node_lookup": lookup,
    }


def _cross_node_lookup(hosts: list[Any], peers: list[str]) -> dict[str, Any]:
    """A client on host a looks up a 1,000-key prefix that host b wrote: the local node has
    a part of it (keys whose home it is), the other homes are asked in parallel."""
    from kvpool import Client
    from kvpool.keys import Namespace

    ns = Namespace(model="cluster-bench-lookup")
    keys = [ns.key(f"lk-{i}".encode()) for i in range(LOOKUP_KEYS)]
    with Client(**hosts[1].client_options(peers=tuple(peers))) as writer:
        writer.put(keys, [b"x" * 64] * LOOKUP_KEYS)
    time.sleep(1)
    with Client(**hosts[0].client_options(peers=tuple(peers))) as reader:
        assert reader.lookup(keys) == LOOKUP_KEYS
        times = []
        for _ in range(LOOKUP_ROUNDS):
            t0 = time.perf_counter()
            reader.lookup(keys)
            times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "num_keys": LOOKUP_KEYS,
        "p50_ms": round(1e3 * times[len(times) // 2], 3),
        "p99_ms": round(1e3 * times[int(0.99 * len(times))], 3),
        "mean_ms": round(1e3 * statistics.fmean(times), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--nodes", default="1,2,3")
    args = parser.parse_args()
    rows = [run_cluster(int(n)) for n in args.nodes.split(",")]
    if args.json:
        sys.stdout.write(json.dumps({"cases": rows}) + "\n")
        return
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
