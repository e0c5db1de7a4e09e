"""Context caching (``Ems.get_cc()``): the engine's paged KV cache, saved to and loaded from
the pool by block hash.

Loads and saves go through :mod:`kvpool.kvcache`, as the vLLM connector's do.  The calls
and what the guide's connector relies on:

- ``register_kvcache(layers)``: the paged KV cache (see :mod:`.register`).  The tensors'
  dtype and shapes, with the engine identity of :class:`CcConfig_v1`, make the key
  namespace: two engines share blocks exactly when their KV is compatible.  Each
  tensor-parallel rank has its own blocks, except with ``KVCacheType.MLA``: one latent page
  per block per layer, alike on every rank, kept once for all of them
  (:mod:`kvpool.kvcache.ranks`): rank 0 saves it, every rank loads it, and a save on another
  rank stores nothing (done at once, ``.success`` 0).
- ``exists(hashes=, option=)``: ``.success`` is the length of the longest stored prefix.
  It never raises and answers within ``option.timeout`` (a pool that cannot answer has
  nothing: 0).
- ``async_load(slot_mapping=, hashes=, offsets=, option=)`` / ``async_save(...)``: slot
  ``block_id * block_size + i`` for each block, flattened; ``offsets[j]`` is the number of
  slots of ``hashes[j]`` (a whole block).  Arguments that do not describe whole blocks of
  the registered cache raise ``EMS_INVALID_ARGUMENT`` at once.  A save copies its blocks
  out of the cache before it returns (the connector may reuse them as soon as it has).
- ``is_ready(future)`` never raises.  ``get_result(future)``: ``.success`` is how many
  leading blocks a load wrote (the rest are the connector's to recompute) or a save stored,
  ``.total`` how many were asked for.  A pool that is slow or down gives a smaller
  ``.success``, never an exception.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool.client.client import Client
from kvpool.errors import KVPoolError
from kvpool.keys import Namespace
from kvpool.kvcache.cache import PagedCache
from kvpool.kvcache.copies import copies_for
from kvpool.kvcache.guard import PoolGuard
from kvpool.kvcache.loads import load_into
from kvpool.kvcache.ranks import writes_blocks
from kvpool.kvcache.saves import CopiedBlocks, put_batch, save_from

from .cc_v1.cc_config import CcConfig_v1, KVCacheType
from .config import CcKvOption
from .errors import invalid
from .register import Registered, rebuild

log = logging.getLogger("kvpool.ems")

IO_THREADS = 2
MAX_BLOCKS_PER_CALL = 16384
_INT64 = (-(1 << 63), (1 << 63) - 1)

Ints = Sequence[int]


@dataclass
class CcResult:
    """``success`` of ``total`` blocks; a save's ``num_not_kept``: blocks the pool evicted
    to make room for it that no lower tier took, now gone (kvpool's own; the EMS SDK's two
    fields are as they were)."""

    success: int = 0
    total: int = 0
    num_not_kept: int = 0


class CcFuture:
    """A pending load or save."""

    _ids = itertools.count(1)

    def __init__(self, future: concurrent.futures.Future[CcResult], total: int, timeout_s: float):
        self.id = next(self._ids)
        self._future = future
        self.total = total
        self.timeout_s = timeout_s

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> CcResult:
        try:
            return self._future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            return CcResult(0, self.total)
        except Exception:  # a bug in a job must not reach the engine: nothing was done
            log.exception("kvpool EMS job failed")
            return CcResult(0, self.total)


class ContextCaching:
    def __init__(self, client: Client, identity: CcConfig_v1):
        self.client = client
        self.identity = identity
        # Per (write_rcache, read_local_only) of the calls' options: a client with those.
        self._clients: dict[tuple[bool, bool], Client] = {
            (client.config.write_rcache, client.config.read_local_only): client
        }
        self.registered: Registered | None = None
        self.cache: PagedCache | None = None
        self.namespace: Namespace | None = None
        self.writes = True  # whether this rank's saves reach the pool (see the module doc)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            IO_THREADS, thread_name_prefix="kvpool-ems"
        )
        self._lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------

    def register_kvcache(self, kv_caches: list[list[torch.Tensor]]) -> None:
        registered = rebuild(kv_caches)
        # The caller reads back the tensors it handed in: let it see the true layout.
        for given, true in zip(kv_caches, registered.layers, strict=True):
            if isinstance(given, list) and len(given) != len(true):
                given[:] = true
        layout = registered.layout
        identity = self.identity
        engine = Namespace(
            model=identity.model_id,
            dtype=str(layout.dtype).removeprefix("torch."),
            layout=f"ems/{identity.llm_engine}/{layout.device.type}",
            num_layers=len(registered.layers),
            is_mla=identity.kvcache_type is KVCacheType.MLA,
            tp_size=identity.tp_world_size,
            pp_size=identity.pp_world_size,
            extra=f"pages={[b - a for a, b in layout.plane_bounds]} {registered.describe}",
        )
        rank = identity.rank_in_tp_group
        self.namespace = engine.for_rank(rank, identity.rank_in_pp_group)
        self.writes = writes_blocks(engine, rank)
        self.registered = registered
        # No health monitor here: the guide's connector keeps its own (check_health).
        self.cache = PagedCache(copies_for(layout), PoolGuard(None, log))
        log.info(
            "kvpool EMS: registered %s (%s)%s",
            registered.describe,
            layout.describe(),
            "" if self.writes else f"; MLA: tensor-parallel rank 0 saves for rank {rank}",
        )
        with contextlib.suppress(KVPoolError):  # a label for status pages: never a failure
            self.client.describe(self.namespace, timeout=1.0)

    # -- calls ----------------------------------------------------------------------------

    def exists(self, hashes: Sequence[int], option: CcKvOption | None = None) -> CcResult:
        total = len(hashes) if isinstance(hashes, Sequence) else 0
        try:
            if self.namespace is None or not total:
                return CcResult(0, total)
            keys = self._keys(hashes)
            found = self._client(option).lookup(keys, timeout=_timeout_s(option))
            return CcResult(found, total)
        except Exception as exc:  # exists must never raise: the connector would claim a hit
            log.debug("kvpool EMS exists: %s", exc)
            return CcResult(0, total)

    def async_load(
        self, slot_mapping: Ints, hashes: Ints, offsets: Ints, option: CcKvOption | None = None
    ) -> CcFuture:
        block_ids, keys = self._plan(slot_mapping, hashes, offsets)
        timeout = _timeout_s(option)
        job = self._executor.submit(self._load, self._client(option), block_ids, keys, timeout)
        return CcFuture(job, len(keys), timeout + 1.0)

    def async_save(
        self, slot_mapping: Ints, hashes: Ints, offsets: Ints, option: CcKvOption | None = None
    ) -> CcFuture:
        block_ids, keys = self._plan(slot_mapping, hashes, offsets)
        if not self.writes:  # rank 0 saves the copy every rank shares
            return _done(CcResult(0, len(keys)))
        assert self.cache is not None
        blocks = save_from(self.cache, block_ids)  # copied out now
        timeout = _timeout_s(option)
        job = self._executor.submit(self._save, self._client(option), keys, blocks, timeout)
        return CcFuture(job, len(keys), timeout + 1.0)

    def is_ready(self, future: Any) -> bool:
        return not isinstance(future, CcFuture) or future.done()

    def get_result(self, future: Any) -> CcResult:
        if not isinstance(future, CcFuture):
            raise invalid("get_result: not a future of this SDK")
        return future.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for client in self._clients.values():
            client.close()

    def _client(self, option: CcKvOption | None) -> Client:
        if option is None:
            return self.client
        wanted = (bool(option.write_rcache), bool(option.read_local_only))
        with self._lock:
            client = self._clients.get(wanted)
            if client is None:
                config = self.client.config.replace(
                    write_rcache=wanted[0], read_local_only=wanted[1]
                )
                client = self._clients[wanted] = Client(config=config)
            return client

    # -- the work -------------------------------------------------------------------------

    def _plan(
        self, slot_mapping: Sequence[int], hashes: Sequence[int], offsets: Sequence[int]
    ) -> tuple[list[int], list[bytes]]:
        """Block ids and keys, or ``EMS_INVALID_ARGUMENT``."""
        if self.registered is None:
            raise invalid("no KV cache registered")
        if not hashes or len(hashes) != len(offsets) or len(hashes) > MAX_BLOCKS_PER_CALL:
            raise invalid(f"{len(hashes)} hashes for {len(offsets)} offsets")
        block_size = offsets[0]
        if block_size <= 0 or any(o != block_size for o in offsets):
            raise invalid("offsets must all be the block size (whole blocks only)")
        try:
            slots = np.asarray(slot_mapping, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise invalid("slot_mapping is not a list of integers") from None
        if slots.ndim != 1 or len(slots) != block_size * len(offsets):
            raise invalid(f"slot_mapping of {len(slots)} slots for {len(offsets)} blocks")
        grid = slots.reshape(-1, block_size)
        block_ids = grid[:, 0] // block_size
        expected = block_ids[:, None] * block_size + np.arange(block_size)
        if (grid[:, 0] % block_size).any() or not np.array_equal(grid, expected):
            raise invalid("slot_mapping does not describe whole blocks")
        num_blocks = self.registered.layout.num_blocks
        if (block_ids < 0).any() or (block_ids >= num_blocks).any():
            raise invalid(f"slot_mapping names blocks outside the cache of {num_blocks}")
        return block_ids.tolist(), self._keys(hashes)

    def _keys(self, hashes: Sequence[int]) -> list[bytes]:
        assert self.namespace is not None
        out = []
        for h in hashes:
            if not isinstance(h, int) or not _INT64[0] <= h <= _INT64[1]:
                raise invalid(f"block hash {h!r} is not a 64-bit integer")
            out.append(h.to_bytes(8, "little", signed=True))
        return self.namespace.keys(out)

    def _load(
        self, client: Client, block_ids: list[int], keys: list[bytes], timeout: float
    ) -> CcResult:
        assert self.cache is not None
        load = load_into(self.cache, client, keys, block_ids, timeout)
        if load.num_blocks < len(keys):
            log.info("kvpool EMS load of %d blocks: %s", len(keys), load.reason)
        return CcResult(load.num_blocks, len(keys))

    def _save(
        self, client: Client, keys: list[bytes], blocks: CopiedBlocks, timeout: float
    ) -> CcResult:
        assert self.cache is not None
        saved = put_batch(self.cache, client, keys, blocks, timeout)
        if saved.reason:
            log.info("kvpool EMS save of %d blocks: %s", len(keys), saved.reason)
        return CcResult(saved.num_stored, len(keys), saved.num_not_kept)


def _done(result: CcResult) -> CcFuture:
    """A future that has its result already."""
    future: concurrent.futures.Future[CcResult] = concurrent.futures.Future()
    future.set_result(result)
    return CcFuture(future, result.total, 0.0)


def _timeout_s(option: CcKvOption | None) -> float:
    timeout_ms = option.timeout if option is not None else 5000
    return max(float(timeout_ms), 1.0) / 1000
