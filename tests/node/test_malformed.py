"""Malformed, oversized and truncated frames: an error reply or a closed connection, and the
daemon keeps serving every other client."""

import socket
import struct
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import Client, Status
from kvpool.errors import BadRequest
from kvpool.protocol import frames
from kvpool.protocol.frames import HEADER, MAGIC
from kvpool.protocol.messages import PROTOCOL_VERSION, Op
from tests.helpers import key, rss_anon_kib
from tests.nodes import own_node
from tests.wire import connect, header, read_frame


@pytest.fixture(scope="module")
def shared_node():
    """One node for the tests whose frames it refuses and that leave nothing behind (a
    start is most of their time); a test that counts what the node holds, or that throws
    random frames at it, has a node of its own."""
    with own_node("malformed") as node:
        yield node


def still_serving(node):
    with Client(node.unix_address, timeout=5) as c:
        c.put([key("alive")], [b"yes"])
        return c.get([key("alive")]).values[0] == b"yes"


def test_bad_message_body_gets_an_error_reply_and_the_connection_lives_on(shared_node):
    node = shared_node
    sock = connect(node)
    bad = b"\xc1\xc1\xc1"  # not msgpack
    sock.sendall(header(Op.LOOKUP, len(bad)) + bad)
    reply, meta = read_frame(sock)
    assert reply.status == Status.BAD_REQUEST and b"malformed" in meta
    wrong_type = msgspec.msgpack.encode({"keys": "not a list"})
    sock.sendall(header(Op.LOOKUP, len(wrong_type)) + wrong_type)
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    too_many = msgspec.msgpack.encode({"keys": [key(i) for i in range(20000)]})
    sock.sendall(header(Op.LOOKUP, len(too_many)) + too_many)
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    # A PUT whose sizes do not add up: the payload is skipped and the frame refused.
    meta = msgspec.msgpack.encode({"keys": [key(1)], "sizes": [10]})
    sock.sendall(header(Op.PUT, len(meta), 5) + meta + b"12345")
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    # A payload on an op that takes none.
    meta = msgspec.msgpack.encode({"keys": [key(1)]})
    sock.sendall(header(Op.GET, len(meta), 3) + meta + b"abc")
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    # A corrupted payload never becomes a block.
    meta = msgspec.msgpack.encode({"keys": [key("c")], "sizes": [4]})
    sock.sendall(header(Op.PUT, len(meta), 12) + meta + (12345).to_bytes(8, "little") + b"data")
    reply, meta = read_frame(sock)
    assert msgspec.msgpack.decode(meta)["statuses"] == [Status.CHECKSUM_MISMATCH]
    with Client(node.unix_address) as c:
        assert c.lookup([key("c")]) == 0
    # Unknown op.
    sock.sendall(header(77))
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    # After all that, the same connection still serves a valid request.
    sock.sendall(frames.encode_frame(Op.HEALTH, None))
    assert read_frame(sock)[0].status == 0
    sock.close()
    assert still_serving(node)


