"""Handshake authentication: HMAC-SHA256 challenge and response, mutual.

On accept the node sends a :class:`Challenge` with a fresh nonce.  The client answers with
:class:`Hello`: its own nonce and ``HMAC(key, "client" | access_id | server nonce | client
nonce)``.  The node checks it and proves knowledge of the same key in :class:`Welcome`
with ``HMAC(key, "node" | ...)``.  The key itself never crosses the wire, and a recorded
handshake cannot be replayed against a new nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvpool.protocol.messages import NONCE_BYTES


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: str, role: str, access_id: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    message = b"|".join((role.encode(), access_id.encode(), server_nonce, client_nonce))
    return hmac.new(key.encode(), message, hashlib.sha256).digest()


def verify(
    key: str,
    role: str,
    access_id: str,
    server_nonce: bytes,
    client_nonce: bytes,
    received: bytes,
) -> bool:
    expected = proof(key, role, access_id, server_nonce, client_nonce)
    return hmac.compare_digest(expected, received)
