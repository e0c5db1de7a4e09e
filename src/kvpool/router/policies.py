"""Routing policies: given the engines that can serve a request, the order to try them in
(the first is chosen; the rest are the retries).

- ``round_robin``: in turn.
- ``least_load``: fewest requests running and waiting (vLLM's metrics, or the router's own
  count when higher), then least KV cache in use.
- ``session``: the same engine for the same session (header, or the ``user`` field), by
  rendezvous hashing over the engines available; least-load without a session.
- ``cache_aware``: the engine whose pool node holds the longest prefix of the prompt,
  scored together with load: ``cache_weight * prefix share - load_weight * load share``.
  An engine busier than the least-loaded one by more than ``max_load_gap`` requests gets no
  cache bonus, so affinity never piles everything onto one overloaded engine.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .engines import Engine
from .prefix import PrefixLocator

log = logging.getLogger("kvpool.router")


@dataclass
class RoutedRequest:
    route: str
    body: dict[str, Any]
    session: str = ""
    notes: dict[str, Any] = field(default_factory=dict)


class Policy:
    name = "policy"

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        if not engines:
            return []
        start = next(self._counter) % len(engines)
        return engines[start:] + engines[:start]


def by_load(engines: list[Engine]) -> list[Engine]:
    return sorted(engines, key=lambda e: (e.load, e.kv_usage, e.in_flight, e.num_requests, e.url))


class LeastLoad(Policy):
    name = "least_load"

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        return by_load(engines)


class SessionAffinity(Policy):
    name = "session"

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        if not request.session:
            return by_load(engines)
        session = request.session.encode()
        return sorted(
            engines,
            key=lambda e: xxhash.xxh3_64_intdigest(
                session, seed=xxhash.xxh3_64_intdigest(e.url.encode())
            ),
            reverse=True,
        )


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        locator: PrefixLocator,
        *,
        cache_weight: float = 1.0,
        load_weight: float = 0.5,
        max_load_gap: float = 4.0,
    ):
        self.locator = locator
        self.cache_weight = cache_weight
        self.load_weight = load_weight
        self.max_load_gap = max_load_gap

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        if len(engines) <= 1:
            return engines
        num_blocks, prefix_by_node = await self.locator.locate(
            request.route, request.body, [e.node for e in engines]
        )
        least = min(e.load for e in engines)
        most = max(1.0, *(e.load for e in engines))

        def score(engine: Engine) -> float:
            share = prefix_by_node.get(engine.node, 0) / num_blocks if num_blocks else 0.0
            if engine.load - least > self.max_load_gap:
                share = 0.0
            return self.cache_weight * share - self.load_weight * engine.load / most

        # Ties (no prefix anywhere, equal load) go to the engine that has had the fewest
        # requests, so newcomers spread out.
        ranked = sorted(engines, key=lambda e: (-round(score(e), 6), e.load, e.num_requests, e.url))
        request.notes["prefix_blocks"] = {e.url: prefix_by_node.get(e.node, 0) for e in engines}
        request.notes["num_blocks"] = num_blocks
        return ranked


def make_policy(name: str, locator: PrefixLocator | None = None, **weights: float) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "session":
        return SessionAffinity()
    if name == "cache_aware":
        if locator is None:
            raise ValueError(
                "the cache_aware policy needs --tokenizer (the model's) and engine nodes"
            )
        return CacheAware(locator, **weights)
    raise ValueError(f"unknown policy {name!r}: round_robin, least_load, session or cache_aware")
