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
- Publishing never holds up the store: events go through a bounded queue to a thread
  (:class:`kvpool.node.sink.SinkThread`); past ``MAX_QUEUED`` the newest are dropped (and
  counted), and subscribers that fall behind recover through replay.

Who reads them (the events name what the node's clients computed; with tokens, their
prompts):

- Token ids are published only where the operator opts in (``--kv-events-token-ids``):
  routers that rehash blocks from their tokens need them, and they are the prompt's text.
- Without CURVE the sockets serve anybody who reaches them, so ``serve`` refuses them off
  loopback (``ipc://`` is local too) and with tenants, unless ``--insecure``
  (:meth:`kvpool.config.EventsConfig.check_transport`).
- With CURVE (``--kv-events-curve-key``, ``--kv-events-clients``) every socket is a CURVE
  server, and one ZAP handler admits, per socket, only the public keys the clients file
  gives it: the operator's keys on ``--kv-events`` (every block's events), each tenant's on
  its own PUB socket (``[tenants.NAME] endpoint``), which carries only that tenant's blocks
  (its keys' tag says whose a block is).  A SUBSCRIBE prefix is no boundary (a subscriber
  picks its own), so tenants never share a PUB socket.  The replay socket admits every key
  of the file and answers each with its own stream's batches only.
- Events come from the store and the tiers, never from a client's request: a block is
  announced once the node holds it, under the key the node scoped.  A tenant can only make
  the node announce blocks it really wrote, in its own namespace, so an external router
  must still treat a hit as a hint to verify (a load is checked against its checksum).
"""

from __future__ import annotations

import logging
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvpool.config import EventsConfig
from kvpool.errors import ConfigError
from kvpool.keys import NAMESPACE_ID_BYTES, BlockOrigin
from kvpool.node.sink import SinkThread
from kvpool.store.block import Block
from kvpool.tiers.tier import MEDIUM_DRAM

log = logging.getLogger("kvpool.node")

MAX_QUEUED = 100_000
MAX_BATCH_EVENTS = 1024
FLUSH_S = 0.02  # events wait at most this long for others to share their batch
REPLAY_BATCHES = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_CLIENTS_FILE_BYTES = 1 << 20
CURVE_KEY_CHARS = 40  # a Z85 public key
OPERATOR = ""  # the stream of every block (``--kv-events``); tenants' streams by name
EVERYONE = None  # an event for every stream (AllBlocksCleared)


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


@dataclass
class _Stream:
    """One PUB socket, its sequence numbers and the batches it can replay."""

    name: str  # OPERATOR, or a tenant's
    socket: Any
    endpoint: str
    seq: int = 0
    buffer: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=REPLAY_BATCHES))


@dataclass(frozen=True)
class EventClients:
    """The clients file: per stream, the CURVE public keys (Z85) that may read it::

    operator = ["<key>", ...]          # every block's events, on --kv-events
    [tenants.alpha]
    endpoint = "tcp://10.0.0.5:5561"   # alpha's blocks only
    keys = ["<key>", ...]
    """

    stream_keys: dict[str, frozenset[str]]  # stream name -> keys
    endpoints: dict[str, str]  # tenant -> its endpoint

    def stream_of(self, client_key: str) -> str | None:
        for name, keys in self.stream_keys.items():
            if client_key in keys:
                return name
        return None


def load_clients(path: str) -> EventClients:
    """Read and check the clients file; errors name the file and the field."""
    try:
        raw = Path(path).read_bytes()[: MAX_CLIENTS_FILE_BYTES + 1]
        if len(raw) > MAX_CLIENTS_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CLIENTS_FILE_BYTES} bytes")
        data = tomllib.loads(raw.decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read the KV event clients file {path}: {exc}") from None

    def keys(value: Any, where: str) -> frozenset[str]:
        if not isinstance(value, list) or not all(
            isinstance(k, str) and len(k) == CURVE_KEY_CHARS for k in value
        ):
            raise ConfigError(
                f"{path} {where}: a list of Z85 public keys ({CURVE_KEY_CHARS} chars)"
            )
        return frozenset(value)

    stream_keys = {OPERATOR: keys(data.get("operator", []), "operator")}
    endpoints = {}
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ConfigError(f"{path} [tenants]: a table of tenants")
    for name, table in tenants.items():
        if not name or not isinstance(table, dict) or not isinstance(table.get("endpoint"), str):
            raise ConfigError(f"{path} [tenants.{name}]: needs an endpoint and keys")
        stream_keys[name] = keys(table.get("keys", []), f"[tenants.{name}] keys")
        endpoints[name] = table["endpoint"]
    return EventClients(stream_keys, endpoints)


class _KeysOf:
    """The ZAP handler's question for one socket: may this client key read it?"""

    def __init__(self, allowed: Callable[[str], bool]):
        self.allowed = allowed

    def callback(self, domain: str, client_key: bytes | str) -> bool:
        text = client_key.decode() if isinstance(client_key, bytes) else client_key
        return self.allowed(text)


