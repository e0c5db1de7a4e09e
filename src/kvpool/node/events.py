"""KV events: what this node holds, published the way vLLM publishes its own cache's, so
that routers that learn where KV lives from vLLM's events (llm-d, Dynamo, Kthena) learn the
pool's contents too.

Where they come from: the node, for every block it holds — whichever engine saved it, and
for removals, which only the node sees (eviction, deletion, corrupt blocks dropped).  An
engine's own events (vLLM's ``--kv-events-config``) keep describing its GPU cache; the
node's describe the pool, ``medium`` ``"CPU"`` (its DRAM).

- Transport: a ZMQ PUB socket; frames ``[topic, 8-byte big-endian sequence number,
  msgpack payload]``, the payload a ``KVEventBatch`` ``[ts, events, data_parallel_rank]``.
  An optional ROUTER socket replays: a request ``[b"", start_seq (8 bytes)]`` gets every
  buffered batch from there, then ``[b"", -1, b""]``.
- Events: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``), ``BlockRemoved`` (``block_hashes``, ``medium``),
  ``AllBlocksCleared`` (a node that starts empty, or is drained).  ``medium`` is ``"CPU"``
  for the DRAM arena and ``"STORAGE"`` for the disk tier: a block evicted from DRAM and
  written back is removed from one and stored in the other.
- Encodings (``encoding``): ``map``, vLLM's since mid-2026 (each event a map with a
  ``"type"`` field), or ``array``, the earlier one (each event an array led by its type's
  name).  A router with the other decoder sees no hits at all, so choose the one it reads.
- Hashes are 64-bit ints, as vLLM publishes them by default: the last 8 bytes of the block
  hash, big-endian (a key's block hash is what follows its namespace id).
- Token ids and the parent's hash are what a writer carried with the save
  (:class:`kvpool.keys.BlockOrigin`; the vLLM connector always does).  Blocks saved without
  them are announced with no tokens, and a parent of None.
- Publishing never holds up the store: events go through a bounded queue to a thread;
  past ``MAX_QUEUED`` the newest are dropped (and counted), and subscribers that fall behind
  recover through replay.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from kvpool.config import EventsConfig
from kvpool.errors import ConfigError
from kvpool.keys import NAMESPACE_ID_BYTES, BlockOrigin
from kvpool.store.block import Block
from kvpool.tiers.tier import MEDIUM_DRAM

log = logging.getLogger("kvpool.node")

MAX_QUEUED = 100_000
MAX_BATCH_EVENTS = 1024
FLUSH_S = 0.02  # events wait at most this long for others to share their batch
REPLAY_BATCHES = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it: its last 8 bytes as a big-endian int."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


# vLLM's event classes, both encodings (kvpool does not import vLLM: these are the wire
# schema; the tests decode them with vLLM's own classes).  The array form, as vLLM encoded
# events before: ``[type, field, ...]``, fields in order.
class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True):
    pass


# The map form: each event a map with a "type" field, the same fields, and ``lora_name``
# (required) after them.
class _Stored(_StoredArray, array_like=False):
    lora_name: str | None


class _Removed(_RemovedArray, array_like=False):
    pass


class _Cleared(_ClearedArray, array_like=False):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_CLASSES = {
    "map": (_Stored, _Removed, _Cleared),
    "array": (_StoredArray, _RemovedArray, _ClearedArray),
}


class KVEventPublisher:
    """The one place the node's KV events leave from: the sink given to the DRAM store
    (``BlockStore(events=...)``, :class:`~kvpool.store.block.StoreEvents`) and to the
    lower tiers (:class:`~kvpool.tiers.tier.TierEvents`) when they are built.  It turns
    blocks into vLLM's events and publishes them in batches from its own thread."""

    def __init__(self, config: EventsConfig):
        config.validate()
        import zmq  # only a node that publishes needs it

        self.config = config
        self._stored_cls, self._removed_cls, self._cleared_cls = _CLASSES[config.encoding]
        self._queue: queue.Queue[Any] = queue.Queue(MAX_QUEUED)
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._seq = 0
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = None
        self.replay_endpoint = ""
        try:
            self.endpoint = self._bind(self._pub, config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"cannot publish KV events: {exc}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: Any, endpoint: str) -> str:
        import zmq

        sock.bind(endpoint)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    # -- the sink (from the event loop and the tiers' threads: never block) ----------------

    def stored(self, block: Block) -> None:
        self.stored_key(block.key, block.origin, MEDIUM_DRAM)

    def removed(self, block: Block) -> None:
        self.removed_keys([block.key], MEDIUM_DRAM)

    def stored_key(self, key: bytes, origin: BlockOrigin | None, medium: str) -> None:
        """A block now in ``medium`` (thread-safe, never blocks)."""
        if origin is not None:
            parent = external_hash(origin.parent) if origin.parent else None
            tokens = list(origin.token_ids)
        else:
            parent, tokens = None, []
        fields: dict[str, Any] = {
            "block_hashes": [external_hash(key[NAMESPACE_ID_BYTES:])],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": len(tokens),
            "lora_id": None,
            "medium": medium,
        }
        if self._stored_cls is _Stored:
            fields["lora_name"] = None
        event = self._stored_cls(**fields)
        self._put(event)

    def removed_keys(self, keys: list[bytes], medium: str) -> None:
        """Blocks gone from ``medium`` (thread-safe, never blocks)."""
        hashes = [external_hash(key[NAMESPACE_ID_BYTES:]) for key in keys]
        self._put(self._removed_cls(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        self._put(self._cleared_cls())

    def _put(self, event: Any) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.num_dropped += 1

    # -- the publishing thread ------------------------------------------------------------

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running or not self._queue.empty():
            events = self._take()
            if events:
                self._publish(events)
            if self._replay is not None and poller.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a malformed request never stops the publisher
                    log.exception("kvpool: KV event replay request failed")

    def _take(self) -> list[Any]:
        try:
            first = self._queue.get(timeout=FLUSH_S)
        except queue.Empty:
            return []
        events = [first]
        deadline = time.monotonic() + FLUSH_S
        while len(events) < MAX_BATCH_EVENTS:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                events.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return events

    def _publish(self, events: list[Any]) -> None:
        payload = self._encoder.encode(_Batch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kvpool: malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