def test_write_areas_refuse_bad_sizes_and_strangers_and_lose_nothing(node):
    sock = connect(node)

    def ask(op, message):
        meta = msgspec.msgpack.encode(message)
        sock.sendall(header(op, len(meta)) + meta)
        reply, body = read_frame(sock)
        return reply.status, msgspec.msgpack.decode(body)

    assert ask(Op.AREA, {"num_bytes": 0})[0] == Status.BAD_REQUEST
    assert ask(Op.AREA, {"num_bytes": 1 << 40})[0] == Status.BAD_REQUEST  # past the bound
    status, area = ask(Op.AREA, {"num_bytes": 64 << 20})  # more than an eighth of 64 MiB
    assert status == 0 and area.get("area_id", 0) == 0
    status, area = ask(Op.AREA, {"num_bytes": 1 << 20})
    assert status == 0 and area["area_id"] and area["num_bytes"] == 1 << 20
    # Blocks past the area's end, or keys and sizes that differ: refused, nothing taken.
    too_far = {"area_id": area["area_id"], "keys": [key("far")], "sizes": [(1 << 20) + 1]}
    assert ask(Op.COMMIT, too_far)[0] == Status.BAD_REQUEST
    uneven = {"area_id": area["area_id"], "keys": [key("a"), key("b")], "sizes": [4096]}
    assert ask(Op.COMMIT, uneven)[0] == Status.BAD_REQUEST
    fits = {"area_id": area["area_id"], "keys": [key("whole")], "sizes": [1 << 20]}
    status, reply = ask(Op.COMMIT, fits)
    assert status == 0 and reply["statuses"] == [Status.OK]
    # Used up, the area was swapped for a fresh one of the same size; the old one is gone.
    fresh = reply["area"]
    assert fresh["area_id"] != area["area_id"] and fresh["num_bytes"] == 1 << 20
    assert ask(Op.COMMIT, fits)[0] == Status.LEASE_EXPIRED
    with Client(node.unix_address) as c:
        assert c.lookup([key("whole"), key("far"), key("a")]) == 1
        assert c.put([key("theirs")], [b"x" * 4096]).all_stored
        # Theirs (4 MiB, the least a client asks for, less a page) and this one's fresh one.
        assert c.stats().area_bytes == (4 << 20) - 4096 + (1 << 20)
    _, mine = ask(Op.AREA, {"num_bytes": 4096})
    stranger = {"area_id": mine["area_id"] + 1000, "keys": [key("s")], "sizes": [4096]}
    assert ask(Op.COMMIT, stranger)[0] == Status.LEASE_EXPIRED
    sock.close()
    assert still_serving(node)


@pytest.mark.parametrize("listed", [{"origins": [None, None]}, {"checksums": [1, 2]}])
def test_a_commit_with_the_wrong_number_of_origins_or_checksums_leaves_nothing_pending(
    node, listed
):
    sock = connect(node)
    meta = msgspec.msgpack.encode({"keys": [key("orphan")], "sizes": [4096]})
    sock.sendall(header(Op.RESERVE, len(meta)) + meta)
    reply, body = read_frame(sock)
    assert reply.status == 0
    reservation_id = msgspec.msgpack.decode(body)["reservation_id"]
    meta = msgspec.msgpack.encode({"reservation_id": reservation_id, **listed})
    sock.sendall(header(Op.COMMIT, len(meta)) + meta)
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    with Client(node.unix_address) as c:  # dropped: neither stored nor stuck pending
        assert c.lookup_state([key("orphan")]).is_next_pending is False
        assert c.put([key("orphan")], [b"o" * 4096]).statuses == [Status.OK]
    sock.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 10,  # wrong protocol: bad magic
        header(Op.LOOKUP, magic=b"XX"),
        header(Op.LOOKUP, version=7),
        header(Op.LOOKUP, meta_len=1 << 30),  # oversized message header
        header(Op.PUT, payload_len=1 << 50),  # oversized payload
    ],
)
def test_bad_frame_headers_close_the_connection(shared_node, raw):
    node = shared_node
    sock = connect(node)
    sock.sendall(raw)
    reply, _meta = read_frame(sock)
    assert reply.status in (Status.BAD_REQUEST, Status.TOO_LARGE, Status.UNSUPPORTED_VERSION)
    with pytest.raises((ConnectionError, OSError)):
        read_frame(sock)
    sock.close()
    assert still_serving(node)


def test_truncated_frames_and_vanishing_clients(node):
    for raw in (
        header(Op.LOOKUP)[:10],
        header(Op.LOOKUP, 100) + b"\x91",
        header(Op.PUT, 0, 1000) + b"x" * 10,
    ):
        sock = connect(node)
        sock.sendall(raw)
        sock.close()
    # A put that stops halfway leaves nothing reserved and nothing visible.
    sock = connect(node)
    meta = msgspec.msgpack.encode({"keys": [key("half")], "sizes": [1 << 20]})
    sock.sendall(header(Op.PUT, len(meta), 8 + (1 << 20)) + meta + b"x" * 1000)
    with Client(node.unix_address) as c:
        deadline = time.monotonic() + 5
        while c.stats().reserved_bytes != 1 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.stats().reserved_bytes == 1 << 20
        sock.close()
        deadline = time.monotonic() + 5
        while c.stats().reserved_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().reserved_bytes == 0 and c.lookup([key("half")]) == 0
    assert still_serving(node)


