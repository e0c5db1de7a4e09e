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
