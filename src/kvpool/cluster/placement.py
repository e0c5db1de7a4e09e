"""Placement: rendezvous (highest random weight) hashing gives every key its home nodes.

Each (key, node) pair gets a pseudo-random score; a key's homes are the ``replicas`` nodes
with the highest scores.  Every client and daemon that sees the same members computes the
same homes, and when a node joins or leaves only the keys whose top choices change move.

Only the block hash of a key is scored, not its namespace id: a node scopes a tenant's keys
into the tenant's namespace (:mod:`kvpool.tenants`) and writes them through under that
name, and the tenant's client, which knows only its own name for them, must find the same
homes.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvpool.cluster.membership import Member
from kvpool.keys import NAMESPACE_ID_BYTES


def _seed(node_id: str) -> int:
    return xxhash.xxh3_64_intdigest(node_id.encode())


def homes(key: bytes, members: Sequence[Member], replicas: int = 1) -> list[Member]:
    """The ``replicas`` home nodes of ``key``, best first."""
    if not members:
        return []
    block = key[NAMESPACE_ID_BYTES:]
    scored = sorted(
        members,
        key=lambda m: (xxhash.xxh3_64_intdigest(block, seed=_seed(m.node_id)), m.node_id),
        reverse=True,
    )
    return scored[:replicas]


def home_ids(key: bytes, seeds: Sequence[tuple[str, int]], replicas: int) -> list[str]:
    """The home node ids of ``key`` among ``(node id, seed)`` pairs, best first."""
    block = key[NAMESPACE_ID_BYTES:]
    if replicas == 1:
        return [max(seeds, key=lambda s: (xxhash.xxh3_64_intdigest(block, seed=s[1]), s[0]))[0]]
    ranked = sorted(
        seeds, key=lambda s: (xxhash.xxh3_64_intdigest(block, seed=s[1]), s[0]), reverse=True
    )
    return [node_id for node_id, _ in ranked[:replicas]]


class Placement:
    """Homes of keys among a fixed set of members, remembered (keys come back: a
    conversation's prefix is looked up at every turn)."""

    MAX_REMEMBERED = 1 << 18

    def __init__(self, members: Sequence[Member], replicas: int = 1):
        self.node_ids = tuple(sorted(m.node_id for m in members))
        self.replicas = min(replicas, len(self.node_ids)) if self.node_ids else 0
        self._seeds = [(node_id, _seed(node_id)) for node_id in self.node_ids]
        self._homes: dict[bytes, list[str]] = {}

    def homes(self, key: bytes) -> list[str]:
        found = self._homes.get(key)
        if found is None:
            if not self._seeds:
                return []
            if len(self._homes) >= self.MAX_REMEMBERED:
                self._homes.clear()
            found = self._homes[key] = home_ids(key, self._seeds, self.replicas)
        return found

    def group(self, keys: Sequence[bytes], *, skip: str = "") -> dict[str, list[int]]:
        """Indices of ``keys`` per home node id (all of a key's homes but ``skip``)."""
        groups: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            for node_id in self.homes(key):
                if node_id != skip:
                    groups.setdefault(node_id, []).append(index)
        return groups


def group_by_home(
    keys: Sequence[bytes], members: Sequence[Member], replicas: int = 1, *, skip: str = ""
) -> dict[str, list[int]]:
    """Indices of ``keys`` per home node id (all of a key's homes but ``skip``)."""
    return Placement(members, replicas).group(keys, skip=skip)
