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

Every policy explains its choice: ``RoutedRequest.why`` holds, per engine, the inputs of
its rank (prefix blocks held, load, score).  The router logs them at debug level and names
the chosen engine and why in the ``x-kvpool-route`` response header.
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
    # Per engine url, the inputs of its rank: "policy=...; prefix=3/10; load=1; score=0.25".
    why: dict[str, str] = field(default_factory=dict)

    def explain(
        self, policy: str, engines: list[Engine], extra: dict[str, str] | None = None
    ) -> None:
        for engine in engines:
            parts = [f"policy={policy}", f"load={engine.load:g}"]
            if extra and engine.url in extra:
                parts.append(extra[engine.url])
            self.why[engine.url] = "; ".join(parts)


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
        request.explain(self.name, engines)
        return engines[start:] + engines[:start]


def by_load(engines: list[Engine]) -> list[Engine]:
    return sorted(engines, key=lambda e: (e.load, e.kv_usage, e.in_flight, e.num_requests, e.url))


class LeastLoad(Policy):
    name = "least_load"

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        request.explain(self.name, engines)
        return by_load(engines)


class SessionAffinity(Policy):
    name = "session"

    async def order(self, engines: list[Engine], request: RoutedRequest) -> list[Engine]:
        if not request.session:
            request.explain("least_load", engines)
            return by_load(engines)
        request.explain(self.name, engines, {e.url: f"session={request.session}" for e in engines})
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
            request.explain(self.name, engines, {e.url: "only engine" for e in engines})
            return engines
        located = await self.locator.locate(
            request.route, request.body, [e.node for e in engines], request.notes.get("tenant")
        )
        request.notes["block_hashes"] = located.hashes  # for the prefetch that follows
        least = min(e.load for e in engines)
        most = max(1.0, *(e.load for e in engines))
        scores: dict[str, float] = {}
        details: dict[str, str] = {}
        for engine in engines:
            held = located.prefix_by_node.get(engine.node, 0)
            share = held / located.num_blocks if located.num_blocks else 0.0
            capped = engine.load - least > self.max_load_gap
            if capped:
                share = 0.0
            scores[engine.url] = round(
                self.cache_weight * share - self.load_weight * engine.load / most, 6
            )
            node_state = located.unanswered.get(engine.node, "")
            details[engine.url] = (
                f"prefix={held}/{located.num_blocks}"
                + (f" ({node_state})" if node_state else "")
                + ("; too busy for affinity" if capped else "")
                + f"; score={scores[engine.url]:g}"
            )
        request.explain(self.name, engines, details)
        # Ties (no prefix anywhere, equal load) go to the engine that has had the fewest
        # requests, so newcomers spread out.
        return sorted(engines, key=lambda e: (-scores[e.url], e.load, e.num_requests, e.url))


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
