"""Prefetch: the promotion of :mod:`kvpool.tiers.promotion`, started ahead of the read for a
request that is still queued, with admission, and holds that keep what came up in DRAM.

- It runs below the priority of real reads: one I/O thread of its own (``lane``) where
  reads have several, and at most ``PREFETCH_MAX_BYTES`` in flight on the node, each
  tenant at most its share of them (its account's ``PREFETCH_BYTES``); the rest is
  refused.
- Its blocks are *held* (:mod:`kvpool.store.holds`) until read or until the hold lapses.
  A prefetch of blocks already in DRAM or already coming up only holds them; a hold whose
  promotion does not come up (refused by the tenant's quota, lost, corrupt) is released; a
  cancelled prefetch releases its holds.
- **From other nodes** (:class:`~kvpool.tiers.tier.RemoteSource`: keys no local tier
  holds), bounded like the rest, since any tenant may ask for it: at most
  ``RemoteSource.max_keys`` keys of a request go out, at most ``REMOTE_KEYS_IN_FLIGHT``
  keys are out at once on the node and ``REMOTE_KEYS_PER_TENANT`` per tenant (its
  account's ``REMOTE_KEYS``, :mod:`kvpool.store.accounts`), and each fetch reserves
  ``REMOTE_FETCH_BYTES`` of ``PREFETCH_MAX_BYTES`` (and of the tenant's share) before it
  starts: the other nodes' answers are cut at that from the sizes they announce, before a
  byte is buffered.  What is past a bound is refused (a hint: the read will go elsewhere).
  Their bytes come up through :meth:`~kvpool.tiers.promotion.Promotions.bring_up`, copied
  with their checksum.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.buffers import copy_with_checksum
from kvpool.protocol.messages import PrefetchResponse
from kvpool.stats import PrefetchStats
from kvpool.store.accounts import Resource
from kvpool.store.block_store import BlockStore
from kvpool.store.holds import Holds
from kvpool.tiers.lower import LowerTiers, Wanted
from kvpool.tiers.promotion import Promotion, Promotions
from kvpool.tiers.tier import RemoteSource

log = logging.getLogger("kvpool.node")

PREFETCH_MAX_BYTES = 512 << 20
REMOTE_KEYS_IN_FLIGHT = 1024  # on the node; a tenant's: its account's REMOTE_KEYS
REMOTE_FETCH_BYTES = 64 << 20  # the most one fetch from other nodes may buffer


class Prefetches:
    """Prefetches for queued requests, from the lower tiers and from other nodes, and the
    holds of what they brought up."""

    def __init__(
        self,
        store: BlockStore,
        lower: LowerTiers,
        promotions: Promotions,
        holds: Holds,
        remote: RemoteSource | None,
        lane: ThreadPoolExecutor,
    ) -> None:
        self.store = store
        self.lower = lower
        self.promotions = promotions
        self.holds = holds
        self.remote = remote
        self.lane = lane
        self.prefetched = PrefetchStats()
        self.promoted_remote = 0  # blocks a prefetch copied from other nodes
        self._prefetch_bytes = 0  # in flight
        self._remote_keys = 0  # keys asked of other nodes, in flight (each tenant's: its
        # account's REMOTE_KEYS)

    def prefetch(
        self, keys: Sequence[bytes], hold_s: float, cancel: bool = False
    ) -> PrefetchResponse:
        """Start bringing ``keys`` into DRAM for a queued request, and hold them there."""
        answer = PrefetchResponse()
        if cancel:
            self.holds.release(keys)
            return answer
        wanted: list[Wanted] = []
        joined: dict[Promotion, list[bytes]] = {}
        elsewhere: list[bytes] = []
        accounts = self.store.accounts
        promotions = self.promotions
        in_dram = self.store.lookup_mask(keys, count=False)
        for key, held in zip(keys, in_dram, strict=True):
            block = self.store.get_block(key) if held else None
            if block is not None:
                answer.num_in_dram += self.holds.hold(key, block.size, hold_s, fetched=False)
                continue
            source = self.lower.source(key)
            under_way = promotions.under_way(key)
            if source is None:
                if self.remote is not None and under_way is None:
                    elsewhere.append(key)
                else:
                    answer.num_absent += 1
                continue
            size = source[0]
            account = accounts.account_of(key)
            if under_way is not None:
                if self.holds.hold(key, size, hold_s, fetched=True):
                    answer.num_started += 1
                    joined.setdefault(under_way, []).append(key)
            elif (
                self._prefetch_bytes + size > PREFETCH_MAX_BYTES
                or not accounts.has_room(account, Resource.PREFETCH_BYTES, size)
                or not self.holds.hold(key, size, hold_s, fetched=True)
            ):
                answer.num_refused += 1
            else:
                accounts.charge(account, Resource.PREFETCH_BYTES, size)
                wanted.append((key, *source))
                self._prefetch_bytes += size
        for promotion, joined_keys in joined.items():
            promotion.add_done_callback(functools.partial(self._joined_done, joined_keys))
        if elsewhere:  # other nodes may: asked in the background, within bounds
            asked = self._admit_remote(elsewhere)
            answer.num_refused += len(elsewhere) - len(asked)
            if asked:
                answer.num_started += len(asked)
                self._spawn_remote(asked, hold_s)
        if wanted:
            answer.num_started += len(wanted)
            task = promotions.start_from_below(wanted, self.lane)
            task.add_done_callback(lambda done: self._prefetch_done(done, wanted))
        stats = self.prefetched
        stats.issued += len(keys)
        stats.in_dram += answer.num_in_dram
        stats.started += answer.num_started
        stats.refused += answer.num_refused
        stats.absent += answer.num_absent
        return answer

    def note_read(self, keys: Sequence[bytes]) -> None:
        """The blocks of these keys were pinned or sent: the requests that held them ran."""
        if len(self.holds):
            self.holds.read(keys)

    def stats(self) -> PrefetchStats:
        stats = self.prefetched
        holds = self.holds
        stats.useful = holds.counters.useful
        stats.wasted = holds.counters.wasted
        stats.held_blocks = len(holds)
        stats.held_bytes = holds.held_bytes
        return stats

    # -- from other nodes ---------------------------------------------------------------

    def _admit_remote(self, keys: list[bytes]) -> list[bytes]:
        """The keys that may be asked of other nodes now (see the module's bounds), charged
        to the tenant's ``REMOTE_KEYS``; none when no byte budget is left for a fetch, on
        the node or in the tenant's share (the fetch is charged to the first key's tenant:
        a request names one tenant's keys)."""
        assert self.remote is not None
        if self._prefetch_bytes + REMOTE_FETCH_BYTES > PREFETCH_MAX_BYTES:
            return []
        accounts = self.store.accounts
        account = accounts.account_of(keys[0])
        if not accounts.has_room(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES):
            return []
        asked: list[bytes] = []
        for key in keys[: self.remote.max_keys]:
            if self._remote_keys >= REMOTE_KEYS_IN_FLIGHT:
                break
            if not accounts.charge(account, Resource.REMOTE_KEYS):
                break  # the tenant has its keys in flight: the rest are refused too
            self._remote_keys += 1
            asked.append(key)
        return asked

    def _spawn_remote(self, keys: list[bytes], hold_s: float) -> None:
        # Reserved until the fetch ends, on the node and in the tenant's share.
        self._prefetch_bytes += REMOTE_FETCH_BYTES
        account = self.store.accounts.account_of(keys[0])
        self.store.accounts.charge(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES)
        task = asyncio.ensure_future(self._prefetch_remote(keys, hold_s, account))
        self.promotions.track(keys, task)

    async def _prefetch_remote(
        self, keys: list[bytes], hold_s: float, account: bytes
    ) -> list[bytes]:
        """Copy blocks that other nodes hold into this node's DRAM, and hold them; the keys
        that came up."""
        assert self.remote is not None
        try:
            found = await self.remote.fetch(keys, REMOTE_FETCH_BYTES)
            if not found:
                return []
            values = [memoryview(value) for _, value in found]
            checksums = await self.promotions.bring_up(
                [key for key, _ in found],
                [len(value) for value in values],
                lambda slots: [copy_with_checksum(dst, values[i]) for i, dst in slots],
                self.lane,
            )
            promoted = [key for (key, _), c in zip(found, checksums, strict=True) if c is not None]
            num = 0
            for (key, value), checksum in zip(found, checksums, strict=True):
                if checksum is not None and self.holds.hold(key, len(value), hold_s, fetched=True):
                    num += 1
            self.prefetched.completed += num
            self.promoted_remote += num
            return promoted
        except Exception:  # a hint: a failure only means the read goes elsewhere
            log.exception("prefetch of %d blocks from other nodes failed", len(keys))
            return []
        finally:
            self.promotions.forget(keys)
            self._remote_keys -= len(keys)
            self._prefetch_bytes -= REMOTE_FETCH_BYTES
            accounts = self.store.accounts
            accounts.credit(account, Resource.REMOTE_KEYS, len(keys))
            accounts.credit(account, Resource.PREFETCH_BYTES, REMOTE_FETCH_BYTES)

    # -- when a promotion ends ----------------------------------------------------------

    def _prefetch_done(self, task: Promotion, wanted: list[Wanted]) -> None:
        """A prefetch's promotion ended: its bytes in flight come back, and the holds of
        the blocks that did not come up are released."""
        accounts = self.store.accounts
        for key, size, _ in wanted:
            self._prefetch_bytes -= size
            accounts.credit(accounts.account_of(key), Resource.PREFETCH_BYTES, size)
        promoted = self._release_unpromoted(task, [key for key, _, _ in wanted])
        self.prefetched.completed += promoted

    def _joined_done(self, held: list[bytes], task: Promotion) -> None:
        self._release_unpromoted(task, held)

    def _release_unpromoted(self, task: Promotion, held: list[bytes]) -> int:
        """Release the holds of ``held`` that ``task`` did not bring up and that are not in
        DRAM now (a promotion its tenant's quota refused holds nothing for it); how many
        came up."""
        came_up: set[bytes] = set()
        if not task.cancelled() and task.exception() is None:
            came_up = set(task.result())
        missed = [key for key in held if key not in came_up]
        in_dram = self.store.lookup_mask(missed, count=False)
        self.holds.release([key for key, there in zip(missed, in_dram, strict=True) if not there])
        return len(held) - len(missed)
