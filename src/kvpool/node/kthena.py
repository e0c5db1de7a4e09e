"""Kthena's router scoring what the pool holds: the node writes and removes the Redis
entries of Kthena's cache-aware plugin as its DRAM stores and evicts blocks, for the
engines that load from it.  One more sink of the node's one KV event stream, beside the
ZMQ publisher (:mod:`kvpool.node.events`).

Kthena's schema and hashing, read from volcano-sh/kthena at commit
3cc057284c34469fcb0ed22a12dac84b1d120719 (``pkg/kthena-router/scheduler/plugins/
kvcache_aware.go``; its runtime sidecar ``python/kthena/runtime/kv_cache_manager.py``):

- one Redis hash per model and block, ``matrix:kv:block:{model}@{hash}``, whose fields are
  the pods that hold the block (``{pod}.{namespace}``), each valued with the Unix second it
  was written (the plugin drops an owner written before its pod's containers last started,
  and its GC drops fields older than 24 hours);
- a block is ``blockSizeToHash`` tokens (16 unless the plugin's arguments say otherwise),
  hashed on its own (not chained): SHA-256 of the token ids as 4-byte big-endian integers,
  the digest's first 8 bytes as a big-endian integer with its top bit cleared;
- the plugin scores a pod by how many leading blocks of the prompt it holds.

What the node does:

- Engines say who they are with their namespace's DESCRIBE (:class:`EngineRef`: pod and
  model, renewed every ``ENGINE_REFRESH_S``, forgotten ``ENGINE_TTL_S`` after the last):
  they are the pods that load that namespace's blocks from this node.  Only the operator's
  connections may (with ``--tenants``, a tenant's is refused: a tenant could otherwise
  name any pod, and steer the router with it).
- A block stored in DRAM whose writer said its tokens (:class:`~kvpool.keys.BlockOrigin`;
  the vLLM connector does) is ``len(tokens) / block_size`` Kthena blocks: each gets the
  namespace's live engines as owners; a block removed from DRAM (evicted, deleted, found
  corrupt) gives back exactly the owners its store gave (remembered per block, not read
  again at removal: an engine that joined since keeps its entries for blocks it holds).
  A block whose token count is not a multiple of Kthena's block size is not announced
  (said once in the log): set ``blockSizeToHash`` to the engine's block size or a divisor
  of it.
- Several pool blocks can be one Kthena block (the same tokens in two prompts, two
  tensor-parallel shards, a copy on this node and its home node): owners are counted, in
  Redis (``kvpool:kthena:refs:{model}@{hash}``, pod -> count, across nodes), and a field of
  Kthena's entry goes when its count does.  Each node also counts what it added
  (``kvpool:kthena:node:{host}/{name}``), so that a node that starts empty or is drained
  (``AllBlocksCleared``) takes back exactly its own.
- Exactly once: a batch of changes is one Lua script call, atomic, numbered (this sink's
  epoch, a random id per start, and its sequence); the script applies a batch only if this
  node's last applied one (``kvpool:kthena:applied:{host}/{name}``) is an earlier one, so a
  retry of a batch whose reply was late (Redis slower than ``REDIS_TIMEOUT_S``) changes
  nothing twice.  A count never exceeds the pool blocks that hold it.
- It never holds up the store: events go through a bounded queue to a thread that writes
  them (:class:`kvpool.node.sink.SinkThread`); past ``MAX_QUEUED`` the newest are dropped,
  and a Redis that does not answer is retried for ``RETRY_S``, then the batch is dropped
  (its entries age out by Kthena's own GC).  Each drop is logged (at most once every
  ``DROP_LOG_S``) and counted by what was lost (``num_dropped``: changes, in
  ``kvpool_kthena_dropped_total``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.config import KthenaConfig
from kvpool.keys import ENGINE_TTL_S, EngineRef, namespace_of
from kvpool.node.sink import SinkThread
from kvpool.store.block import Block

log = logging.getLogger("kvpool.node")

MATRIX_PREFIX = "matrix:kv:block:"  # Kthena's kvCacheKeyPrefix
REFS_PREFIX = "kvpool:kthena:refs:"
NODE_PREFIX = "kvpool:kthena:node:"
REFS_TTL_S = 48 * 3600  # counts outlive Kthena's 24-hour GC of its own fields
MAX_QUEUED = 100_000
MAX_BATCH = 512
RETRY_S = 10.0
REDIS_TIMEOUT_S = 2.0
APPLIED_PREFIX = "kvpool:kthena:applied:"
MAX_NAMESPACES = 1024  # namespaces with engines registered
MAX_ENGINES_PER_NAMESPACE = 64
DROP_LOG_S = 10.0
_CLEARED = "cleared"

# A batch of owner changes, applied once (KEYS: this node's last applied batch, this node's
# counts, then per change Kthena's entry and the counts; ARGV: epoch, sequence, now, the
# counts' TTL, then per change pod, delta, this node's field).  A batch numbered at or
# before the last applied one of the same epoch is a retry whose first try landed: skipped.
_BATCH = """
local applied = redis.call('HMGET', KEYS[1], 'epoch', 'seq')
if applied[1] == ARGV[1] and tonumber(applied[2]) >= tonumber(ARGV[2]) then return 0 end
local now, ttl = ARGV[3], ARGV[4]
for i = 0, (#KEYS - 2) / 2 - 1 do
  local entry, refs = KEYS[3 + 2 * i], KEYS[4 + 2 * i]
  local pod, delta, field = ARGV[5 + 3 * i], tonumber(ARGV[6 + 3 * i]), ARGV[7 + 3 * i]
  local n = redis.call('HINCRBY', refs, pod, delta)
  local mine = redis.call('HINCRBY', KEYS[2], field, delta)
  if mine <= 0 then redis.call('HDEL', KEYS[2], field) end
  if n <= 0 then
    redis.call('HDEL', refs, pod)
    redis.call('HDEL', entry, pod)
  else
    if delta > 0 then redis.call('HSET', entry, pod, now) end
    redis.call('EXPIRE', refs, ttl)
  end
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'seq', ARGV[2])
return 1
"""
# Changes in one script call: Redis runs a script alone, so a batch stays short.
MAX_SCRIPT_CHANGES = 1024


def kthena_hash(token_ids: Sequence[int]) -> int:
    """Kthena's ``computeStandardizedHash`` of one block's tokens."""
    digest = hashlib.sha256(b"".join(t.to_bytes(4, "big") for t in token_ids)).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def kthena_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The Kthena blocks of a pool block's tokens, or none if they are not whole ones."""
    if not token_ids or len(token_ids) % block_size:
        return []
    return [
        kthena_hash(token_ids[start : start + block_size])
        for start in range(0, len(token_ids), block_size)
    ]


