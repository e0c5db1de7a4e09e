"""The scheduler half of the connector: matching, policy and request state.  No tensors;
its only I/O is the pool lookup, under a short deadline.

Per request:
1. ``get_num_new_matched_tokens`` looks the request's full prompt blocks up in the pool
   (every rank's namespace) and offers the blocks past the engine's own prefix-cache hit:
   loaded layer by layer in the step that uses them, or (``transfer: whole``, and blocks
   that are only in the node's disk or the object store) as an asynchronous load the
   request waits for off the step. The same lookup tells the node to start bringing
   lower-tier blocks into DRAM (``prefetch_hold``), so the load finds them there. It keeps at
   least one prompt token to compute. A consumer whose next block is still being written by
   a producer defers the request (vLLM asks again next step) until ``consumer_wait`` after
   the request arrived. It is side-effect free, as vLLM requires: all it leaves behind is a
   memo of its latest answer.
2. ``update_state_after_alloc`` acts on that memo once the request is scheduled: it counts
   the lookup, turns the offer into a load job for the allocated blocks, and sets where the
   request's saves start.
3. ``build_connector_meta`` hands the step's load jobs to the workers, and a save job for
   every block whose KV this step completes and that is not in the pool yet: the prompt's
   blocks, and those of the generated tokens, as vLLM's own prefix cache keeps them (a
   conversation's next turn repeats its last answer).  A block is saved once every token
   in it is known (vLLM has hashed it) and computed (by the end of this step): never the
   slot of the last sampled token, whose KV the next step computes, nor a draft token's.
4. ``request_finished`` forgets the request.  Workers copy a save's pages out of the paged
   cache before the step ends, so blocks are never held back.

When the pool is unhealthy, lookups report misses and saves are skipped: the engine
recomputes, and never waits on the pool.

An engine whose attention backend cannot continue a prefix it did not compute
(:mod:`.backends`, as the workers report it once at start) is offered nothing, as is any
engine before its workers have reported: lookups go on (the pool's blocks are not saved
again) and so do saves, for engines that can load them.

Several KV cache groups (vLLM's hybrid allocator, :mod:`.groups`): each group's blocks are
keyed under its own namespace.  A prefix is offered only as far as every group holds what
the engine reads of it (all full-attention blocks, a sliding window's last blocks, a
recurrent state's last block); the load plans each group's non-null blocks and always runs
off the step, since vLLM takes a hybrid engine's load failures per request (it recomputes
the request whole), never per block.  Recurrent states are saved from vLLM's boundary-state
hand-offs; an engine with a group of any other kind is offered nothing and saves nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.client.client import Client
from kvpool.client.health import HealthMonitor
from kvpool.errors import ConfigError
from kvpool.keys import ENGINE_REFRESH_S, BlockOrigin, EngineRef, Namespace
from kvpool.kvcache.guard import PoolGuard
from kvpool.retention import DEFAULT_PRIORITY, Hint, by_hint, hint_from
from kvpool.stats import TIER_DRAM, TIER_NAMES

from .backends import DECLINED_LOG, declined_reason
from .config import ConnectorConfig
from .groups import (
    FULL,
    NULL_BLOCK_ID,
    SLIDING,
    STATE,
    CacheGroup,
    group_namespaces,
    unsupported_reason,
)
from .metadata import KVPoolMetadata, KVPoolStats, TransferJob, merge
from .saving import MAX_KNOWN, SavePlan

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration

EVICTING_REQ_ID = "kvpool-evicting"  # the job of a step's saves on eviction: no request's


@dataclass(frozen=True)
class _Match:
    """What the last pool lookup of a request found (a memo: a later call replaces it)."""

    num_local_blocks: int  # the engine's own prefix-cache hit, in blocks
    num_pool_blocks: int  # leading prompt blocks found in the pool (or known to be)
    num_lookup_blocks: int = 0  # prompt blocks looked up (0: no lookup was made)
    lookup_s: float = 0.0
    tiers: bytes = b""  # where each block of the pool's prefix lives (TIER_*)


@dataclass
class _RequestState:
    request: Any
    next_save_block: int = 0  # prompt blocks before this one are saved or in the pool
    first_load_block: int = 0  # where its load starts (saving resumes there if it fails)
    load_failed: bool = False
    hint: Hint | None = None  # its retention hint (kvpool.retention), if it has one


class KVPoolScheduler:
    """The connector's scheduler side: what vLLM's ``KVConnectorBase_V1`` asks of it, through
    :class:`~.connector.KVPoolConnector`'s scheduler-side methods.

    Why so many methods (36): ten are that interface, as the connector hands it on
    (``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
    ``request_finished``, ``update_connector_output``, ``bind_block_pool``,
    ``set_attention_backends``, ``on_new_request``, the stats vLLM takes, ``shutdown``),
    and each must decide within the scheduler's own call: the lookup (hybrid groups,
    partial prefixes), which blocks to save and when (:mod:`.saving`), retention hints,
    failed loads, stats.  The private methods are those steps, in the order vLLM
    calls them; the decisions themselves live in their modules (:mod:`.groups`,
    :mod:`.saving`, :mod:`kvpool.retention`).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        namespaces: dict[tuple[int, int], Namespace],
        block_size: int,
        *,
        can_load: bool,
        can_save: bool,
        wait_for_pending: bool,
        groups: list[CacheGroup] | None = None,
        engine: EngineRef | None = None,
    ):
        self.config = config
        self.engine = engine  # this engine as routers name it, told to the node
        self.wait_for_pending = wait_for_pending
        self.groups = groups or [CacheGroup(0, FULL)]
        self.is_hybrid = len(self.groups) > 1
        by_rank = group_namespaces(namespaces, self.groups)
        # Per group, the distinct namespaces of its ranks (MLA's ranks share one:
        # Namespace.for_rank), each looked up once.
        self.group_spaces = [
            list(dict.fromkeys(spaces[g.index] for spaces in by_rank.values())) for g in self.groups
        ]
        self.namespaces = [ns for spaces in self.group_spaces for ns in spaces]
        self.full_spaces = [
            ns for g in self.groups if g.kind == FULL for ns in self.group_spaces[g.index]
        ]
        # Groups that need only some blocks of a prefix (see :mod:`.groups`).
        self.partial_groups = [g for g in self.groups if g.kind in (SLIDING, STATE)]
        self.state_groups = {g.index for g in self.groups if g.kind == STATE}
        self.block_size = block_size
        if self.is_hybrid:
            log.info(
                "kvpool: KV cache groups (hybrid allocator): %s",
                " ".join(
                    f"{g.tag()} namespace={self.group_spaces[g.index][0].id.hex()}"
                    for g in self.groups
                ),
            )
        self.unsupported = unsupported_reason(self.groups)
        if self.unsupported:
            log.warning("kvpool: this engine is offered no pool blocks: %s", self.unsupported)
        self.can_load = can_load and not self.unsupported
        self.can_save = can_save and not self.unsupported
        # The attention backends vLLM selected, once the workers have said (None: not yet).
        self.attention_backends: tuple[str, ...] | None = None
        self.declined = ""  # why no load is offered to this engine's backend ("" if one may)
        self._told_unknown = False
        self._client: Client | None = None
        self._described = 0.0
        self._described_saving = ""
        self.health = HealthMonitor(self._probe, config.health, name="kvpool (scheduler)")
        self.guard = PoolGuard(self.health, log)
        self._requests: dict[str, _RequestState] = {}
        self._matches: dict[str, _Match] = {}
        self._loads: list[TransferJob] = []
        self.stats = KVPoolStats()  # drained by vLLM (get_kv_connector_stats)
        self._interval = KVPoolStats()  # drained by the periodic log line, workers' included
        self._last_log = time.monotonic()
        self.plan = SavePlan(config.save, not_evicting=self._not_evicting())
        # Hinted blocks the engine holds, for the saves on eviction: hash -> (priority,
        # deadline; 0: none), at most the engine's blocks.
        self._hints: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        # Saving on eviction: what the engine's blocks were computed from (KV events).
        self._computed_origins: OrderedDict[bytes, BlockOrigin] = OrderedDict()
        self._max_hints = MAX_KNOWN

    def _not_evicting(self) -> str:
        """Why this engine cannot save on eviction ("" if it can: :mod:`.saving`)."""
        if not self.can_save:
            return "this engine saves nothing"
        if not self.can_load:
            return "a producer: its consumers load its blocks at once"
        if self.is_hybrid or self.partial_groups:
            return "an engine of several KV cache groups"
        return ""

    def bind_block_pool(self, block_pool: Any, lookahead: int) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``), for the saves on eviction."""
        self.plan.bind(block_pool, lookahead)
        self._max_hints = max(MAX_KNOWN, int(getattr(block_pool, "num_gpu_blocks", 0)))

    # -- pool -----------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(config=self.config.client)
            self.health.start()
            with self.guard.call("describe"):  # never fail for a label
                self._describe(self._client)
        return self._client

    def _describe(self, client: Client) -> None:
        """Label the namespaces; and name the engine that loads them, for the routers the
        node tells (:mod:`kvpool.node.kthena`)."""
        saving = self._described_saving = self.plan.current if self.can_save else ""
        for ns in self.namespaces:
            client.describe(
                ns, engine=self.engine, saving=saving, timeout=self.config.lookup_timeout_s
            )
        self._described = time.monotonic()

    def _probe(self) -> None:
        """The health monitor's probe; it also renews the engine's name with the node, which
        forgets it ENGINE_TTL_S after the last time it heard it."""
        self.client.health(timeout=self.config.lookup_timeout_s)
        if self.engine is not None and time.monotonic() - self._described > ENGINE_REFRESH_S:
            self._describe(self.client)

    def _lookup_groups(self, hashes: list[bytes], num_local: int) -> tuple[int, bool, bytes]:
        """Leading blocks every group has what the engine reads of (see :mod:`.groups`),
        whether a rank is still writing the next, and the tier of each leading block.

        Saving on eviction, the pool holds what the engine dropped, a prefix's leaves, while
        the engine keeps its root: only the blocks past the engine's own hit are looked up
        (they need not be in the pool).  Saving eagerly, every block is, so that the engine
        saves again what the pool lost of a prefix it still holds."""
        start = 0 if self.plan.is_eager else num_local
        num_found, pending, tiers = self._lookup(hashes[start:], self.full_spaces)
        num_prefix = start + num_found
        tiers = bytes([TIER_DRAM]) * start + tiers
        num_before = -1
        while num_prefix != num_before:  # a group's shorter prefix may change another's needs
            num_before = num_prefix
            for group in self.partial_groups:
                num_prefix = self._partial_prefix(group, hashes[:num_prefix], num_local)
        return num_prefix, pending, tiers[:num_prefix]

    def _partial_prefix(self, group: CacheGroup, hashes: list[bytes], num_local: int) -> int:
        """The longest of ``hashes``' prefixes whose needed blocks (past the engine's own
        ``num_local``) ``group`` holds in the pool."""
        num = len(hashes)
        if num <= num_local:
            return num
        spaces = self.group_spaces[group.index]
        first = max(num_local, group.first_needed_block(num, self.block_size))
        num_needed, _, _ = self._lookup(hashes[first:], spaces)
        if num_needed == num - first:
            return num
        if group.kind == STATE:
            return self._last_state(hashes[num_local : num - 1], spaces, num_local)
        # The window of the whole prefix is not all there: a shorter prefix whose window is.
        num_held, _, _ = self._lookup(hashes[num_local:], spaces)
        return num_local + num_held

    def _last_state(self, hashes: list[bytes], spaces: list[Namespace], num_local: int) -> int:
        """The longest prefix (past ``num_local`` blocks, whose hashes are ``hashes``) that
        ends on a block whose state every namespace of ``spaces`` holds."""
        held = [True] * len(hashes)
        for ns in spaces:
            found = self.client.exists(ns.keys(hashes), timeout=self.config.lookup_timeout_s)
            held = [a and b for a, b in zip(held, found, strict=True)]
        ends = [i + 1 for i, is_held in enumerate(held) if is_held]
        return num_local + (ends[-1] if ends else 0)

    def _lookup(self, hashes: list[bytes], spaces: list[Namespace]) -> tuple[int, bool, bytes]:
        """Leading blocks every namespace of ``spaces`` has, whether one is still writing
        the next, and the tier of each leading block (in the one that holds the fewest)."""
        num_prefix, pending, tiers = len(hashes), False, b""
        if not hashes:
            return 0, False, b""
        prefetch = self.config.prefetch_hold_s if self.can_load and not self.declined else 0.0
        for ns in spaces:
            state = self.client.lookup_state(
                ns.keys(hashes), prefetch=prefetch, timeout=self.config.lookup_timeout_s
            )
            if state.num_prefix < num_prefix or not tiers:
                tiers = state.tiers[: min(num_prefix, state.num_prefix)]
            if state.num_prefix < num_prefix:
                num_prefix, pending = state.num_prefix, state.is_next_pending
            elif state.num_prefix == num_prefix:
                pending = pending or state.is_next_pending
        return num_prefix, pending, tiers[:num_prefix]

    # -- connector hooks ------------------------------------------------------------------

    def set_attention_backends(self, names: Sequence[str]) -> None:
        """The attention backends the workers' layers run (vLLM's handshake, once at start).
        A declined one (:mod:`.backends`) is offered no load from then on; saves go on."""
        if not names:
            return  # still unknown: no load is offered
        self.attention_backends = tuple(sorted(set(names)))
        self.declined = declined_reason(names)
        if self.declined:
            log.warning("kvpool: %s: %s", DECLINED_LOG, self.declined)
        else:
            log.info("kvpool: attention backend(s) %s", " ".join(self.attention_backends))

    def _may_load(self) -> bool:
        if self.attention_backends is None and self.can_load and not self._told_unknown:
            self._told_unknown = True
            log.warning(
                "kvpool: the workers never said which attention backends they run (no "
                "connector handshake from vLLM): no prefix is loaded into this engine"
            )
        return self.can_load and self.attention_backends is not None and not self.declined

    def on_new_request(self, request: Any) -> None:
        state = self._requests[request.request_id] = _RequestState(request)
        try:
            state.hint = hint_from(getattr(request, "kv_transfer_params", None))
        except ConfigError as exc:
            log.warning(
                "kvpool: request %s: its retention hint is ignored: %s", request.request_id, exc
            )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tokens past the engine's own hit that the pool can load.  Side-effect free,
        as vLLM requires (it may ask several times): it only replaces the request's memo of
        what the pool held, which ``update_state_after_alloc`` acts on."""
        bs = self.block_size
        num_local_blocks = num_computed_tokens // bs
        self._matches[request.request_id] = _Match(num_local_blocks, num_local_blocks)
        # Keep at least one prompt token to compute: vLLM must run a forward to sample.
        num_blocks = min((request.num_prompt_tokens - 1) // bs, len(request.block_hashes))
        if num_blocks <= 0 or self.unsupported or not self.health.is_healthy:
            return 0, False
        if num_local_blocks >= num_blocks:
            # The engine's own cache holds every block the pool could offer: a lookup
            # cannot add anything, so none is made (its round trip would only delay this
            # request).  Blocks it holds are not saved again.
            return 0, False
        state = self._requests.get(request.request_id)
        started = time.perf_counter()
        with self.guard.call("lookup") as outcome:  # whatever the pool does: a miss
            hashes = list(request.block_hashes[:num_blocks])
            num_pool, pending, tiers = self._lookup_groups(hashes, num_local_blocks)
        if outcome.failed:
            return 0, False
        self._matches[request.request_id] = _Match(
            num_local_blocks, num_pool, num_blocks, time.perf_counter() - started, tiers
        )
        if not self._may_load() or (state is not None and state.load_failed):
            return 0, False
        # A producer is still writing the next block: ask again next step, for at most
        # consumer_wait after the request arrived.
        is_waiting = pending and self.wait_for_pending and num_pool < num_blocks
        if is_waiting and time.time() - request.arrival_time < self.config.consumer_wait_s:
            return None, False
        num_new = num_pool - num_local_blocks
        if num_new < self.config.min_load_blocks or num_new * bs < self.config.min_load_tokens:
            return 0, False
        # Layer by layer, the load runs in the step that computes the rest of the prompt;
        # blocks coming up from a lower tier (the lookup asked the node to bring them into
        # DRAM) are loaded asynchronously: the request waits for them off the step.
        return num_new * bs, self._is_async(tiers[num_local_blocks:num_pool])

    def _is_async(self, tiers: bytes) -> bool:
        # Several groups, or a group that keeps only some blocks of a prefix: a failed load
        # must recompute the whole request (vLLM takes such failures per request only, from
        # a load off the step): recomputing from a failed block on would read the null
        # blocks before it (a window's start, a state's history).
        return (
            self.is_hybrid
            or bool(self.partial_groups)
            or self.config.transfer == "whole"
            or any(t != TIER_DRAM for t in tiers)
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """The request is scheduled: count its lookup, plan its load, and start its saves
        past what the pool already holds."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        match = self._matches.pop(request.request_id, None)
        if match is None:  # the second call, once a load is done
            return
        if match.num_lookup_blocks:
            self._record("lookups")
            self._record("lookup_blocks", match.num_lookup_blocks)
            self._record("hit_blocks", match.num_pool_blocks)
            # Past the engine's own hit: the blocks this request may load, by tier.
            for tier, name in TIER_NAMES.items():
                loadable = match.tiers[match.num_local_blocks :].count(tier)
                if loadable:
                    self._record(f"hit_blocks_{name}", loadable)
            self._observe("lookup", match.lookup_s)
        elif self.unsupported:
            self._record("skipped_unsupported")
        elif not self.health.is_healthy:
            self._record("skipped_unhealthy")
        bs = self.block_size
        first = match.num_local_blocks
        last = first + num_external_tokens // bs
        # Blocks before num_pool are in the pool; local prefix-cache hits past them are saved.
        state.next_save_block = max(match.num_pool_blocks, last)
        state.first_load_block = first
        if state.hint is not None:
            self._note_hint(state, match)
        if num_external_tokens <= 0:
            return
        block_ids, indices, groups = self._blocks(blocks.get_block_ids(), first, last, is_load=True)
        hashes = [bytes(request.block_hashes[i]) for i in indices]
        self.plan.loaded(hashes)
        is_async = self._is_async(match.tiers[first:last])
        self._loads.append(
            TransferJob(request.request_id, block_ids, hashes, is_async=is_async, groups=groups)
        )

    def _note_hint(self, state: _RequestState, match: _Match) -> None:
        """A hinted request is scheduled: its blocks the pool holds get their priorities
        now, those the engine holds are remembered for their saves on eviction (the blocks
        it saves eagerly carry theirs: :meth:`_save_job`)."""
        assert state.hint is not None
        request = state.request
        num_blocks = min(len(request.block_hashes), request.num_prompt_tokens // self.block_size)
        priorities = state.hint.block_priorities(0, num_blocks, self.block_size)
        hashes = [bytes(h) for h in request.block_hashes[:num_blocks]]
        now = time.time()
        for block_hash, (priority, duration_s) in zip(hashes, priorities, strict=True):
            self._hints[block_hash] = (priority, now + duration_s if duration_s else 0.0)
            self._hints.move_to_end(block_hash)
        while len(self._hints) > self._max_hints:
            self._hints.popitem(last=False)
        num_held = max(match.num_pool_blocks, match.num_local_blocks)
        if num_held and self.health.is_healthy:
            self._retain(hashes[:num_held], priorities[:num_held])

    def _retain(self, hashes: list[bytes], priorities: list[tuple[int, float]]) -> None:
        """Retention hints for blocks the pool may hold, one call per priority and duration,
        under a lookup's deadline (a slow pool: no hint, never a slow step)."""
        for (priority, duration_s), chosen in by_hint(hashes, priorities).items():
            keys = [key for ns in self.full_spaces for key in ns.keys(chosen)]
            with self.guard.call("retain") as outcome:
                retained = self.client.retain(
                    keys, priority, duration_s, timeout=self.config.lookup_timeout_s
                )
            if not outcome.failed:
                self._record("retained_blocks", retained.num_retained)
                self._record("retention_refused", retained.num_refused)

    def _block_hints(self, hashes: list[bytes]) -> list[tuple[int, float]] | None:
        """Per block, its remembered hint with the duration left; None: none hinted."""
        if not self._hints:
            return None
        now = time.time()
        out = []
        for block_hash in hashes:
            priority, deadline = self._hints.get(block_hash, (DEFAULT_PRIORITY, 0.0))
            if deadline and deadline <= now:
                priority, deadline = DEFAULT_PRIORITY, 0.0
            out.append((priority, deadline - now if deadline else 0.0))
        return out if any(p != DEFAULT_PRIORITY for p, _ in out) else None

    def _blocks(
        self,
        group_block_ids: Sequence[Sequence[int]],
        first: int,
        last: int,
        *,
        is_load: bool = False,
    ) -> tuple[list[int], list[int], list[int] | None]:
        """Blocks ``first`` to ``last`` of a request: their ids, their indices in the
        request, and with several groups, each block's group.  A group's null blocks (a
        sliding window's blocks that the engine no longer reads, a recurrent state's blocks
        before the last) are neither saved nor loaded; a recurrent state group loads its
        last block only, and saves from vLLM's hand-offs only (:meth:`_state_saves`)."""
        if not self.partial_groups:
            return list(group_block_ids[0][first:last]), list(range(first, last)), None
        block_ids: list[int] = []
        indices: list[int] = []
        groups: list[int] = []
        for group in self.groups:
            ids = group_block_ids[group.index]
            start = first
            if group.kind == STATE:
                if not is_load:
                    continue
                start = max(first, last - 1)
            for i in range(start, min(last, len(ids))):
                if ids[i] != NULL_BLOCK_ID:
                    block_ids.append(ids[i])
                    indices.append(i)
                    groups.append(group.index)
        return block_ids, indices, groups if self.is_hybrid else None

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolMetadata:
        meta = KVPoolMetadata(loads=self._loads)
        self._loads = []
        if self.can_save and self.health.is_healthy:
            is_eager = self.plan.is_eager
            for req_id, num_computed in self._scheduled(scheduler_output):
                job = self._save_job(scheduler_output, req_id, num_computed)
                if job is None:
                    continue
                if is_eager:
                    meta.saves.append(job)
                    self.plan.saved(job.block_hashes)
                else:  # saved once the engine is about to drop them: their origins kept
                    self._remember_origins(job)
            if not is_eager:
                job = self._evicting_job()
                if job is not None:
                    meta.saves.append(job)
            if self.state_groups:
                meta.saves.extend(self._state_saves(scheduler_output))
        elif self.can_save:
            self._record("skipped_unhealthy")
        if self._client is not None and self._described_saving not in ("", self.plan.current):
            with self.guard.call("describe"):  # auto changed its mind: kvpool status says so
                self._describe(self._client)
        self._maybe_log()
        return meta

    def _remember_origins(self, job: TransferJob) -> None:
        """What the blocks a step computed were computed from, kept (at most the engine's
        blocks) until they are saved on eviction, for the node's KV events."""
        if job.origins is None:
            return
        for block_hash, origin in zip(job.block_hashes, job.origins, strict=True):
            if origin is None:
                continue
            self._computed_origins[block_hash] = origin
            self._computed_origins.move_to_end(block_hash)
        while len(self._computed_origins) > self._max_hints:
            self._computed_origins.popitem(last=False)

    def _evicting_job(self) -> TransferJob | None:
        """The save of the cached blocks the engine is about to drop (:mod:`.saving`)."""
        block_ids, hashes = self.plan.evicting()
        if not block_ids:
            return None
        self.plan.saved(hashes)
        self._record("evicting_saved_blocks", len(block_ids))
        retention = self._block_hints(hashes)
        known = self._computed_origins
        origins: list[BlockOrigin | None] | None = [known.pop(h, None) for h in hashes]
        if not any(origins or ()):
            origins = None  # nothing known of them (loaded, or computed long ago)
        for block_hash in hashes:
            self._hints.pop(block_hash, None)
        return TransferJob(EVICTING_REQ_ID, block_ids, hashes, origins, retention=retention)

    def _state_saves(self, scheduler_output: Any) -> list[TransferJob]:
        """Saves of the recurrent states vLLM hands off this step at prompt block
        boundaries: ``(group, block id, boundary)``, the state after ``boundary`` tokens,
        computed by this step's forward at the latest."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        jobs = []
        for req_id, entries in offloads.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            request = state.request
            bs = self.block_size
            num_blocks = min(len(request.block_hashes), request.num_prompt_tokens // bs)
            block_ids, hashes, groups = [], [], []
            for group_id, block_id, boundary in entries:
                index = boundary // bs - 1
                is_block_end = boundary % bs == 0 and 0 <= index < num_blocks
                if group_id in self.state_groups and is_block_end and block_id != NULL_BLOCK_ID:
                    block_ids.append(block_id)
                    hashes.append(bytes(request.block_hashes[index]))
                    groups.append(group_id)
            if block_ids:
                jobs.append(TransferJob(req_id, block_ids, hashes, groups=groups))
        return jobs

    def _scheduled(self, scheduler_output: Any) -> list[tuple[str, int]]:
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return scheduled

    def _save_job(
        self, scheduler_output: Any, req_id: str, num_computed: int
    ) -> TransferJob | None:
        state = self._requests.get(req_id)
        if state is None:
            return None
        request = state.request
        num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        # Computed by the end of this step, and hashed (vLLM hashes a block once its
        # tokens are known: drafts are not).
        end = num_computed + num_scheduled
        last = min(end // self.block_size, len(request.block_hashes))
        first = state.next_save_block
        if last <= first:
            return None
        group_block_ids = self._block_ids(scheduler_output, req_id)
        if group_block_ids is None or len(group_block_ids[0]) < last:
            return None
        state.next_save_block = last
        block_ids, indices, groups = self._blocks(group_block_ids, first, last)
        hashes = [bytes(request.block_hashes[i]) for i in indices]
        # KV events name a prefix's blocks once: a one-group engine's.
        origins = None if self.is_hybrid else self._origins(request, indices)
        retention = self._block_hints(hashes) if state.hint is not None else None
        return TransferJob(req_id, block_ids, hashes, origins, groups=groups, retention=retention)

    def _origins(self, request: Any, indices: list[int]) -> list[BlockOrigin | None] | None:
        """Each block's tokens and its parent's hash, for the node's KV events."""
        tokens = getattr(request, "all_token_ids", None)
        if tokens is None:
            return None
        bs = self.block_size
        return [
            BlockOrigin(
                token_ids=list(tokens[i * bs : (i + 1) * bs]),
                parent=bytes(request.block_hashes[i - 1]) if i > 0 else b"",
            )
            for i in indices
        ]

    def _block_ids(self, scheduler_output: Any, req_id: str) -> Sequence[Sequence[int]] | None:
        """The request's block ids, one list per group."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None:
            ids = block_state.get_block_ids(req_id)
            if ids is not None:
                return ids
        return None

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        return False, None

    def mark_load_failed(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is not None:
            state.load_failed = True

    def update_connector_output(self, connector_output: Any) -> None:
        """Worker stats reach the scheduler here: count them, and remember failed loads so
        that a request whose load failed is not offered the pool again."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        if stats is None:
            return
        data = dict(stats.data)
        for req_id in data.pop("failed_req_ids", ()):
            self.mark_load_failed(req_id)
            state = self._requests.get(req_id)
            if state is not None:  # the blocks it could not load are recomputed: save them
                state.next_save_block = state.first_load_block
        merge(self._interval, data)

    def take_stats(self) -> KVPoolStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVPoolStats()
        return stats

    def _record(self, name: str, value: float = 1) -> None:
        self.stats.add(name, value)
        self._interval.add(name, value)

    def _observe(self, kind: str, seconds: float) -> None:
        self.stats.observe(kind, seconds)
        self._interval.observe(kind, seconds)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.config.stats_interval_s:
            return
        self._last_log = now
        if not self._interval.is_empty():
            health = "healthy" if self.health.is_healthy else "UNHEALTHY"
            log.info("kvpool: %s (pool %s)", self._interval.line(), health)
        self._interval = KVPoolStats()

    def shutdown(self) -> None:
        self.health.stop()
        if self._client is not None:
            self._client.close()
