"""The eviction policies a node can run, by the name ``--eviction`` gives."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.errors import ConfigError
from kvpool.store.eviction import EvictionPolicy, LRUPolicy
from kvpool.store.learned import LearnedPolicy

# kvpool.config.EVICTION_POLICIES names the same (a test checks that they agree).
NAME_TO_POLICY: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "learned": LearnedPolicy,
}


def new_policy(name: str) -> EvictionPolicy:
    """The policy ``name`` names."""
    factory = NAME_TO_POLICY.get(name)
    if factory is None:
        raise ConfigError(f"no eviction policy {name!r}: one of {', '.join(NAME_TO_POLICY)}")
    return factory()
