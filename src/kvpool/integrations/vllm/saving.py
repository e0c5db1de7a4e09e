"""When the connector saves a block: as soon as the engine computes it (``eager``), as the
engine is about to drop it from its own prefix cache (``evicting``), or whichever of the two
the engine's pool hits call for (``auto``).

``evicting``: while the engine's own cache holds a block, lookups never reach the pool's
copy, which only ages there: an eager pool not much larger than the engines' caches holds
mostly what they hold (docs/benchmarks-log.md, the two-level replay).  vLLM hands the
connector its block pool (``bind_gpu_block_pool``); every step, :meth:`SavePlan.evicting`
walks the head of its free queue, the blocks the next allocations take first, and saves
the cached ones the pool does not hold yet.  Each is copied out of the paged cache within
the step whose metadata names it (the worker's ``wait_for_save``), and a block the engine
reallocates is written no earlier than the next step's forward: so a save never reads a
block the engine has changed since it was chosen.  The walk is bounded (``lookahead``
blocks: twice the blocks one step's batched tokens take, as vLLM's own CPU offloader looks),
so its cost is per step, never per block held; a block freed and reallocated within one
scheduling pass is not seen (a future miss).

``auto``: starts ``eager`` and decides again every ``AUTO_WINDOW`` blocks the engine loads
from the pool, from the share of them that this engine saved itself: at least
``AUTO_OWN_SHARE``, the pool mainly gives the engine back what it dropped (one engine, or
cache-aware routing), so ``evicting``; below, the pool mainly passes other engines' blocks
on (routing that spreads a conversation over engines), which need them early: ``eager``.
Every decision is logged and counted.  Behind cache-aware routing that balances load the
signal misleads (a turn whose history its engine dropped moves to another engine, which
loads what the first saved on eviction): ``evicting`` is the choice there
(docs/benchmarks-log.md, "Retention").

Not offered (``eager`` then, said once in the log): producers (a decode instance loads
what they save at once), engines without vLLM's prefix caching, and engines with several
KV cache groups or a group that keeps only some blocks of a prefix.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvpool.errors import ConfigError

log = logging.getLogger("vllm.kvpool")

SAVE_MODES = ("eager", "evicting", "auto")
EAGER, EVICTING, AUTO = SAVE_MODES
AUTO_WINDOW = 256  # pool-hit blocks per decision
AUTO_OWN_SHARE = 0.5
MAX_KNOWN = 1 << 17  # hashes remembered as in the pool (at least the engine's blocks)


def check_save_mode(mode: str) -> str:
    if mode not in SAVE_MODES:
        raise ConfigError(f"save must be one of {', '.join(SAVE_MODES)}")
    return mode


class SavePlan:
    """One engine's choice of when to save, and what it knows the pool holds."""

    def __init__(self, mode: str, *, not_evicting: str = "") -> None:
        """``not_evicting``: why this engine cannot save on eviction ("" if it can)."""
        self.mode = check_save_mode(mode)
        if mode != EAGER and not_evicting:
            log.info("kvpool: save=%s: saving eagerly (%s)", mode, not_evicting)
            self.mode = EAGER
        self.current = EVICTING if self.mode == EVICTING else EAGER
        self.lookahead = 0
        self._block_pool: Any = None
        # Hashes the pool holds as far as this engine knows: True where it saved them.
        self._known: OrderedDict[bytes, bool] = OrderedDict()
        self._max_known = MAX_KNOWN
        self._num_own = 0
        self._num_hits = 0
        self.num_decisions = 0
        if self.mode != EAGER:
            log.info("kvpool: save=%s: saving %s", self.mode, self.current)

    @property
    def is_eager(self) -> bool:
        return self.current == EAGER

    def bind(self, block_pool: Any, lookahead: int) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``) and how far ahead of its next
        allocations a step looks."""
        if self.mode != EAGER and not getattr(block_pool, "enable_caching", False):
            log.info("kvpool: save=%s: saving eagerly (vLLM's prefix caching is off)", self.mode)
            self.mode = self.current = EAGER
            return
        self._block_pool = block_pool
        self.lookahead = lookahead
        self._max_known = max(MAX_KNOWN, 2 * int(getattr(block_pool, "num_gpu_blocks", 0)))

    # -- what the pool holds ---------------------------------------------------------------

    def saved(self, hashes: Iterable[bytes]) -> None:
        """Blocks this engine saved: its own, unless it loaded them (another's, dropped)."""
        for h in hashes:
            self._remember(h, self._known.get(h, True))

    def loaded(self, hashes: list[bytes]) -> None:
        """Blocks the engine loads from the pool: counted for ``auto``, and known held."""
        own = 0
        for h in hashes:
            is_own = self._known.get(h, False)
            own += is_own
            self._remember(h, is_own)
        if self.mode != AUTO or not hashes:
            return
        self._num_own += own
        self._num_hits += len(hashes)
        if self._num_hits >= AUTO_WINDOW:
            self._decide()

    def _remember(self, block_hash: bytes, own: bool) -> None:
        known = self._known
        known[block_hash] = own
        known.move_to_end(block_hash)
        if len(known) > self._max_known:
            known.popitem(last=False)

    def _decide(self) -> None:
        share = self._num_own / self._num_hits
        choice = EVICTING if share >= AUTO_OWN_SHARE and self._block_pool is not None else EAGER
        self.num_decisions += 1
        if choice != self.current:
            log.info(
                "kvpool: save=auto: saving %s (%.0f%% of the last %d blocks loaded from the "
                "pool were this engine's own saves)",
                choice,
                100 * share,
                self._num_hits,
            )
            self.current = choice
        self._num_own = self._num_hits = 0

    # -- saves on eviction ----------------------------------------------------------------

    def evicting(self) -> tuple[list[int], list[bytes]]:
        """The cached blocks nearest eviction that the pool does not hold: their block ids
        and hashes (one KV cache group's)."""
        pool = self._block_pool
        if pool is None or self.is_eager:
            return [], []
        block_ids: list[int] = []
        hashes: list[bytes] = []
        known = self._known
        for num, block in enumerate(pool.free_block_queue.iter_blocks_after(None)):
            if num >= self.lookahead:
                break
            key = block.block_hash
            if key is None or block.is_null:
                continue
            block_hash = bytes(key)[:-GROUP_ID_BYTES]  # vLLM's hash, less its group id
            if block_hash in known:
                continue
            block_ids.append(block.block_id)
            hashes.append(block_hash)
        return block_ids, hashes


GROUP_ID_BYTES = 4  # vLLM's BlockHashWithGroupId: the block hash, then a 4-byte group id
