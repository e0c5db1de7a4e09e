"""The handshake's proofs, byte for byte: an HMAC-SHA256 over the length-prefixed parts of
the transcript, joined by ``|`` (see :mod:`kvpool.protocol.auth`).  Fixed answers, so that
a change of the transcript, which both sides would make alike and every handshake test
would miss, breaks this one (and every deployed peer with it)."""

import hashlib
import hmac

from kvpool.protocol import auth

KEY = "a-key-of-sixteen-chars"
BINDING = auth.unix_binding(2049, 131, 1000)
HANDSHAKE = auth.Handshake("kvpool", b"s" * 32, b"c" * 32, BINDING)


def by_hand(role: bytes, access_id: bytes, binding: bytes, digest: bytes = b"") -> bytes:
    parts = (role, access_id, b"s" * 32, b"c" * 32, binding, digest)
    message = b"|".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hmac.new(KEY.encode(), message, hashlib.sha256).digest()


def test_the_proofs_are_the_documented_transcript_with_fixed_answers():
    client = HANDSHAKE.proof(KEY, "client")
    node = HANDSHAKE.proof(KEY, "node", b"d" * 32)
    tenant = auth.Handshake("tenant-a", b"s" * 32, b"c" * 32, auth.TCP_BINDING).proof(KEY, "client")
    assert client == by_hand(b"client", b"kvpool", BINDING)
    assert node == by_hand(b"node", b"kvpool", BINDING, b"d" * 32)
    assert tenant == by_hand(b"client", b"tenant-a", b"tcp")
    assert client.hex() == "5e9519c60c8bd5b8ad0c56efbb774958d5f05d197194d3eca3583f1391b6505b"
    assert node.hex() == "28714f8520ae9397b637ee208faef89a6240438bdc698ababada7ee9a1d774d8"
    assert tenant.hex() == "bd81b1ed35b9fc03c5c08e370ae6f5871073f221d0b4144f82ca5e5a484ecea5"


def test_verify_takes_only_the_proof_of_that_role_transcript_and_key():
    proof = HANDSHAKE.proof(KEY, "client")
    assert HANDSHAKE.verify(KEY, "client", proof)
    assert not HANDSHAKE.verify(KEY, "node", proof)  # a client's proof is not the node's
    assert not HANDSHAKE.verify("another-key-of-16-chars", "client", proof)
    relayed = auth.Handshake("kvpool", b"s" * 32, b"c" * 32, auth.TCP_BINDING)
    assert not relayed.verify(KEY, "client", proof)  # another connection's binding
    assert not HANDSHAKE.verify(KEY, "node", HANDSHAKE.proof(KEY, "node", b"d" * 32), b"e" * 32)
