"""Kthena's cache-aware scoring, written in Python from its Go source for the tests: Kthena's
router cannot be built here (no Go toolchain new enough), so the tests read the Redis
entries the node writes the way its plugin does.

From volcano-sh/kthena at commit 3cc057284c34469fcb0ed22a12dac84b1d120719,
``pkg/kthena-router/scheduler/plugins/kvcache_aware.go``: the prompt's tokens are cut into
blocks of ``blockSizeToHash`` (the last one may be short; at most ``maxBlocksToMatch``),
each block hashed on its own; one pipelined ``HGETALL`` per block of
``matrix:kv:block:{model}@{hash}``; owners written before their pod's containers last
started are dropped; a pod scores ``100 * (leading blocks it holds) / (blocks)``, counting
only pods that hold the first block.  The hash is Kthena's, kvpool's own
(:func:`kvpool.node.kthena.kthena_hash`) checked against a direct SHA-256 here.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

BLOCK_SIZE = 16  # defaultBlockSizeToHash
MAX_BLOCKS = 128  # defaultMaxBlocksToMatch
PREFIX = "matrix:kv:block:"


def block_hashes(tokens: list[int], block_size: int = BLOCK_SIZE) -> list[int]:
    hashes = []
    for start in range(0, len(tokens), block_size):
        if len(hashes) == MAX_BLOCKS:
            break
        chunk = tokens[start : start + block_size]
        digest = hashlib.sha256(struct.pack(f">{len(chunk)}I", *chunk)).digest()
        hashes.append(struct.unpack(">Q", digest[:8])[0] & (2**63 - 1))
    return hashes


def owners(redis: Any, model: str, hashes: list[int], started: dict[str, int]) -> list[set[str]]:
    """Per block, the pods Kthena counts as holding it."""
    pipe = redis.pipeline()
    for h in hashes:
        pipe.hgetall(f"{PREFIX}{model}@{h}")
    found = []
    for fields in pipe.execute():
        pods = set()
        for raw_pod, raw_written in fields.items():
            pod, written = raw_pod.decode(), raw_written.decode()
            if pod in started and written.isdigit() and int(written) <= started[pod]:
                continue
            pods.add(pod)
        found.append(pods)
    return found


def scores(
    redis: Any,
    model: str,
    tokens: list[int],
    pods: list[str],
    started: dict[str, int] | None = None,
    block_size: int = BLOCK_SIZE,
) -> dict[str, int]:
    """What the plugin's Score gives each candidate pod that holds the prompt's first
    block (pods that hold none get no score)."""
    hashes = block_hashes(tokens, block_size)
    if not hashes:
        return {}
    per_block = [held & set(pods) for held in owners(redis, model, hashes, started or {})]
    matched = {pod: 1 for pod in per_block[0]}
    for i in range(1, len(hashes)):
        moved = False
        for pod in per_block[i]:
            if matched.get(pod) == i:
                matched[pod] = i + 1
                moved = True
        if not moved:
            break
    return {pod: int(n / len(hashes) * 100) for pod, n in matched.items()}
