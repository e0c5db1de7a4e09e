"""Placement: rendezvous (highest random weight) hashing gives every key its home nodes.

Each (key, node) pair gets a pseudo-random score; a key's homes are the ``replicas`` nodes
with the highest scores.  Every client and daemon that sees the same members computes the
same homes, and when a node joins or leaves only the keys whose top choices change move.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvpool.cluster.membership import Member


def _seed(node_id: str) -> int:
    return xxhash.xxh3_64_intdigest(node_id.encode())


def homes(key: bytes, members: Sequence[Member], replicas: int = 1) -> list[Member]:
    """The ``replicas`` home nodes of ``key``, best first."""
    if not members:
        return []
    scored = sorted(
        members,
        key=lambda m: (xxhash.xxh3_64_intdigest(key, seed=_seed(m.node_id)), m.node_id),
        reverse=True,
    )
    return scored[:replicas]


def group_by_home(
    keys: Sequence[bytes], members: Sequence[Member], replicas: int = 1, *, skip: str = ""
) -> dict[str, list[int]]:
    """Indices of ``keys`` per home node id (all of a key's homes but ``skip``)."""
    seeds = [(m.node_id, _seed(m.node_id)) for m in members]
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        ranked = sorted(
            seeds, key=lambda s: (xxhash.xxh3_64_intdigest(key, seed=s[1]), s[0]), reverse=True
        )
        for node_id, _ in ranked[:replicas]:
            if node_id != skip:
                groups.setdefault(node_id, []).append(index)
    return groups
