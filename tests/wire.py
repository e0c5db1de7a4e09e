"""Frames over a raw socket, as a broken or hostile client sends and reads them: no SDK in
between, so a test can send what the SDK never would."""

from __future__ import annotations

import socket

from kvpool.protocol import frames
from kvpool.protocol.frames import HEADER, HEADER_BYTES, MAGIC, FrameHeader, parse_header
from kvpool.protocol.messages import PROTOCOL_VERSION, Hello, Op


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_raw_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    """One frame as it came (to relay it): its header's bytes and its metadata; its
    payload, if any, is read and dropped."""
    raw = recv_exact(sock, HEADER_BYTES)
    header = parse_header(raw)
    meta = recv_exact(sock, header.meta_len)
    recv_exact(sock, header.payload_len)
    return raw, meta


def read_frame(sock: socket.socket) -> tuple[FrameHeader, bytes]:
    """One frame: its parsed header and its metadata (its payload read and dropped)."""
    raw, meta = read_raw_frame(sock)
    return parse_header(raw), meta


def header(
    op: int,
    meta_len: int = 0,
    payload_len: int = 0,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """A frame header of any values, right or wrong (request id 9)."""
    return HEADER.pack(magic, version, op, 0, 0, 9, meta_len, payload_len)


def connect(node) -> socket.socket:
    """A raw connection to a keyless node's Unix socket, past its handshake."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(node.info["unix"])
    challenge, _ = read_frame(sock)
    assert challenge.op == Op.CHALLENGE
    hello = Hello(version=PROTOCOL_VERSION, access_id="kvpool", nonce=b"n" * 32)
    sock.sendall(frames.encode_frame(Op.HELLO, hello, request_id=1))
    welcome, _ = read_frame(sock)
    assert welcome.status == 0
    return sock
