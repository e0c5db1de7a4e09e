import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import BadRequest, ProtocolError, TooLarge, UnsupportedVersion
from kvpool.formats import RELEASE
from kvpool.protocol.frames import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_META_BYTES,
    RecvBuffer,
    decode_request,
    decode_response,
    encode_frame,
    parse_header,
)
from kvpool.protocol.messages import (
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    GetResponse,
    LookupRequest,
    Op,
    PutRequest,
)
from tests.helpers import key


def test_round_trip_header_and_message():
    request = LookupRequest(keys=[key(1), key(2)], wait_ms=5)
    frame = encode_frame(Op.LOOKUP, request, request_id=7, payload_len=0)
    header = parse_header(frame[:HEADER_BYTES])
    assert (header.op, header.request_id, header.meta_len) == (
        Op.LOOKUP,
        7,
        len(frame) - HEADER_BYTES,
    )
    assert decode_request(header.op, frame[HEADER_BYTES:]) == request


def test_bounds_are_enforced_at_decode():
    too_many = msgspec.msgpack.encode({"keys": [key(i) for i in range(MAX_KEYS_PER_REQUEST + 1)]})
    with pytest.raises(BadRequest):
        decode_request(Op.LOOKUP, too_many)
    short_key = msgspec.msgpack.encode({"keys": [b"short"]})
    with pytest.raises(BadRequest):
        decode_request(Op.LOOKUP, short_key)
    huge_block = msgspec.msgpack.encode({"keys": [key(1)], "sizes": [1 << 40]})
    with pytest.raises(BadRequest):
        decode_request(Op.PUT, huge_block)
    with pytest.raises(TooLarge):
        parse_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT, 0, 0, 0, MAX_META_BYTES + 1, 0))
    with pytest.raises(TooLarge):
        parse_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.PUT, 0, 0, 0, 0, 1 << 62))
    with pytest.raises(BadRequest):
        parse_header(HEADER.pack(b"XX", 1, Op.PUT, 0, 0, 0, 0, 0))
    with pytest.raises(UnsupportedVersion):
        parse_header(HEADER.pack(MAGIC, 99, Op.PUT, 0, 0, 0, 0, 0))
    with pytest.raises(BadRequest):
        decode_request(200, b"")


def test_response_type_is_checked():
    meta = msgspec.msgpack.encode(PutRequest(keys=[key(1)], sizes=[1]))
    with pytest.raises(ProtocolError):
        decode_response(Op.GET, meta, GetResponse)


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from(sorted(REQUEST_TYPES)), data=st.binary(max_size=512))
def test_fuzz_request_decoder_only_raises_bad_request(op, data):
    try:
        decode_request(op, data)
    except BadRequest:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_fuzz_header_parser_only_raises_protocol_errors(data):
    try:
        parse_header(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=3000), max_size=40), want=st.integers(1, 5000)
)
def test_recv_buffer_preserves_the_byte_stream(chunks, want):
    buffer = RecvBuffer(capacity=1024)
    stream = b"".join(chunks)
    out = bytearray()
    for chunk in chunks:
        view = buffer.writable(len(chunk))
        view[: len(chunk)] = chunk
        buffer.produced(len(chunk))
        if buffer.num_buffered >= want:
            out += buffer.take(want)
    rest = bytearray(buffer.num_buffered)
    buffer.drain_into(memoryview(rest))
    assert bytes(out + rest) == stream


def test_a_peer_outside_the_protocol_window_is_refused_with_what_to_do():
    """A client of the protocol before the window (kvpool before 0.1.0 spoke 2) is told which
    versions each side speaks and that the older side needs upgrading."""
    with pytest.raises(UnsupportedVersion) as excinfo:
        parse_header(HEADER.pack(MAGIC, 2, Op.HELLO, 0, 0, 0, 0, 0))
    message = str(excinfo.value)
    assert "protocol 2" in message and RELEASE in message and "upgrade" in message
    assert (
        parse_header(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 0, 0, 0, 0, 0)).op == Op.HELLO
    )
