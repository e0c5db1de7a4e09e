"""One connection to one node, blocking or asyncio, and the drivers that run the I/O-free
operations of :mod:`kvpool.client.ops` over it.

This is the one place where socket errors become kvpool errors: ``OSError`` turns into
:class:`ConnectError` (while connecting) or :class:`NodeUnavailable` (after), timeouts
into :class:`PoolTimeout`.  A connection that failed mid-request is *broken* and must not
be reused; one that received an error status is still usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import socket
import time
from collections.abc import Generator
from typing import Any, TypeVar

from kvpool.config import Address, ClientConfig
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
from kvpool.protocol.channel import AsyncChannel, SyncChannel
from kvpool.protocol.frames import FLAG_NO_REPLY, decode_error, decode_response, encode_frame
from kvpool.protocol.messages import Welcome

from . import ops

T = TypeVar("T")

ASYNC_COPY_OFFLOAD_BYTES = 1 << 20
SOCKET_BUFFER_BYTES = 4 << 20


def _open_socket(address: Address, timeout: float) -> socket.socket:
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
    except TimeoutError as exc:
        raise ConnectError(f"connecting to {address} timed out", node=str(address)) from exc
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to {address}: {exc.strerror or exc}", node=str(address)
        ) from exc
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    return sock


def map_arena(welcome: Welcome, config: ClientConfig) -> memoryview | None:
    """Map the node's arena if it is the very file on this host, else ``None`` (then the
    client streams over the socket)."""
    if not config.use_shm or welcome.host_id != config.host_id:
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
        # Populate the page tables now: a first-touch fault per 4 KiB page would halve the
        # speed of every first copy into a part of the arena.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(fd, welcome.arena_bytes, flags))
    except OSError:
        return None
    finally:
        os.close(fd)


class _Driver:
    """What the blocking and asyncio connections share."""

    node: str
    broken: bool
    welcome: Welcome
    arena: memoryview | None

    def __init__(self) -> None:
        self._request_ids = itertools.count(1)
        self._expected_id = 0
        self.broken = False
        self.arena = None
        self.last_used = time.monotonic()

    def _frame(self, effect: ops.Request) -> list[Any]:
        request_id = next(self._request_ids) & 0xFFFFFFFF
        if not effect.no_reply:
            self._expected_id = request_id
        flags = FLAG_NO_REPLY if effect.no_reply else 0
        frame = encode_frame(
            effect.op,
            effect.message,
            payload_len=effect.payload_len,
            request_id=request_id,
            flags=flags,
        )
        return [frame, *effect.payload]

    def _check_response(self, header: Any, expected_op: int, meta: bytes) -> None:
        if header.status != 0:
            raise error_for_status(header.status, decode_error(meta), node=self.node)
        if not header.is_response or header.op != expected_op:
            raise ProtocolError(f"expected a response to op {expected_op}, got op {header.op}")
        if expected_op != ops.Op.CHALLENGE and header.request_id != self._expected_id:
            raise ProtocolError(
                f"response to request {header.request_id}, expected {self._expected_id}"
            )


class Connection(_Driver):
    """A blocking connection."""

    def __init__(self, address: Address, config: ClientConfig, deadline: float):
        super().__init__()
        self.address = address
        self.node = str(address)
        timeout = min(config.connect_timeout_s, max(deadline - time.monotonic(), 0.001))
        self.channel = SyncChannel(_open_socket(address, timeout))
        try:
            self.welcome = self.run(
                ops.handshake(config.access_id, config.access_key, config.host_id, "kvpool-client"),
                deadline,
            )
        except BaseException:
            self.close()
            raise
        self.node = self.welcome.node_id or self.node

    def run(self, op: Generator[Any, Any, T], deadline: float) -> T:
        """Drive one operation to its end; any failure but an error status breaks the
        connection."""
        self.channel.deadline = deadline
        try:
            effect = next(op)
            while True:
                effect = op.send(self._perform(effect))
        except StopIteration as stop:
            self.last_used = time.monotonic()
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
            raise NodeUnavailable(f"connection failed: {exc}", node=self.node) from exc
        except BaseException:
            self.broken = True
            raise

    def _perform(self, effect: Any) -> Any:
        channel = self.channel
        if isinstance(effect, ops.Request):
            channel.send(self._frame(effect))
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
        self.broken = True
        with contextlib.suppress(OSError):
            self.channel.sock.close()


class AsyncConnection(_Driver):
    """An asyncio connection."""

    def __init__(self, address: Address, config: ClientConfig):
        super().__init__()
        self.address = address
        self.config = config
        self.node = str(address)
        self.channel: AsyncChannel | None = None

    async def open(self, deadline: float) -> AsyncConnection:
        loop = asyncio.get_running_loop()
        timeout = min(self.config.connect_timeout_s, max(deadline - time.monotonic(), 0.001))
        try:
            async with asyncio.timeout(timeout):
                sock = await loop.run_in_executor(None, _open_socket, self.address, timeout)
        except TimeoutError as exc:
            raise ConnectError(f"connecting to {self.address} timed out", node=self.node) from exc
        self.channel = AsyncChannel(sock, loop)
        config = self.config
        try:
            self.welcome = await self.run(
                ops.handshake(config.access_id, config.access_key, config.host_id, "kvpool-async"),
                deadline,
            )
        except BaseException:
            self.close()
            raise
        self.node = self.welcome.node_id or self.node
        return self

    async def run(self, op: Generator[Any, Any, T], deadline: float) -> T:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise PoolTimeout("deadline passed", node=self.node)
            async with asyncio.timeout(remaining):
                effect = next(op)
                while True:
                    effect = op.send(await self._perform(effect))
        except StopIteration as stop:
            self.last_used = time.monotonic()
            return stop.value
        except TimeoutError as exc:
            self.broken = True
            raise PoolTimeout("timed out waiting for the node", node=self.node) from exc
        except StoreError:
            raise
        except TransportError:
            self.broken = True
            raise
        except KVPoolError as exc:
            self.broken = True
            if exc.node is None:
                exc.node = self.node
            raise
        except OSError as exc:
            self.broken = True
            raise NodeUnavailable(f"connection failed: {exc}", node=self.node) from exc
        except BaseException:
            self.broken = True
            raise

    async def _perform(self, effect: Any) -> Any:
        channel = self.channel
        assert channel is not None
        if isinstance(effect, ops.Request):
            await channel.send(self._frame(effect))
            return None
        if isinstance(effect, ops.Send):
            await channel.send(effect.parts)
            return None
        if isinstance(effect, ops.Recv):
            header = await channel.recv_header()
            meta = await channel.recv_meta(header.meta_len)
            self._check_response(header, effect.op, meta)
            return decode_response(header.op, meta, effect.type), header.payload_len
        if isinstance(effect, ops.RecvInto):
            await channel.recv_into(effect.view, effect.hasher)
            return None
        if isinstance(effect, ops.Skip):
            await channel.skip(effect.num_bytes)
            return None
        if isinstance(effect, ops.Compute):
            if effect.num_bytes >= ASYNC_COPY_OFFLOAD_BYTES:
                copy = asyncio.get_running_loop().run_in_executor(None, effect.fn)
                try:
                    return await asyncio.shield(copy)
                except asyncio.CancelledError:
                    # A copy into the arena must end before the connection (and with it
                    # the reservation) goes: the memory could be another key's after.
                    with contextlib.suppress(Exception):
                        await copy
                    raise
            return effect.fn()
        raise TypeError(f"unknown effect {effect!r}")

    def close(self) -> None:
        self.broken = True
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.close()