def test_handshake_is_required_and_bounded(shared_node):
    node = shared_node
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(node.info["unix"])
    read_frame(sock)
    sock.sendall(frames.encode_frame(Op.LOOKUP, None))  # skipping HELLO
    assert read_frame(sock)[0].status == Status.BAD_REQUEST
    sock.close()
    assert still_serving(node)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    op=st.integers(0, 20),
    meta=st.binary(max_size=300),
    payload=st.binary(max_size=300),
    claimed_payload=st.integers(0, 400),
)
def test_fuzz_frames_against_the_live_daemon(node, op, meta, payload, claimed_payload):
    sock = connect(node)
    sock.sendall(
        HEADER.pack(MAGIC, PROTOCOL_VERSION, op, 0, 0, 3, len(meta), claimed_payload)
        + meta
        + payload
    )
    sock.shutdown(socket.SHUT_WR)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()
    assert still_serving(node)


def test_decoder_errors_are_typed():
    with pytest.raises(BadRequest):
        frames.decode_request(Op.PUT, struct.pack("<I", 7))


def test_unauthenticated_peers_cost_the_node_little_memory(start_node):
    """From the attacker's side: 100 connections to a keyed node's TCP port, each sending a
    HELLO whose header announces 4 MiB of metadata and never the metadata.  Nothing sizeable
    is allocated before a peer has authenticated (the node once took 4 MiB per such
    connection, and 256 KiB for each bare one): the oversized HELLO is refused at its
    header, and the node's memory hardly moves."""
    node = start_node(name="preauth", extra=["--access-key", "a-key-of-sixteen-chars"])
    host, port = node.tcp_address.rsplit(":", 1)
    before = rss_anon_kib(node.pid)
    socks = []
    try:
        for _ in range(100):
            sock = socket.create_connection((host, int(port)), timeout=5)
            socks.append(sock)
            assert read_frame(sock)[0].op == Op.CHALLENGE
            sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 0, 0, 1, 4 << 20, 0))
        # Each oversized HELLO is refused at its header: the node hangs up (measured once it
        # has read them all).
        closed = all(_closed_by_peer(sock) for sock in socks)
        grown_kib = rss_anon_kib(node.pid) - before
        assert grown_kib < 16 << 10, f"{grown_kib} KiB for 100 unauthenticated peers"
        assert closed
    finally:
        for sock in socks:
            sock.close()
    with Client(node.tcp_address, access_key="a-key-of-sixteen-chars") as client:
        assert client.health().ok  # and serves the keyed


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other side hangs up (after an error reply, if any) within the timeout."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_remote_peers_cannot_take_the_local_engines_connection_slots(start_node):
    """From the attacker's side: 256 TCP connections that never say HELLO, eight times what
    the node keeps of them.  They are strangers, in a pool of their own: the oldest are
    closed as new ones come, none takes a member's slot, and the local engines' clients and
    a keyed remote client are served throughout (issue 43, item 5)."""
    key = "a-key-of-sixteen-chars"
    node = start_node(
        name="lockout",
        extra=["--access-key", key, "--max-strangers", "32", "--max-strangers-per-address", "32"],
    )
    host, port = node.tcp_address.rsplit(":", 1)
    socks = []
    try:
        for _ in range(256):
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        assert read_frame(socks[-1])[0].op == Op.CHALLENGE  # the newest has a session
        assert _closed_by_peer(socks[0])  # the oldest made room for it
        with Client(node.unix_address, access_key=key) as local:
            assert local.health().ok
            assert local.stats().num_strangers <= 32
        with Client(node.tcp_address, access_key=key, use_shm=False) as remote:
            assert remote.health().ok
    finally:
        for sock in socks:
            sock.close()
