"""Which copy of a block a parallel rank saves and loads: engine-neutral.

Tensor parallelism shards attention heads across ranks, so each rank's KV is its own shard:
a rank saves and loads under its own namespace (its ``tp_rank``).  Multi-head latent
attention (MLA) caches no heads, only one latent per token that every rank holds whole and
alike: the ranks share one copy, under the namespace of rank 0, which rank 0 alone writes
and every rank reads.  The tensor-parallel size stays in the namespace either way (ranks of
another size computed their latents with other reductions, so their blocks are not
interchangeable).  Pipeline-parallel ranks hold different layers: each keeps its own.
"""

from __future__ import annotations

import msgspec

from kvpool.keys import Namespace


def rank_namespace(engine: Namespace, tp_rank: int, pp_rank: int) -> Namespace:
    """The namespace rank (``tp_rank``, ``pp_rank``) of an engine saves and loads under;
    ``engine`` is the engine's namespace with any ranks (they are replaced)."""
    shared_rank = 0 if engine.is_mla else tp_rank
    return msgspec.structs.replace(engine, tp_rank=shared_rank, pp_rank=pp_rank)


def writes_blocks(engine: Namespace, tp_rank: int) -> bool:
    """Whether rank ``tp_rank`` writes its blocks to the pool: every rank of a sharded
    cache, only rank 0 of a cache every rank holds alike (MLA)."""
    return not engine.is_mla or tp_rank == 0