def matrix_key(model: str, chunk_hash: int) -> str:
    """Kthena's ``KVCacheAwareBlock.String``."""
    return f"{MATRIX_PREFIX}{model}@{chunk_hash}"


@dataclass
class EngineTable:
    """The engines that load each namespace's blocks from this node (see the module's
    notes); touched on the event loop only."""

    clock: Any = time.monotonic
    by_namespace: dict[bytes, dict[str, tuple[str, float]]] = field(default_factory=dict)

    def attach(self, namespace_id: bytes, engine: EngineRef) -> bool:
        """Register or renew ``engine`` for the namespace; False past the bounds."""
        now = self.clock()
        engines = self.by_namespace.get(namespace_id)
        if engines is None:
            if len(self.by_namespace) >= MAX_NAMESPACES:
                self._expire(now)
                if len(self.by_namespace) >= MAX_NAMESPACES:
                    return False
            engines = self.by_namespace[namespace_id] = {}
        if engine.pod not in engines and len(engines) >= MAX_ENGINES_PER_NAMESPACE:
            return False
        engines[engine.pod] = (engine.model, now + ENGINE_TTL_S)
        return True

    def engines(self, namespace_id: bytes) -> list[tuple[str, str]]:
        """The live engines of a namespace, as (pod, model)."""
        engines = self.by_namespace.get(namespace_id)
        if not engines:
            return []
        now = self.clock()
        live = [(pod, model) for pod, (model, until) in engines.items() if until > now]
        if len(live) < len(engines):
            for pod in [pod for pod, (_, until) in engines.items() if until <= now]:
                del engines[pod]
            if not engines:
                del self.by_namespace[namespace_id]
        return live

    def _expire(self, now: float) -> None:
        for namespace_id in list(self.by_namespace):
            self.engines(namespace_id)


