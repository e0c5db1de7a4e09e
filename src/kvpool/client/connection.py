"""One blocking connection to one node, and the driver that runs the I/O-free operations of
:mod:`kvpool.client.ops` over it.

This is the client's one error boundary: what sockets raise becomes a kvpool error in
:func:`transport_error` and nowhere else — ``OSError`` while connecting becomes
:class:`ConnectError`, a timeout :class:`PoolTimeout`, any other ``OSError`` (the node
hung up, a reset) :class:`NodeUnavailable`.  A connection that failed mid-request is
*broken* and must not be reused; one that received an error status from the store is still
usable.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import socket
import ssl
import time
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from kvpool.config import Address, ClientConfig
from kvpool.directory import DirectoryReader
from kvpool.errors import (
    ConnectError,
    KVPoolError,
    NodeUnavailable,
    PoolTimeout,
    ProtocolError,
    StoreError,
    TransportError,
    error_for_status,
)
from kvpool.mapping import map_shared
from kvpool.protocol import auth
from kvpool.protocol.channel import SyncChannel
from kvpool.protocol.frames import (
    FLAG_NO_REPLY,
    FrameHeader,
    decode_error,
    decode_response,
    encode_frame,
)
from kvpool.protocol.messages import KeysRequest, Op, Welcome
from kvpool.tls import client_context

from . import ops
from .writes import WriteArea

T = TypeVar("T")

SOCKET_BUFFER_BYTES = 4 << 20
# TOUCH notices (reads made through the node's directory) wait for the connection's next
# frame, up to this many keys or this long: a notice of its own wakes the node, and on a
# small host that costs the reader ~0.15 ms per call.
TOUCH_BATCH_KEYS = 512
TOUCH_BATCH_S = 0.05


def transport_error(exc: OSError, node: str, *, connecting: bool = False) -> TransportError:
    """The kvpool error for what a socket raised talking to ``node``."""
    if connecting:
        what = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        return ConnectError(f"cannot connect to {node}: {what}", node=node)
    if isinstance(exc, TimeoutError):
        return PoolTimeout("timed out waiting for the node", node=node)
    return NodeUnavailable(f"connection failed: {exc}", node=node)


def open_socket(
    address: Address,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    server_name: str = "",
) -> socket.socket:
    """A connected socket; a TCP one wrapped in TLS (handshake done) when ``tls`` is given,
    the node's certificate checked for ``server_name`` (default: the address's host)."""
    node = str(address)
    try:
        if address.kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((address.host, address.port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        raise transport_error(exc, node, connecting=True) from exc
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    if tls is not None and address.kind == "tcp":
        try:
            sock = tls.wrap_socket(sock, server_hostname=server_name or address.host)
        except ssl.SSLError as exc:
            sock.close()
            raise ConnectError(f"TLS with {node} failed: {exc.reason or exc}", node=node) from exc
        except OSError as exc:
            sock.close()
            raise transport_error(exc, node, connecting=True) from exc
    return sock


@functools.lru_cache(maxsize=16)
def _tls_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    return client_context(ca, cert, key)


def tls_for(config: ClientConfig) -> ssl.SSLContext | None:
    """The client's TLS context (one per distinct configuration), or None for plaintext."""
    return _tls_context(config.tls_ca, config.tls_cert, config.tls_key) if config.uses_tls else None


def map_arena(welcome: Welcome, config: ClientConfig) -> memoryview | None:
    """Map the node's arena if it is the very file on this host, else ``None`` (then the
    client streams over the socket)."""
    if not config.use_shm or not welcome.arena_path or welcome.host_id != config.host_id:
        return None
    try:
        fd = os.open(welcome.arena_path, os.O_RDWR)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        if (stat.st_dev, stat.st_ino) != (welcome.arena_dev, welcome.arena_ino):
            return None
        if stat.st_size < welcome.arena_bytes:
            return None
        return memoryview(map_shared(fd, welcome.arena_bytes))
    except OSError:
        return None
    finally:
        os.close(fd)


