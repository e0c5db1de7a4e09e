"""The client's blocking channel over a non-blocking socket (issue 29, point 4): sends and
receives are tried at once and wait in poll() only when they must, so a round trip costs
no socket-timeout changes; every wait still ends at the call's deadline.  Real sockets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpool.protocol.channel import SyncChannel
from kvpool.protocol.frames import encode_frame
from kvpool.protocol.messages import LookupRequest, Op
from tests.helpers import key

NUM_ROUND_TRIPS = 100
TIMEOUT_S = 60.0


class CountingSocket(socket.socket):
    """A real socket that counts how often its timeout is changed."""

    num_timeouts_set = 0

    def settimeout(self, value: float | None) -> None:
        self.num_timeouts_set += 1
        super().settimeout(value)


def _echo(sock: socket.socket, num_frames: int) -> None:
    """A peer that answers each frame with the same frame."""
    sock.settimeout(TIMEOUT_S)
    with sock:
        frame_bytes = len(_frame(0))
        for _ in range(num_frames):
            data = b""
            while len(data) < frame_bytes:
                data += sock.recv(frame_bytes - len(data))
            sock.sendall(data)


def _frame(i: int) -> bytes:
    """A request numbered ``i``: every one the same length."""
    return encode_frame(Op.LOOKUP, LookupRequest(keys=[key(0)]), request_id=i)


def test_round_trips_change_no_socket_timeout():
    left, right = socket.socketpair()
    sock = CountingSocket(left.family, left.type, fileno=left.detach())
    echo = threading.Thread(target=_echo, args=(right, NUM_ROUND_TRIPS))
    echo.start()
    channel = SyncChannel(sock)
    for i in range(NUM_ROUND_TRIPS):
        channel.deadline = time.monotonic() + TIMEOUT_S  # a new deadline per call
        channel.send([_frame(i)])
        header = channel.recv_header()
        channel.recv_meta(header.meta_len)
        assert header.request_id == i
    echo.join(TIMEOUT_S)
    sock.close()
    # Before, each send and each receive set the socket's timeout (an ioctl) and polled.
    assert sock.num_timeouts_set <= 1


@pytest.mark.parametrize(
    "stuck",
    [
        pytest.param(lambda channel: channel.recv_header(), id="a-silent-peer"),
        # More than any socket buffer holds, to a peer that never reads.
        pytest.param(lambda channel: channel.send([bytes(64 << 20)]), id="a-peer-that-never-reads"),
    ],
)
def test_a_call_on_a_stuck_peer_times_out_at_the_deadline(stuck):
    left, right = socket.socketpair()
    with left, right:
        channel = SyncChannel(left)
        channel.deadline = time.monotonic() + 0.2
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            stuck(channel)
        assert 0.15 <= time.monotonic() - started < 10


def test_a_passed_deadline_fails_before_any_io():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(_frame(1))
        channel = SyncChannel(left)
        channel.deadline = time.monotonic() - 1
        with pytest.raises(TimeoutError):
            channel.recv_header()