Owners = tuple[tuple[str, str], ...]  # (pod, model) of each engine


@dataclass(frozen=True)
class _Change:
    delta: int  # +1 stored, -1 removed
    owners: Owners
    token_ids: list[int]


class KthenaSink:
    """The sink (see the module's notes): ``stored``/``removed`` from the DRAM store,
    ``cleared`` when the node starts empty or is drained, ``attach`` from sessions."""

    def __init__(self, config: KthenaConfig, node_key: str, redis_client: Any = None):
        config.validate()
        self.config = config
        self.node_key = NODE_PREFIX + node_key
        if redis_client is None:
            import redis

            redis_client = redis.Redis.from_url(
                config.redis_url,
                socket_timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S,
            )
        self.redis = redis_client
        self._batch = self.redis.register_script(_BATCH)
        self.applied_key = APPLIED_PREFIX + node_key
        self._epoch = secrets.token_hex(8)  # this sink's batches, apart from a restart's
        self._seq = 0
        self.engines = EngineTable()
        # The owners each announced block was given (the same tuple for a namespace's
        # blocks while its engines stay): what its removal takes back.  Touched on the
        # event loop only.
        self._owners_of: dict[bytes, Owners] = {}
        self._interned: dict[Owners, Owners] = {}
        self.num_dropped = 0  # changes lost: the queue full, or Redis down past RETRY_S
        self.num_written = 0
        self._dropped_logged = 0.0
        self._warned_sizes: set[int] = set()
        self._sink: SinkThread[_Change | str] = SinkThread(
            "kvpool-kthena", self._drain, max_queued=MAX_QUEUED, max_batch=MAX_BATCH
        )
        self._sink.start()

    # -- from the event loop (never block) ------------------------------------------------

    def attach(self, namespace_id: bytes, engine: EngineRef) -> bool:
        return self.engines.attach(namespace_id, engine)

    def stored(self, block: Block) -> None:
        self._changed(block, +1)

    def removed(self, block: Block) -> None:
        self._changed(block, -1)

    def cleared(self) -> None:
        self._owners_of.clear()
        self._interned.clear()
        self._put(_CLEARED)

    def _changed(self, block: Block, delta: int) -> None:
        origin = block.origin
        if origin is None or not origin.token_ids:
            return
        if delta < 0:
            owners = self._owners_of.pop(block.key, None)  # exactly what its store gave
            if owners is None:
                return
        else:
            if block.key in self._owners_of:
                return  # announced already (stored twice without a removal)
            live = tuple(self.engines.engines(namespace_of(block.key)))
            if not live:
                return
            if len(origin.token_ids) % self.config.block_size:
                self._warn_size(len(origin.token_ids))
                return
            owners = self._interned.setdefault(live, live)
        if self._put(_Change(delta, owners, list(origin.token_ids))) and delta > 0:
            self._owners_of[block.key] = owners

    def _warn_size(self, num_tokens: int) -> None:
        if num_tokens not in self._warned_sizes and len(self._warned_sizes) < 16:
            self._warned_sizes.add(num_tokens)
            log.warning(
                "kthena: blocks of %d tokens are not whole Kthena blocks of %d: not announced "
                "(set --kthena-block-size and Kthena's blockSizeToHash to the engine's block "
                "size or a divisor of it)",
                num_tokens,
                self.config.block_size,
            )

    def _put(self, item: _Change | str) -> bool:
        if self._sink.put(item):
            return True
        self._dropped(1, f"{MAX_QUEUED} changes wait for Redis")
        return False

    def _dropped(self, num_changes: int, why: str) -> None:
        """Count ``num_changes`` changes lost, and say so (at most every ``DROP_LOG_S``):
        their entries stay in Kthena until its own GC, or never appear."""
        self.num_dropped += num_changes
        now = time.monotonic()
        if now - self._dropped_logged >= DROP_LOG_S:
            self._dropped_logged = now
            log.warning(
                "kthena: %d change(s) of Kthena's entries dropped so far (%s)",
                self.num_dropped,
                why,
            )

    # -- the writing thread ---------------------------------------------------------------

    def _drain(self, items: list[_Change | str]) -> None:
        changes: list[_Change] = []
        for item in items:  # in order: a clear takes back what was written before it
            if isinstance(item, _Change):
                changes.append(item)
                continue
            if changes:
                self._write(changes)
                changes = []
            self._retrying(1, self._clear_mine)
        if changes:
            self._write(changes)

    def _retrying(self, num_changes: int, write: Any, *args: Any) -> None:
        """Run ``write`` (of ``num_changes`` changes) until it lands, for at most
        ``RETRY_S`` (each batch it applies is numbered before the first try: a retry of
        one that landed changes nothing)."""
        deadline = time.monotonic() + RETRY_S
        delay = 0.05
        while True:
            try:
                write(*args)
                return
            except Exception as exc:  # Redis down or refusing: never the store's problem
                if time.monotonic() + delay > deadline or not self._sink.is_running:
                    self._dropped(num_changes, f"Redis did not take them: {exc}")
                    return
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _write(self, changes: list[_Change]) -> None:
        """The owners' changes of ``changes``, in numbered batches of at most
        ``MAX_SCRIPT_CHANGES``, each applied once."""
        ops = [
            (f"{model}@{chunk_hash}", pod, change.delta)
            for change in changes
            for chunk_hash in kthena_hashes(change.token_ids, self.config.block_size)
            for pod, model in change.owners
        ]
        for start in range(0, len(ops), MAX_SCRIPT_CHANGES):
            self._seq += 1
            batch = ops[start : start + MAX_SCRIPT_CHANGES]
            self._retrying(len(batch), self._apply, batch, self._seq)

    def _apply(self, ops: list[tuple[str, str, int]], seq: int) -> None:
        """One numbered batch of ``(model@hash, pod, delta)``, in one script call."""
        keys = [self.applied_key, self.node_key]
        args: list[Any] = [self._epoch, seq, str(int(time.time())), int(REFS_TTL_S)]
        for block, pod, delta in ops:
            keys += [MATRIX_PREFIX + block, REFS_PREFIX + block]
            args += [pod, delta, f"{block}|{pod}"]
        self._batch(keys=keys, args=args)  # 0: an earlier try of this batch landed
        self.num_written += len(ops)

    def _clear_mine(self) -> None:
        """Take back every owner this node added (it holds none of its blocks now): what
        its counts say, read again after a retry, so that nothing is taken back twice."""
        cursor = 0
        while True:
            cursor, fields = self.redis.hscan(self.node_key, cursor, count=MAX_BATCH)
            ops = []
            for raw_field, raw_count in fields.items():
                block, _, pod = raw_field.decode().rpartition("|")
                model, _, chunk_hash = block.rpartition("@")
                count = int(raw_count)
                if model and chunk_hash.isdigit() and count > 0:
                    ops.append((block, pod, -count))
            if ops:
                self._seq += 1
                self._apply(ops, self._seq)
            if not cursor:
                break
        self.redis.delete(self.node_key)

    # -- lifecycle ------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Until every event queued so far is written (or dropped); whether it was."""
        return self._sink.flush(timeout)

    def close(self) -> None:
        self._sink.close(RETRY_S + 5)
        self.redis.close()