class Connection:
    """A blocking connection, authenticated at construction."""

    def __init__(self, address: Address, config: ClientConfig, deadline: float):
        self.address = address
        self.node = str(address)
        self.broken = False
        self.arena: memoryview | None = None
        self.directory: DirectoryReader | None = None  # the arena's, where readers may use it
        self.area = WriteArea()  # where this connection's puts go, once the node granted it
        self._request_ids = itertools.count(1)
        self._expected_ids: collections.deque[int] = collections.deque()  # replies due
        self._touched: list[bytes] = []  # keys of TOUCH notices not sent yet
        self._touched_since = 0.0
        timeout = min(config.connect_timeout_s, max(deadline - time.monotonic(), 0.001))
        self.channel = SyncChannel(
            open_socket(address, timeout, tls_for(config), config.tls_server_name)
        )
        try:
            binding = auth.client_binding(self.channel.sock, address.path)
            handshake = ops.handshake(
                config.access_id, config.access_key, config.host_id, "kvpool-client", binding
            )
            self.welcome: Welcome = self.run(handshake, deadline)
        except BaseException:
            self.close()
            raise
        self.node = self.welcome.node_id or self.node

    def run(self, op: Generator[Any, Any, T], deadline: float) -> T:
        """Drive one operation to its end; any failure but a store's error status breaks
        the connection."""
        self.channel.deadline = deadline
        try:
            effect = next(op)
            while True:
                effect = op.send(self._perform(effect))
        except StopIteration as stop:
            return stop.value
        except StoreError:
            raise
        except KVPoolError as exc:
            self.broken = True
            if exc.node is None:
                exc.node = self.node
            raise
        except OSError as exc:
            self.broken = True
            raise transport_error(exc, self.node) from exc
        except BaseException:
            self.broken = True
            raise

    def _frame(self, effect: ops.Request) -> list[Any]:
        touched = self._touch_frames()
        request_id = next(self._request_ids) & 0xFFFFFFFF
        if not effect.no_reply:
            self._expected_ids.append(request_id)
        flags = FLAG_NO_REPLY if effect.no_reply else 0
        frame = encode_frame(
            effect.op,
            effect.message,
            payload_len=effect.payload_len,
            request_id=request_id,
            flags=flags,
        )
        return [*touched, frame, *effect.payload]

    def _touch_frames(self) -> list[bytes]:
        """The TOUCH notice of the keys waiting to be told, if any (taking them)."""
        if not self._touched:
            return []
        keys, self._touched = self._touched, []
        request_id = next(self._request_ids) & 0xFFFFFFFF
        message = KeysRequest(keys=keys)
        return [encode_frame(Op.TOUCH, message, request_id=request_id, flags=FLAG_NO_REPLY)]

    def _defer_touch(self, keys: Sequence[bytes]) -> None:
        if not self._touched:
            self._touched_since = time.monotonic()
        self._touched.extend(keys)
        too_old = time.monotonic() - self._touched_since >= TOUCH_BATCH_S
        if len(self._touched) >= TOUCH_BATCH_KEYS or too_old:
            self.channel.send(self._touch_frames())

    def _check_response(self, header: FrameHeader, expected_op: int, meta: bytes) -> None:
        """Replies come in the order of the requests: this one answers the oldest due."""
        due = self._expected_ids
        expected_id = due.popleft() if due and expected_op != Op.CHALLENGE else 0
        if header.status != 0:
            raise error_for_status(header.status, decode_error(meta), node=self.node)
        if not header.is_response or header.op != expected_op:
            raise ProtocolError(f"expected a response to op {expected_op}, got op {header.op}")
        if expected_op != Op.CHALLENGE and header.request_id != expected_id:
            raise ProtocolError(f"response to request {header.request_id}, expected {expected_id}")

    def _perform(self, effect: Any) -> Any:
        channel = self.channel
        if isinstance(effect, ops.Request):
            channel.send(self._frame(effect))
            return None
        if isinstance(effect, ops.Touched):
            self._defer_touch(effect.keys)
            return None
        if isinstance(effect, ops.Send):
            channel.send(effect.parts)
            return None
        if isinstance(effect, ops.Recv):
            header = channel.recv_header()
            meta = channel.recv_meta(header.meta_len)
            self._check_response(header, effect.op, meta)
            return decode_response(header.op, meta, effect.type), header.payload_len
        if isinstance(effect, ops.RecvInto):
            channel.recv_into(effect.view, effect.hasher)
            return None
        if isinstance(effect, ops.Skip):
            channel.skip(effect.num_bytes)
            return None
        if isinstance(effect, ops.Compute):
            return effect.fn()
        raise TypeError(f"unknown effect {effect!r}")

    def close(self) -> None:
        if self._touched and not self.broken:  # best effort: what was read is told
            self.channel.deadline = time.monotonic() + 0.1
            with contextlib.suppress(OSError):
                self.channel.send(self._touch_frames())
        self.broken = True
        with contextlib.suppress(OSError):
            self.channel.sock.close()
