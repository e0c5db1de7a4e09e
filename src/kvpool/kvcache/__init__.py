"""``kvpool.kvcache``: an engine's paged KV cache and the pool, engine-neutral.

Every engine integration loads and saves through this package: the vLLM connector
(:mod:`kvpool.integrations.vllm`) and the EMS SDK (:mod:`kvpool.ems`).  It knows the client
and keys, never an engine.

- :mod:`.layouts`: :class:`PagedLayout`, a cache as page planes (dense, MLA latent, vLLM's
  CPU backend, CUDA flash-attention, K and V apart), detected from the engine's tensors.
- :mod:`.copies`: where the copies run: :class:`HostCopies` for a cache in host memory,
  :class:`StreamCopies` on a GPU's streams (behind a ``Runtime`` that tests replace).
- :mod:`.ranks`: which rank writes a block (:func:`writes_blocks`: every rank of a sharded
  cache, rank 0 alone of MLA's shared copy; the copy's namespace: ``Namespace.for_rank``).
- :mod:`.guard`: :class:`PoolGuard`, the one place a pool failure becomes a miss and is
  reported to the client's health monitor.
- :mod:`.loads`: :class:`Load` and :func:`load_into`: one load path, layer by layer or the
  whole request in one step.
- :mod:`.saves`: :class:`Save` (reserved, filled as layers finish, committed off the
  engine's thread), :func:`save_from` / :func:`put_batch` (copied out at once, written
  later), :func:`save_now` (the whole lifecycle at once, from a cache in host memory) and
  :func:`put_rows` (blocks the engine hands over in buffers of its own; their reading
  counterpart is :func:`read_rows`).

What an engine's adapter (an SGLang backend, say) provides is only its metadata:

1. its cache tensors, to :meth:`PagedLayout.detect` (a ``name -> tensor`` map; tensors
   shared by layers count once) or to :class:`PagedLayout` as planes;
2. a :class:`~kvpool.keys.Namespace` that says which engines' blocks are interchangeable,
   and the block hashes of each request (keys are ``namespace.keys(hashes)``);
3. per request, the block ids of its blocks in the cache (its block table);
4. its hooks' timing: when a step starts (``Copies.mark``, the point a load may fill the
   blocks after), which layer is about to run (``Load.wait_for``), which finished
   (``Save.copy``), and when the step ends (``Load.stop``, ``Save.close``).

Then: ``cache = PagedCache(copies_for(layout), PoolGuard(health, log))``, a
``Client(on_arena_mapped=cache.copies.arena_mapped)`` and :func:`load_into` / :class:`Save`.
"""

from kvpool.kvcache.cache import PagedCache, pool_rows
from kvpool.kvcache.copies import Copies, HostCopies, StreamCopies, copies_for
from kvpool.kvcache.guard import Outcome, PoolGuard
from kvpool.kvcache.layouts import PagedLayout, Plane, dense_plane
from kvpool.kvcache.loads import Load, load_into, read_rows
from kvpool.kvcache.ranks import writes_blocks
from kvpool.kvcache.saves import (
    BatchSaved,
    CopiedBlocks,
    Save,
    put_batch,
    put_rows,
    save_from,
    save_now,
)

__all__ = [
    "BatchSaved",
    "CopiedBlocks",
    "Copies",
    "HostCopies",
    "Load",
    "Outcome",
    "PagedCache",
    "PagedLayout",
    "Plane",
    "PoolGuard",
    "Save",
    "StreamCopies",
    "copies_for",
    "dense_plane",
    "load_into",
    "pool_rows",
    "put_batch",
    "put_rows",
    "read_rows",
    "save_from",
    "save_now",
    "writes_blocks",
]
