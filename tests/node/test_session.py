"""A session's order of requests: what a commit publishes is seen by the very next request,
even one that was already waiting in the socket when the commit was served."""

from __future__ import annotations

import socket

import msgspec
import pytest

from kvpool import Status
from kvpool.limits import MAX_HOLD_S, MAX_WAIT_S
from kvpool.node.session import HANDLERS
from kvpool.protocol import frames
from kvpool.protocol.messages import PROTOCOL_VERSION, Hello, Op, Welcome
from tests.helpers import key
from tests.wire import connect, header, read_frame


def frame(op: Op, message: dict) -> bytes:
    meta = msgspec.msgpack.encode(message)
    return header(op, len(meta)) + meta


@pytest.mark.parametrize("with_checksums", [True, False])
def test_a_reserve_sent_right_behind_a_commit_finds_the_key_stored(node, with_checksums):
    k = key(f"behind-{with_checksums}")
    sock = connect(node)
    sock.sendall(frame(Op.RESERVE, {"keys": [k], "sizes": [4096]}))
    reply, body = read_frame(sock)
    assert reply.status == 0
    commit = {"reservation_id": msgspec.msgpack.decode(body)["reservation_id"]}
    if with_checksums:
        commit["checksums"] = [12345]
    # One write: the RESERVE is in the socket before the node has served the COMMIT.
    sock.sendall(frame(Op.COMMIT, commit) + frame(Op.RESERVE, {"keys": [k], "sizes": [4096]}))
    reply, body = read_frame(sock)
    assert reply.status == 0 and msgspec.msgpack.decode(body)["statuses"] == [Status.OK]
    reply, body = read_frame(sock)
    assert reply.status == 0
    assert msgspec.msgpack.decode(body)["statuses"] == [Status.EXISTS]
    sock.close()


def test_the_welcome_announces_the_limits_the_node_clamps_to(start_node):
    node = start_node(env={"KVPOOL_PIN_LEASE": "5", "KVPOOL_RESERVE_LEASE": "7"})
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(node.info["unix"])
    read_frame(sock)  # the CHALLENGE
    hello = Hello(version=PROTOCOL_VERSION, access_id="kvpool", nonce=b"n" * 32)
    sock.sendall(frames.encode_frame(Op.HELLO, hello, request_id=1))
    reply, body = read_frame(sock)
    assert reply.status == 0
    limits = msgspec.msgpack.decode(body, type=Welcome).limits
    assert limits is not None
    assert (limits.pin_ms, limits.reserve_ms) == (5000, 7000)
    assert (limits.hold_ms, limits.wait_ms) == (int(MAX_HOLD_S * 1000), int(MAX_WAIT_S * 1000))
    # A client that asks for more than the limit gets the limit.
    sock.sendall(frame(Op.RESERVE, {"keys": [key("long")], "sizes": [4096], "lease_ms": 600_000}))
    reply, body = read_frame(sock)
    assert reply.status == 0 and msgspec.msgpack.decode(body)["lease_ms"] == 7000
    sock.close()


def test_a_welcome_without_limits_still_decodes():
    """An older node's Welcome (no limits) decodes, with none announced."""
    old = {
        "node_id": "n",
        "proof": b"",
        "host_id": "h",
        "tcp_address": "a:1",
        "arena_path": "",
        "arena_bytes": 0,
        "arena_dev": 0,
        "arena_ino": 0,
        "arena_id": b"",
    }
    welcome = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=Welcome)
    assert welcome.limits is None


def test_every_request_op_has_a_handler():
    handshake = {Op.CHALLENGE, Op.HELLO}
    assert set(HANDLERS) == set(Op) - handshake
    for op, handler in HANDLERS.items():
        assert handler.__name__ == f"_{op.name.lower()}"
