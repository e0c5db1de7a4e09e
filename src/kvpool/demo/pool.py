"""``kvpool demo --pool-only``: start a node, save a conversation's KV blocks, find the
cached prefix of a follow-up turn, load it back and verify it — no engine needed."""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.client.client import Client
from kvpool.config import format_size
from kvpool.harness.process import NodeProcess
from kvpool.keys import Namespace, chained_hashes

BLOCK_TOKENS = 32
# A KV block of a small Llama: 4 layers x 2 (K, V) x 2 KV heads x 32 tokens x 64 dims, bf16.
BLOCK_SHAPE = (4, 2, 2, BLOCK_TOKENS, 64)


def run_pool_demo(console: Console) -> dict[str, object]:
    ns = Namespace(model="demo-llama", dtype="bfloat16", layout="demo", block_size=BLOCK_TOKENS)
    rng = np.random.default_rng(0)
    turn1 = rng.integers(0, 2000, 40 * BLOCK_TOKENS).tolist()
    turn2 = turn1 + rng.integers(0, 2000, 8 * BLOCK_TOKENS).tolist()
    with (
        NodeProcess.private("demo", "256MiB", log_level="info", ephemeral=True) as node,
        Client(node.unix_address) as client,
    ):
        client.describe(ns)
        keys1 = ns.keys(chained_hashes(turn1, BLOCK_TOKENS))
        blocks = [
            rng.standard_normal(BLOCK_SHAPE, dtype=np.float32).astype(np.float16) for _ in keys1
        ]
        start = time.perf_counter()
        saved = client.put(keys1, blocks)
        save_s = time.perf_counter() - start
        keys2 = ns.keys(chained_hashes(turn2, BLOCK_TOKENS))
        start = time.perf_counter()
        num_cached = client.lookup(keys2)
        lookup_s = time.perf_counter() - start
        buffers = [np.empty(BLOCK_SHAPE, np.float16) for _ in range(num_cached)]
        start = time.perf_counter()
        loaded = client.get(keys2[:num_cached], buffers)
        load_s = time.perf_counter() - start
        identical = all(np.array_equal(a, b) for a, b in zip(blocks, buffers, strict=False))
        stats = client.stats()
        block_bytes = blocks[0].nbytes
        table = Table(
            title=f"kvpool demo (pool only): node {node.info['name']} at {node.unix_address}"
        )
        table.add_column("step")
        table.add_column("what happened")
        table.add_row(
            "turn 1", f"{len(turn1)} tokens -> {len(keys1)} KV blocks of {format_size(block_bytes)}"
        )
        path = "shared memory" if client.uses_shm else "socket"
        table.add_row(
            "save",
            f"{saved.num_stored}/{len(keys1)} blocks stored in {save_s * 1e3:.1f} ms ({path})",
        )
        table.add_row(
            "turn 2",
            f"{len(turn2)} tokens -> {len(keys2)} blocks; cached prefix: {num_cached} blocks, "
            f"found in {lookup_s * 1e3:.2f} ms",
        )
        table.add_row(
            "load",
            f"{loaded.num_found} blocks loaded and checksum-verified in {load_s * 1e3:.1f} ms; "
            f"identical to what was saved: {identical}",
        )
        table.add_row(
            "recompute", f"only {len(keys2) - num_cached} new blocks of turn 2 need prefill"
        )
        table.add_row(
            "node",
            f"{stats.num_blocks} blocks, {format_size(stats.used_bytes)} of "
            f"{format_size(stats.capacity_bytes)} used",
        )
        console.print(table)
        return {
            "blocks_saved": saved.num_stored,
            "prefix_blocks": num_cached,
            "blocks_loaded": loaded.num_found,
            "identical": identical,
        }
