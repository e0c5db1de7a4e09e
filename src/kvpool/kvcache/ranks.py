"""Which rank of an engine writes a block to the pool: engine-neutral.

Tensor parallelism shards attention heads across ranks, so each rank's KV is its own shard
and every rank writes its own blocks.  Multi-head latent attention (MLA) caches no heads,
only one latent per token that every rank holds whole and alike: the ranks share one copy
(one namespace: :meth:`kvpool.keys.Namespace.for_rank`), which rank 0 alone writes and
every rank reads.
"""

from __future__ import annotations

from kvpool.keys import Namespace


def writes_blocks(engine: Namespace, tp_rank: int) -> bool:
    """Whether rank ``tp_rank`` writes its blocks to the pool: every rank of a sharded
    cache, only rank 0 of a cache every rank holds alike (MLA)."""
    return not engine.is_mla or tp_rank == 0
