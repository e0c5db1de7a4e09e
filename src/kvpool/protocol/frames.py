"""Binary framing, free of I/O.

Every frame is::

    fixed header (24 bytes, little endian)
        magic        2s   b"KV"
        version      u8   PROTOCOL_VERSION
        op           u8   Op
        flags        u16  RESPONSE | NO_REPLY
        status       u16  Status (responses)
        request_id   u32  echoed in the response
        meta_len     u32  <= MAX_META_BYTES
        payload_len  u64  <= MAX_PAYLOAD_BYTES
    msgpack header (meta_len bytes): the op's message (kvpool.protocol.messages)
    raw payload   (payload_len bytes): block bytes, received straight into their target

:class:`RecvBuffer` holds what was read ahead of the current position, so that small
frames cost one ``recv`` and large payloads are read straight into their destination.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvpool.errors import BadRequest, Status, TooLarge, UnsupportedVersion
from kvpool.formats import RELEASE
from kvpool.protocol.messages import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    SUPPORTED_VERSIONS,
    ErrorResponse,
    Message,
    Op,
)

MAGIC = b"KV"
HEADER = struct.Struct("<2sBBHHIIQ")
HEADER_BYTES = HEADER.size
MAX_META_BYTES = 4 << 20
MAX_PAYLOAD_BYTES = 4 << 30

FLAG_RESPONSE = 0x1
FLAG_NO_REPLY = 0x2

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()
_request_decoders = {int(op): msgspec.msgpack.Decoder(t) for op, t in REQUEST_TYPES.items()}
_response_decoders = {int(op): msgspec.msgpack.Decoder(t) for op, t in RESPONSE_TYPES.items()}
_error_decoder = msgspec.msgpack.Decoder(ErrorResponse)
_EMPTY_MAP = b"\x80"  # an empty message header means a message of all defaults


@dataclass(slots=True)
class FrameHeader:
    op: int
    flags: int
    status: int
    request_id: int
    meta_len: int
    payload_len: int

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def wants_reply(self) -> bool:
        return not self.flags & FLAG_NO_REPLY


def encode_frame(
    op: int,
    message: Message | None,
    *,
    payload_len: int = 0,
    request_id: int = 0,
    flags: int = 0,
    status: int = Status.OK,
) -> bytes:
    """The fixed header and the msgpack header of one frame."""
    meta = _encoder.encode(message) if message is not None else b""
    return (
        HEADER.pack(MAGIC, PROTOCOL_VERSION, op, flags, status, request_id, len(meta), payload_len)
        + meta
    )


def parse_header(data: bytes | memoryview) -> FrameHeader:
    """Parse and bound-check a fixed header."""
    magic, version, op, flags, status, request_id, meta_len, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise BadRequest(f"bad frame magic {bytes(magic)!r}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"the peer speaks kvpool protocol {version}, this kvpool {RELEASE} speaks "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}: a release talks to the release before "
            "it and after it; upgrade the older side"
        )
    if meta_len > MAX_META_BYTES:
        raise TooLarge(f"message header of {meta_len} bytes exceeds {MAX_META_BYTES}")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise TooLarge(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return FrameHeader(op, flags, status, request_id, meta_len, payload_len)


def decode_request(op: int, meta: bytes | memoryview) -> Message:
    """Decode a request's msgpack header; malformed input raises :class:`BadRequest`."""
    decoder = _request_decoders.get(op)  # by the op's number: no enum made per request
    if decoder is None:
        raise BadRequest(f"unknown op {op}")
    try:
        return decoder.decode(meta or _EMPTY_MAP)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {Op(op).name} request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed {Op(op).name} request: {exc}") from exc


def decode_response(op: int, meta: bytes | memoryview, expected: type[M]) -> M:
    """Decode a response's msgpack header as ``expected``."""
    try:
        decoder = _response_decoders[op]
        message = decoder.decode(meta)
    except (KeyError, msgspec.DecodeError) as exc:
        raise BadRequest(f"malformed response to op {op}: {exc}") from exc
    if not isinstance(message, expected):
        raise BadRequest(f"response to op {op} is {type(message).__name__}")
    return message


def decode_error(meta: bytes | memoryview) -> str:
    try:
        return _error_decoder.decode(meta).message
    except msgspec.DecodeError:
        return "(unreadable error message)"


def encode_message(message: Any) -> bytes:
    return _encoder.encode(message)


class RecvBuffer:
    """Read-ahead buffer shared by the blocking and the asyncio channels.

    ``writable()`` hands out the free tail for ``recv_into``; ``produced(n)`` accounts for
    what arrived; ``take(n)`` returns buffered bytes; ``drain_into(view)`` moves buffered
    bytes into a payload destination.

    A buffer that does not ``grow`` (the daemon's: one per connection, for as long as the
    connection lasts) keeps its capacity: a frame's metadata larger than that is read into
    a buffer of its own, dropped once the frame is decoded (:meth:`holds` says which).  A
    client's grows with the largest frame it received.
    """

    INITIAL_BYTES = 256 << 10

    def __init__(self, capacity: int = INITIAL_BYTES, *, grows: bool = True):
        self._buf = bytearray(capacity)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.grows = grows

    @property
    def capacity(self) -> int:
        """The bytes the buffer holds allocated (what a connection costs the reader)."""
        return len(self._buf)

    @property
    def num_buffered(self) -> int:
        return self._end - self._start

    def holds(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` of metadata are read here (else: into a buffer of their own)."""
        return self.grows or num_bytes <= len(self._buf)

    def writable(self, want: int) -> memoryview:
        """Free space for at least ``want`` more buffered bytes (compacting or growing)."""
        if self._start == self._end:
            self._start = self._end = 0
        if len(self._buf) - self._end < want:
            buffered = self._end - self._start
            if buffered + want > len(self._buf):
                new = bytearray(max(buffered + want, 2 * len(self._buf)))
                new[:buffered] = self._view[self._start : self._end]
                self._view.release()
                self._buf = new
                self._view = memoryview(self._buf)
            else:
                self._view[:buffered] = self._view[self._start : self._end]
            self._start, self._end = 0, buffered
        return self._view[self._end :]

    def grow(self, capacity: int) -> None:
        """Read ahead up to ``capacity`` bytes from now on (a session, once authenticated)."""
        if len(self._buf) < capacity:
            self.writable(capacity - self.num_buffered)

    def produced(self, num_bytes: int) -> None:
        self._end += num_bytes

    def take(self, num_bytes: int) -> bytes:
        if num_bytes > self.num_buffered:
            raise ValueError("not enough buffered bytes")
        data = bytes(self._view[self._start : self._start + num_bytes])
        self._start += num_bytes
        return data

    def drain_into(self, dst: memoryview) -> int:
        """Copy buffered bytes into ``dst``; returns how many."""
        num_bytes = min(len(dst), self.num_buffered)
        if num_bytes:
            dst[:num_bytes] = self._view[self._start : self._start + num_bytes]
            self._start += num_bytes
        return num_bytes
