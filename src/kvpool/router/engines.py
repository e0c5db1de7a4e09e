"""The engines behind the router: their roles, health and load.

An engine is an OpenAI-compatible server (vLLM).  Its role is ``both`` (a plain engine),
``prefill`` or ``decode``; ``node`` names the kvpool node on its host (for cache-aware
routing); ``tenants`` names the tenants it serves (with ``--tenants``: exactly one, see
:func:`kvpool.router.config.check_engine`), and a tenant's request goes only to an engine
that serves it.  A background task checks ``/health`` (an engine is taken out after a failure
and back after ``recover_after`` consecutive successes) and reads vLLM's ``/metrics`` for
the load: requests running and waiting, and KV cache usage.  Engines added at run time are
used at once; an engine being removed is drained first: it takes no new requests, and it
goes once the requests it is serving have finished.

An engine that fails (unreachable, or silent) is taken out at once while another engine can
do its job; the last engine of a role is taken out only after ``LAST_ENGINE_FAILURES``
failures in a row, so that one dropped connection never leaves a role with nobody.  A
health check that times out counts as a failure only after ``SLOW_CHECKS`` in a row: an
engine busy on a loaded host answers late, and taking it out would leave its requests to
the others (or to nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

log = logging.getLogger("kvpool.router")

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

LAST_ENGINE_FAILURES = 3
SLOW_CHECKS = 3

LOAD_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(eq=False)
class Engine:
    url: str
    role: Role = "both"
    node: str = ""  # the kvpool node on the engine's host
    name: str = ""
    # The tenants whose requests it may take (by name); empty without --tenants.
    tenants: frozenset[str] = frozenset()
    is_healthy: bool = True
    is_draining: bool = False
    in_flight: int = 0  # requests the router has open on it now
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    successes: int = 0
    failures_in_a_row: int = 0
    slow_checks_in_a_row: int = 0
    num_requests: int = 0
    num_failures: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.name = self.name or self.url
        if self.role not in ROLES:
            raise ValueError(f"engine role must be one of {ROLES}, not {self.role!r}")

    @property
    def is_available(self) -> bool:
        return self.is_healthy and not self.is_draining

    @property
    def load(self) -> float:
        """Requests ahead of a new one: the engine's own count, or the router's if higher
        (the engine's metrics lag)."""
        return max(self.running + self.waiting, float(self.in_flight))

    def can_serve(self, phase: Literal["prefill", "decode", "any"]) -> bool:
        if phase == "any":
            return self.role == "both"
        return self.role in (phase, "both")

    def serves(self, tenant: str | None) -> bool:
        """Whether a request of ``tenant`` may come here (``None``: there are no tenants)."""
        return tenant is None or tenant in self.tenants

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "role": self.role,
            "node": self.node,
            "tenants": sorted(self.tenants),
            "healthy": self.is_healthy,
            "draining": self.is_draining,
            "in_flight": self.in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "requests": self.num_requests,
            "failures": self.num_failures,
            # Where the health checks stand: how close the engine is to being taken out
            # (or, out, to being taken back).
            "successes": self.successes,
            "failures_in_a_row": self.failures_in_a_row,
            "slow_checks_in_a_row": self.slow_checks_in_a_row,
        }


def attempts(
    ordered: list[Engine], candidates: Callable[[], list[Engine]], max_attempts: int
) -> Iterator[Engine]:
    """The engines to try a request on in turn, ``max_attempts`` at most: the ranked ones,
    then any candidate available by the time a try has failed (one the health checks took
    back meanwhile); the only one, several times."""
    tried: list[Engine] = []
    for _ in range(max_attempts):
        fresh = [e for e in [*ordered, *candidates()] if e not in tried and e.is_available]
        if fresh:
            tried.append(fresh[0])
        elif tried != ordered or len(ordered) != 1:
            return  # each engine had its try (the only one ranked may have another)
        yield tried[-1]


