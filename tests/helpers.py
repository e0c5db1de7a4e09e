"""Deterministic test data: a block's bytes are derived from its key, so any reader can
check that it got exactly the right block."""

from __future__ import annotations

import hashlib

import numpy as np

from kvpool.keys import Namespace

NS = Namespace(model="tests")


def key(i: int | str, ns: Namespace = NS) -> bytes:
    return ns.key(str(i).encode())


def content(k: bytes, size: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def size_of(k: bytes, low: int = 1, high: int = 300_000) -> int:
    return low + int.from_bytes(hashlib.blake2b(k + b"size", digest_size=4).digest(), "little") % (
        high - low
    )


def reserve_op(keys, sizes, lease_ms=0):
    """A RESERVE on a raw connection (``Connection.run``): its response."""
    from kvpool.client import ops
    from kvpool.protocol.messages import Op, ReserveRequest, ReserveResponse

    request = ReserveRequest(keys=list(keys), sizes=list(sizes), lease_ms=lease_ms)
    yield ops.Request(Op.RESERVE, request)
    response, _ = yield ops.Recv(Op.RESERVE, ReserveResponse)
    return response


def commit_op(reservation_id, replicate=False):
    """A COMMIT on a raw connection (the node hashes the blocks): the statuses."""
    from kvpool.client import ops
    from kvpool.protocol.messages import CommitRequest, CommitResponse, Op

    request = CommitRequest(reservation_id=reservation_id, replicate=replicate)
    yield ops.Request(Op.COMMIT, request)
    response, _ = yield ops.Recv(Op.COMMIT, CommitResponse)
    return response.statuses


def rss_anon_kib(pid: int) -> int:
    """A process's anonymous resident memory (its heap), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon")
