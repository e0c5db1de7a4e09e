"""The daemon's channel keeps its socket registered for reading between requests (issue 29,
point 4): a session that waits for request after request costs no event-loop registration
per request, and readiness that nobody waits for unregisters it, so it never spins.

Real sockets and real event loops (asyncio's and uvloop, which the daemon runs on); the
loop is wrapped only to count what the channel asks of it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvpool.protocol.channel import AsyncChannel
from kvpool.protocol.frames import HEADER_BYTES, encode_frame
from kvpool.protocol.messages import LookupRequest, Op
from tests.helpers import key

NUM_REQUESTS = 200
TIMEOUT_S = 60.0


class CountingLoop:
    """The running loop, counting the channel's reader registrations and removals."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.num_added = 0
        self.num_removed = 0

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        self.num_added += 1
        self._loop.add_reader(fd, callback, *args)

    def remove_reader(self, fd: int) -> bool:
        self.num_removed += 1
        return self._loop.remove_reader(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


def _run(make_loop: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]) -> Any:
    loop = make_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))
    finally:
        loop.close()


LOOPS = pytest.mark.parametrize(
    "make_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


def _request(i: int) -> bytes:
    return encode_frame(Op.LOOKUP, LookupRequest(keys=[key(i)]), request_id=i)


def _client(sock: socket.socket, num_requests: int) -> None:
    """A blocking client: a request, then wait for its one-byte reply, over and over (a
    short pause first, so that the server is waiting when the request comes)."""
    sock.settimeout(TIMEOUT_S)
    with sock:
        for i in range(num_requests):
            time.sleep(0.0005)
            sock.sendall(_request(i))
            assert sock.recv(1) == b"r"


@LOOPS
def test_request_after_request_registers_the_reader_once(make_loop):
    async def serve() -> CountingLoop:
        server_sock, client_sock = socket.socketpair()
        loop = CountingLoop(asyncio.get_running_loop())
        channel = AsyncChannel(server_sock, loop)  # type: ignore[arg-type]
        client = threading.Thread(target=_client, args=(client_sock, NUM_REQUESTS))
        client.start()
        for i in range(NUM_REQUESTS):
            header = await channel.recv_header()
            assert header.request_id == i
            await channel.recv_meta(header.meta_len)
            await channel.send([b"r"])
        client.join(TIMEOUT_S)
        channel.close()
        return loop

    loop = _run(make_loop, serve())
    # Each request found nothing to read at first and waited (the client sends only after
    # the reply): before, each wait added and removed the reader.
    assert loop.num_added == 1
    assert loop.num_removed == 1  # at close


@LOOPS
def test_unread_data_with_nobody_waiting_unregisters_instead_of_spinning(make_loop):
    async def serve() -> tuple[CountingLoop, int, int]:
        server_sock, client_sock = socket.socketpair()
        loop = CountingLoop(asyncio.get_running_loop())
        channel = AsyncChannel(server_sock, loop)  # type: ignore[arg-type]
        wakeups = 0
        on_readable = channel._on_readable

        def counting_on_readable() -> None:
            nonlocal wakeups
            wakeups += 1
            on_readable()

        channel._on_readable = counting_on_readable  # type: ignore[method-assign]
        with client_sock:
            client_sock.sendall(_request(0)[:1])  # part of a header: the channel waits
            reading = asyncio.ensure_future(channel.recv_header())
            await asyncio.sleep(0.05)
            client_sock.sendall(_request(0)[1:])
            header = await reading
            await channel.recv_meta(header.meta_len)
            # The session is busy elsewhere while the next request arrives: level-triggered
            # readiness with nobody waiting for it.
            client_sock.sendall(_request(1))
            for _ in range(100):
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            wakeups_while_busy = wakeups
            header = await channel.recv_header()  # read at once: no wait, no registration
            assert header.request_id == 1
            channel.close()
        return loop, wakeups_while_busy, wakeups

    loop, wakeups_while_busy, wakeups = _run(make_loop, serve())
    assert wakeups_while_busy <= 3  # not one per loop iteration
    assert wakeups == wakeups_while_busy
    assert loop.num_added == loop.num_removed  # nothing left registered


@LOOPS
def test_close_unregisters_so_the_fd_number_can_be_reused(make_loop):
    async def serve() -> None:
        server_sock, client_sock = socket.socketpair()
        channel = AsyncChannel(server_sock)
        with client_sock:
            client_sock.sendall(_request(0)[:HEADER_BYTES])
            await channel.recv_header()
            reading = asyncio.ensure_future(channel.recv_meta(10))  # waits: registered
            await asyncio.sleep(0.01)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            fd = server_sock.fileno()
            channel.close()
        # A new connection gets the lowest free fd number, the one just closed, and is
        # served like any other: it waits for its request on a fresh registration.
        again, peer = socket.socketpair()
        with peer:
            assert again.fileno() == fd
            second = AsyncChannel(again)
            reading = asyncio.ensure_future(second.recv_header())
            await asyncio.sleep(0.01)
            peer.sendall(_request(2))
            assert (await reading).request_id == 2
            second.close()

    _run(make_loop, serve())
