"""Frame I/O over a socket: a blocking channel (sync client) and an asyncio channel (daemon,
async client).  Both share :class:`~kvpool.protocol.frames.RecvBuffer` and differ only in how
they wait.

Payloads are received straight into the caller's destination (an arena slot, a user
buffer) and sent with scatter-gather ``sendmsg`` from where they lie: no staging copies.
``recv_into`` can feed a hasher with each piece as it arrives, while it is still in cache.

Over TLS (an :class:`ssl.SSLSocket`) the same calls work; sends go part by part, since
OpenSSL has no scatter-gather write.

The channels raise only what sockets raise: :class:`PeerClosed` (an ``OSError``) when the
other side hangs up, ``TimeoutError`` when the blocking channel's deadline passes, and
``OSError``.  Each side translates them once: the client into kvpool's transport errors
(:mod:`kvpool.client.connection`), the daemon into the end of a session.
"""

from __future__ import annotations

import asyncio
import math
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.protocol.frames import HEADER_BYTES, FrameHeader, RecvBuffer, parse_header

Buffer = bytes | bytearray | memoryview
IOV_MAX = 512
DISCARD_BYTES = 1 << 20
_discard = memoryview(bytearray(DISCARD_BYTES))


# What a non-blocking socket call raises when it must wait (TLS included).
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class PeerClosed(ConnectionError):
    """The other side closed the connection."""


def _advance(parts: list[memoryview], num_sent: int) -> list[memoryview]:
    """Drop ``num_sent`` bytes from the front of ``parts``."""
    index = 0
    while index < len(parts) and num_sent >= len(parts[index]):
        num_sent -= len(parts[index])
        index += 1
    rest = parts[index:]
    if rest and num_sent:
        rest[0] = rest[0][num_sent:]
    return rest


def _as_views(parts: Sequence[Buffer]) -> list[memoryview]:
    return [
        memoryview(p).cast("B") if not isinstance(p, memoryview) else p for p in parts if len(p)
    ]


class SyncChannel:
    """Blocking frame I/O with a per-call deadline.

    The socket itself is non-blocking: each send and receive is tried at once and waits in
    ``poll`` only when the socket says it must, for what is left of the deadline.  (A socket
    timeout set per call would cost an ``ioctl`` each time it is set, and a ``poll`` before
    every send and receive: six system calls a round trip where four do.)"""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.rbuf = RecvBuffer(64 << 10)
        self.deadline: float | None = None
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)
        self._writable = select.poll()
        self._writable.register(sock, select.POLLOUT)

    def _check_deadline(self) -> None:
        if self.deadline is not None and self.deadline <= time.monotonic():
            raise TimeoutError("deadline passed")

    def _wait_for(self, exc: BaseException, *, reading: bool) -> None:
        """Wait until the socket can go on after a non-blocking call raised ``exc`` (TLS may
        need to write while reading, or read while writing), at most until the deadline."""
        if isinstance(exc, ssl.SSLWantWriteError):
            poller = self._writable
        elif isinstance(exc, ssl.SSLWantReadError) or reading:
            poller = self._readable
        else:
            poller = self._writable
        timeout_ms = None
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            timeout_ms = math.ceil(remaining * 1000)
        if not poller.poll(timeout_ms):
            raise TimeoutError("deadline passed")

    def _recv_into(self, view: memoryview) -> int:
        while True:
            self._check_deadline()
            try:
                num = self.sock.recv_into(view)
            except _WOULD_BLOCK as exc:
                self._wait_for(exc, reading=True)
                continue
            except ssl.SSLZeroReturnError:
                num = 0
            return num

    def _fill(self, want: int) -> None:
        while self.rbuf.num_buffered < want:
            num = self._recv_into(self.rbuf.writable(want - self.rbuf.num_buffered))
            if num == 0:
                raise PeerClosed("connection closed by the peer")
            self.rbuf.produced(num)

    def recv_header(self) -> FrameHeader:
        self._fill(HEADER_BYTES)
        return parse_header(self.rbuf.take(HEADER_BYTES))

    def recv_meta(self, num_bytes: int) -> bytes | bytearray:
        if not self.rbuf.holds(num_bytes):  # a buffer of its own, dropped after the frame
            meta = bytearray(num_bytes)
            self.recv_into(memoryview(meta))
            return meta
        self._fill(num_bytes)
        return self.rbuf.take(num_bytes)

    def recv_into(self, dst: memoryview, hasher: Any = None) -> None:
        done = self.rbuf.drain_into(dst)
        if hasher is not None and done:
            hasher.update(dst[:done])
        while done < len(dst):
            num = self._recv_into(dst[done:])
            if num == 0:
                raise PeerClosed("connection closed mid-payload")
            if hasher is not None:
                hasher.update(dst[done : done + num])
            done += num

    def skip(self, num_bytes: int) -> None:
        while num_bytes:
            piece = min(num_bytes, DISCARD_BYTES)
            self.recv_into(_discard[:piece])
            num_bytes -= piece

    def send(self, parts: Sequence[Buffer]) -> None:
        views = _as_views(parts)
        while views:
            self._check_deadline()
            try:
                num = self.sock.send(views[0]) if self._tls else self.sock.sendmsg(views[:IOV_MAX])
            except _WOULD_BLOCK as exc:
                self._wait_for(exc, reading=False)
                continue
            views = _advance(views, num)


