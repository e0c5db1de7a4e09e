"""Block checksums (xxh3-64).

A block's checksum is computed over the bytes that landed in the pool (by the node, for
same-host writes), and verified by every reader over the bytes it received, unless the
node vouches for them in place (a sealed block read on its host: see
:mod:`kvpool.node.sealing`), so a block is never served torn or corrupt.  Copies that hash
as they go are :func:`kvpool.buffers.copy_with_checksum`.
"""

from __future__ import annotations

from typing import Any

import xxhash


def checksum(data: Any) -> int:
    """The xxh3-64 checksum of a buffer."""
    return xxhash.xxh3_64_intdigest(data)


def new_hasher() -> xxhash.xxh3_64:
    return xxhash.xxh3_64()
