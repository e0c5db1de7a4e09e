"""A session's order of requests: what a commit publishes is seen by the very next request,
even one that was already waiting in the socket when the commit was served."""

from __future__ import annotations

import msgspec
import pytest

from kvpool import Status
from kvpool.protocol.messages import Op
from tests.helpers import key
from tests.node.test_malformed import _read_frame, connect, header


def frame(op: Op, message: dict) -> bytes:
    meta = msgspec.msgpack.encode(message)
    return header(op, len(meta)) + meta


@pytest.mark.parametrize("with_checksums", [True, False])
def test_a_reserve_sent_right_behind_a_commit_finds_the_key_stored(node, with_checksums):
    k = key(f"behind-{with_checksums}")
    sock = connect(node)
    sock.sendall(frame(Op.RESERVE, {"keys": [k], "sizes": [4096]}))
    reply, body = _read_frame(sock)
    assert reply.status == 0
    commit = {"reservation_id": msgspec.msgpack.decode(body)["reservation_id"]}
    if with_checksums:
        commit["checksums"] = [12345]
    # One write: the RESERVE is in the socket before the node has served the COMMIT.
    sock.sendall(frame(Op.COMMIT, commit) + frame(Op.RESERVE, {"keys": [k], "sizes": [4096]}))
    reply, body = _read_frame(sock)
    assert reply.status == 0 and msgspec.msgpack.decode(body)["statuses"] == [Status.OK]
    reply, body = _read_frame(sock)
    assert reply.status == 0
    assert msgspec.msgpack.decode(body)["statuses"] == [Status.EXISTS]
    sock.close()