class EngineSet:
    """The engines, and the task that checks them."""

    def __init__(
        self,
        engines: list[Engine],
        *,
        interval_s: float = 1.0,
        recover_after: int = 2,
        timeout_s: float = 2.0,
    ):
        self.engines: list[Engine] = list(engines)
        self.interval_s = interval_s
        self.recover_after = recover_after
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def available(
        self, phase: Literal["prefill", "decode", "any"], tenant: str | None = None
    ) -> list[Engine]:
        """The engines that can take ``phase`` of a request of ``tenant`` now."""
        return [
            e for e in self.engines if e.is_available and e.can_serve(phase) and e.serves(tenant)
        ]

    def serving(self, tenant: str | None) -> list[Engine]:
        """The engines registered for ``tenant``'s requests, whatever their health."""
        return [e for e in self.engines if e.serves(tenant)]

    def is_disaggregated(self, tenant: str | None = None) -> bool:
        """Whether ``tenant``'s requests have prefill and decode engines apart."""
        roles = {e.role for e in self.engines if not e.is_draining and e.serves(tenant)}
        return "prefill" in roles and "decode" in roles

    def find(self, url: str) -> Engine | None:
        url = url.rstrip("/")
        return next((e for e in self.engines if e.url == url), None)

    def add(self, engine: Engine) -> Engine:
        if self.find(engine.url) is not None:
            raise ValueError(f"engine {engine.url} is already registered")
        self.engines.append(engine)
        log.info(
            "engine added: %s (%s%s)",
            engine.url,
            engine.role,
            f"; tenants {', '.join(sorted(engine.tenants))}" if engine.tenants else "",
        )
        return engine

    async def remove(self, url: str, timeout: float) -> bool:
        """Drain the engine (no new requests), wait for its requests up to ``timeout``, then
        drop it; returns whether it drained before the timeout."""
        engine = self.find(url)
        if engine is None:
            raise KeyError(url)
        engine.is_draining = True
        if engine.in_flight == 0:
            engine.drained.set()
        drained = True
        try:
            await asyncio.wait_for(engine.drained.wait(), timeout)
        except TimeoutError:
            drained = False
        if engine in self.engines:  # two removals of one engine may race
            self.engines.remove(engine)
        log.info("engine removed: %s (%s)", url, "drained" if drained else "drain timed out")
        return drained

    def started(self, engine: Engine) -> None:
        engine.in_flight += 1
        engine.num_requests += 1

    def finished(self, engine: Engine) -> None:
        engine.in_flight -= 1
        if engine.is_draining and engine.in_flight == 0:
            engine.drained.set()

    def errored(self, engine: Engine, reason: object) -> None:
        """The engine answered a request with a server error: retried elsewhere, but one
        bad request does not take the engine out (health checks judge that)."""
        engine.num_failures += 1
        log.info("engine %s answered with an error: %s", engine.url, reason)

    def failed(self, engine: Engine, reason: object) -> None:
        """The engine could not be reached, or went silent: out until it is healthy again
        (the last of its role only after several failures in a row)."""
        engine.num_failures += 1
        engine.failures_in_a_row += 1
        engine.successes = 0
        if not engine.is_healthy:
            return
        if self._is_last_of_role(engine) and engine.failures_in_a_row < LAST_ENGINE_FAILURES:
            log.warning(
                "engine %s failed (%s); kept: it is the last of its role (%d/%d failures)",
                engine.url,
                reason,
                engine.failures_in_a_row,
                LAST_ENGINE_FAILURES,
            )
            return
        log.warning("engine %s unhealthy: %s", engine.url, reason)
        engine.is_healthy = False

    def _is_last_of_role(self, engine: Engine) -> bool:
        """Whether some tenant of ``engine`` (or everyone, without tenants) would be left
        with no engine for one of its phases."""
        phases: tuple[Literal["prefill", "decode"], ...] = (
            ("prefill", "decode") if engine.role == "both" else (engine.role,)
        )
        return any(
            not any(e is not engine and engine.tenants <= e.tenants for e in self.available(phase))
            for phase in phases
        )

    # -- background checks ----------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        await self.check_all()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in list(self.engines)))

    async def check(self, engine: Engine) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{engine.url}/health") as response:
                ok = response.status == 200
            if ok:
                async with self._session.get(f"{engine.url}/metrics") as response:
                    self._read_load(engine, await response.text())
        except TimeoutError as exc:
            engine.successes = 0
            engine.slow_checks_in_a_row += 1
            if engine.slow_checks_in_a_row >= SLOW_CHECKS:
                self.failed(engine, f"{SLOW_CHECKS} health checks in a row timed out ({exc!r})")
            return
        except (aiohttp.ClientError, ValueError) as exc:
            self.failed(engine, exc)
            return
        engine.slow_checks_in_a_row = 0
        if not ok:
            self.failed(engine, "health check failed")
            return
        engine.successes += 1
        engine.failures_in_a_row = 0
        if not engine.is_healthy and engine.successes >= self.recover_after:
            engine.is_healthy = True
            log.warning("engine %s healthy again", engine.url)

    @staticmethod
    def _read_load(engine: Engine, text: str) -> None:
        values = read_gauges(text, LOAD_METRICS)
        engine.running = values["running"]
        engine.waiting = values["waiting"]
        engine.kv_usage = values["kv_usage"]


def read_gauges(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """The sums over their samples of the gauges ``wanted`` names, from Prometheus text.

    A line scan, not a full parse: vLLM's /metrics runs to thousands of lines of histograms,
    and parsing it all on the event loop every second stalled every request in flight."""
    values = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, rest = line.partition(" ")
        attribute = wanted.get(name)
        if attribute is None:
            continue
        sample = rest.rpartition("}")[2] if "}" in rest else rest
        try:
            values[attribute] += float(sample.split()[0])
        except (IndexError, ValueError):
            raise ValueError(f"unreadable metric line {line[:200]!r}") from None
    return values