class KVEventPublisher:
    """The one place the node's KV events leave from: the sink given to the DRAM store
    (``BlockStore(events=...)``, :class:`~kvpool.store.block.StoreEvents`) and to the
    lower tiers (:class:`~kvpool.tiers.tier.TierEvents`) when they are built.  It turns
    blocks into vLLM's events and publishes them in batches from its own thread, each on
    the streams that may see it (see the module docstring).

    ``whose``: the tenant a key belongs to (None: nobody's, the operator stream only)."""

    def __init__(self, config: EventsConfig, whose: Callable[[bytes], str | None] | None = None):
        config.validate()
        import zmq  # only a node that publishes needs it

        self.config = config
        self._whose = whose
        self._stored_cls, self._removed_cls, self._cleared_cls = _CLASSES[config.encoding]
        self._sink: SinkThread[tuple[str | None, Any]] = SinkThread(
            "kvpool-events",
            self._drain,
            max_queued=MAX_QUEUED,
            max_batch=MAX_BATCH_EVENTS,
            gather_s=FLUSH_S,
        )
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._clients = load_clients(config.clients) if config.clients else None
        self._streams: dict[str, _Stream] = {}
        self._replay = None
        self.replay_endpoint = ""
        self._curve: tuple[bytes, bytes] | None = None
        try:
            self._curve = self._start_curve()
            self._streams[OPERATOR] = self._stream(OPERATOR, config.endpoint)
            if self._clients is not None:
                for name, endpoint in self._clients.endpoints.items():
                    self._streams[name] = self._stream(name, endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._secure(self._replay, "replay")
                self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        except (zmq.ZMQError, OSError, ValueError) as exc:
            self._close_sockets()
            raise ConfigError(f"cannot publish KV events: {exc}") from None
        except BaseException:
            self._close_sockets()
            raise
        self.endpoint = self._streams[OPERATOR].endpoint
        self._poller = zmq.Poller()
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self._sink.start()

    @property
    def tenant_endpoints(self) -> dict[str, str]:
        return {n: s.endpoint for n, s in self._streams.items() if n != OPERATOR}

    def _start_curve(self) -> tuple[bytes, bytes] | None:
        """The server's key pair, and the ZAP handler started (None: no CURVE)."""
        if not self.config.curve_key or self._clients is None:
            return None
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(self.config.curve_key)
        if not secret:
            raise ConfigError(f"{self.config.curve_key} holds no CURVE secret key")
        clients = self._clients
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        for name, keys in clients.stream_keys.items():
            self._auth.configure_curve_callback(f"stream:{name}", _KeysOf(keys.__contains__))
        every = frozenset().union(*clients.stream_keys.values())
        self._auth.configure_curve_callback("replay", _KeysOf(every.__contains__))
        return public, secret

    def _secure(self, sock: Any, domain: str) -> None:
        if self._curve is None:
            return
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = self._curve
        sock.zap_domain = domain.encode()

    def _stream(self, name: str, endpoint: str) -> _Stream:
        import zmq

        sock = self._ctx.socket(zmq.PUB)
        sock.set_hwm(100_000)
        self._secure(sock, f"stream:{name}")
        stream = _Stream(name, sock, "")
        self._streams[name] = stream  # closed with the others if binding fails
        stream.endpoint = self._bind(sock, endpoint)
        return stream

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
            num_tokens = len(origin.token_ids)
            tokens = list(origin.token_ids) if self.config.token_ids else []
        else:
            parent, tokens, num_tokens = None, [], 0
        fields: dict[str, Any] = {
            "block_hashes": [external_hash(key[NAMESPACE_ID_BYTES:])],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": num_tokens,
            "lora_id": None,
            "medium": medium,
        }
        if self._stored_cls is _Stored:
            fields["lora_name"] = None
        event = self._stored_cls(**fields)
        self._put(self._owner(key), event)

    def removed_keys(self, keys: list[bytes], medium: str) -> None:
        """Blocks gone from ``medium`` (thread-safe, never blocks)."""
        by_owner: dict[str | None, list[int]] = {}
        for key in keys:
            by_owner.setdefault(self._owner(key), []).append(
                external_hash(key[NAMESPACE_ID_BYTES:])
            )
        for owner, hashes in by_owner.items():
            self._put(owner, self._removed_cls(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        self._put(EVERYONE, self._cleared_cls())

    def _owner(self, key: bytes) -> str:
        """The stream of a key's events besides the operator's: its tenant's, if any."""
        name = self._whose(key) if self._whose is not None else None
        return name if name is not None and name in self._streams else OPERATOR

    def _put(self, owner: str | None, event: Any) -> None:
        if not self._sink.put((owner, event)):
            self.num_dropped += 1

    # -- the publishing thread ------------------------------------------------------------

    def _drain(self, events: list[tuple[str | None, Any]]) -> None:
        """Publish a batch, then answer the replay requests waiting (between batches)."""
        if events:
            self._publish(events)
        if self._replay is not None and self._poller.poll(0):
            try:
                self._serve_replay()
            except Exception:  # a malformed request never stops the publisher
                log.exception("kvpool: KV event replay request failed")

    def _publish(self, events: list[tuple[str | None, Any]]) -> None:
        now = time.time()
        for stream in self._streams.values():
            mine = [
                event
                for owner, event in events
                if stream.name == OPERATOR or owner is EVERYONE or owner == stream.name
            ]
            if not mine:
                continue
            payload = self._encoder.encode(_Batch(ts=now, events=mine))
            seq = stream.seq
            stream.seq += 1
            stream.socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            stream.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(copy=False)
        if len(frames) != 3 or len(frames[2].bytes) != 8:
            log.warning("kvpool: malformed KV event replay request (%d frames)", len(frames))
            return
        stream = self._streams.get(self._requester(frames[-1]) or "")
        client = frames[0].bytes
        if stream is not None:
            start_seq = int.from_bytes(frames[2].bytes, "big")
            for seq, payload in list(stream.buffer):
                if seq >= start_seq:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _requester(self, frame: Any) -> str | None:
        """The stream the client that sent ``frame`` may replay: by the CURVE key ZAP
        admitted it with (without CURVE, the operator's)."""
        if self._clients is None:
            return OPERATOR
        try:
            user_id = frame.get("User-Id")
        except Exception:  # no ZAP user id: not a client the handler admitted
            return None
        return self._clients.stream_of(user_id) if user_id else None

    def _close_sockets(self) -> None:
        for stream in self._streams.values():
            stream.socket.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def close(self) -> None:
        self._sink.close(5)
        self._close_sockets()
