"""Handshake authentication: HMAC-SHA256 challenge and response, mutual, bound to the
connection.

On accept the node sends a :class:`Challenge` with a fresh nonce.  The client answers with
:class:`Hello`: its own nonce and ``HMAC(key, "client" | access_id | server nonce | client
nonce | binding)``.  The node checks it and proves knowledge of the same key in
:class:`Welcome` with ``HMAC(key, "node" | ... | binding | digest of the Welcome)``.  The
key itself never crosses the wire, and a recorded handshake cannot be replayed against a
new nonce.

The *binding* names the connection as each side sees it, so that a proof made on one
connection is worthless on another (a relay: a local attacker who makes a client connect
to a socket of its own and forwards the handshake to the real node):

- Unix socket: the socket file's device and inode, and the user id of the process that
  listens on it (``SO_PEERCRED``, which the kernel fills in, on the client's side; the
  node's own effective user id on the node's).  A relay listens on a socket file of its
  own, as a user of its own: the node computes a different binding and refuses the proof.
- TCP: only the transport's kind.  Off loopback a link needs TLS, whose verified
  certificate is what binds the node; a plaintext link (loopback, or ``--insecure``) can
  be taken over after the handshake by whoever sits in its middle, whatever the proof.

The node's proof covers what its Welcome tells the client to trust (the arena's path,
device and inode, the host id, the shared directory, the limits): a man in the middle of
an ``--insecure`` link can no longer point a client at another file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
from dataclasses import dataclass

import msgspec

from kvpool.protocol.messages import NONCE_BYTES, Welcome

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


@dataclass(frozen=True, slots=True)
class Handshake:
    """One handshake's transcript, which both proofs cover: the access id the client
    names, both nonces and the connection's binding (as this side sees it)."""

    access_id: str
    server_nonce: bytes
    client_nonce: bytes
    binding: bytes = b""

    def proof(self, key: str, role: str, welcome_digest: bytes = b"") -> bytes:
        """``role``'s proof (``"client"`` or ``"node"``); the node's also covers its
        Welcome (:func:`welcome_digest`)."""
        parts = (
            role.encode(),
            self.access_id.encode(),
            self.server_nonce,
            self.client_nonce,
            self.binding,
            welcome_digest,
        )
        message = b"|".join(_length_prefixed(part) for part in parts)
        return hmac.new(key.encode(), message, hashlib.sha256).digest()

    def verify(self, key: str, role: str, received: bytes, welcome_digest: bytes = b"") -> bool:
        """Whether ``received`` is ``role``'s proof (compared in constant time)."""
        return hmac.compare_digest(self.proof(key, role, welcome_digest), received)


def welcome_digest(welcome: Welcome) -> bytes:
    """A digest of everything in a Welcome but its proof (what the node's proof covers)."""
    fields = msgspec.structs.replace(welcome, proof=b"")
    return hashlib.sha256(msgspec.msgpack.encode(fields)).digest()


def unix_binding(dev: int, ino: int, uid: int) -> bytes:
    """A Unix socket connection's binding: its socket file and the listening user."""
    return b"unix:%d:%d:%d" % (dev, ino, uid)


TCP_BINDING = b"tcp"


def client_binding(sock: socket.socket, socket_path: str = "") -> bytes:
    """The binding of a client's connected socket (``socket_path``: the Unix socket's
    file, as the client named it)."""
    if sock.family != socket.AF_UNIX:
        return TCP_BINDING
    ucred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _, uid, _ = _UCRED.unpack(ucred)
    try:
        stat = os.stat(socket_path)
    except OSError:  # gone since the connect: a binding no node has (it refuses the proof)
        return unix_binding(-1, -1, uid)
    return unix_binding(stat.st_dev, stat.st_ino, uid)


def _length_prefixed(part: bytes) -> bytes:
    # Each part's length first: no two different transcripts join to the same bytes.
    return len(part).to_bytes(4, "little") + part