class AsyncChannel:
    """Non-blocking frame I/O on an event loop, waiting with add_reader / add_writer."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        buffer_bytes: int = RecvBuffer.INITIAL_BYTES,
        grows: bool = True,
    ):
        """``buffer_bytes``: the read-ahead buffer to start with; ``grows``: whether it grows
        with the frames it receives, or keeps its size (:class:`RecvBuffer`: a node's
        sessions start small, so an unauthenticated peer costs little, and never grow)."""
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop or asyncio.get_running_loop()
        self.rbuf = RecvBuffer(buffer_bytes, grows=grows)
        self._fd = sock.fileno()
        self._tls = isinstance(sock, ssl.SSLSocket)
        # The socket stays registered for reading from one request to the next (see
        # _readable): a session that waits for each request costs no event-loop
        # registration, and no poll handle made and closed, per request.
        self._read_waiter: asyncio.Future[None] | None = None
        self._is_watching = False
        self.num_read_waits = 0  # times a read waited for the socket (see recv_header)

    async def handshake(self) -> None:
        """Complete a TLS handshake (a no-op on a plain socket)."""
        if not self._tls:
            return
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            try:
                self.sock.do_handshake()
                return
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as exc:
                await self._wait_for(exc, reading=True)

    async def _wait_for(self, exc: BaseException, *, reading: bool) -> None:
        """Wait until the socket can go on after a non-blocking call raised ``exc``: TLS may
        need to write while reading, or read while writing; otherwise the call's own way."""
        if isinstance(exc, ssl.SSLWantWriteError):
            await self._writable()
        elif isinstance(exc, ssl.SSLWantReadError) or reading:
            await self._readable()
        else:
            await self._writable()

    async def _readable(self) -> None:
        """Wait until the socket has something to read.  The reader is registered on the
        first wait and left in place after it: a busy session waits for its next request
        right after each reply, so registering and removing it each time would cost two
        epoll changes and a poll handle per request.  Readiness that finds nobody waiting
        (the session is busy elsewhere) removes it, so a level-triggered socket with
        unread data never spins the loop."""
        future = self.loop.create_future()
        self._read_waiter = future
        self.num_read_waits += 1
        if not self._is_watching:
            self.loop.add_reader(self._fd, self._on_readable)
            self._is_watching = True
        try:
            await future
        finally:
            self._read_waiter = None

    def _on_readable(self) -> None:
        waiter = self._read_waiter
        if waiter is None:
            self._stop_watching()
        elif not waiter.done():
            waiter.set_result(None)

    def _stop_watching(self) -> None:
        if self._is_watching:
            self._is_watching = False
            self.loop.remove_reader(self._fd)

    async def _writable(self) -> None:
        await self._ready(self.loop.add_writer, self.loop.remove_writer)

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], Any]) -> None:
        future = self.loop.create_future()
        add(self._fd, _wake, future)
        try:
            await future
        finally:
            remove(self._fd)

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            try:
                num = self.sock.recv_into(view)
            except _WOULD_BLOCK as exc:
                await self._wait_for(exc, reading=True)
                continue
            except ssl.SSLZeroReturnError:
                num = 0
            if num == 0:
                raise PeerClosed("connection closed by the peer")
            return num

    async def _fill(self, want: int) -> None:
        while self.rbuf.num_buffered < want:
            num = await self._recv_into(self.rbuf.writable(want - self.rbuf.num_buffered))
            self.rbuf.produced(num)

    async def recv_header(self) -> FrameHeader:
        await self._fill(HEADER_BYTES)
        return parse_header(self.rbuf.take(HEADER_BYTES))

    async def recv_meta(self, num_bytes: int) -> bytes | bytearray:
        if not self.rbuf.holds(num_bytes):  # a buffer of its own, dropped after the frame
            meta = bytearray(num_bytes)
            await self.recv_into(memoryview(meta))
            return meta
        await self._fill(num_bytes)
        return self.rbuf.take(num_bytes)

    async def recv_into(self, dst: memoryview, hasher: Any = None) -> None:
        done = self.rbuf.drain_into(dst)
        if hasher is not None and done:
            hasher.update(dst[:done])
        while done < len(dst):
            num = await self._recv_into(dst[done:])
            if hasher is not None:
                hasher.update(dst[done : done + num])
            done += num

    async def skip(self, num_bytes: int) -> None:
        while num_bytes:
            piece = min(num_bytes, DISCARD_BYTES)
            await self.recv_into(_discard[:piece])
            num_bytes -= piece

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = _as_views(parts)
        while views:
            try:
                tls = self._tls
                num = self.sock.send(views[0]) if tls else self.sock.sendmsg(views[:IOV_MAX])
            except _WOULD_BLOCK as exc:
                await self._wait_for(exc, reading=False)
                continue
            views = _advance(views, num)

    def send_now(self, parts: Sequence[Buffer]) -> list[memoryview]:
        """Send what the socket takes without waiting; what is left (empty: all of it went),
        for :meth:`send` to finish.  A caller that bounds a send's time needs a timer only
        for what is left: usually nothing."""
        views = _as_views(parts)
        while views:
            try:
                tls = self._tls
                num = self.sock.send(views[0]) if tls else self.sock.sendmsg(views[:IOV_MAX])
            except _WOULD_BLOCK:
                return views
            views = _advance(views, num)
        return views

    def close(self) -> None:
        if not self.loop.is_closed():
            self._stop_watching()  # before the fd number can be another socket's
        self.sock.close()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
