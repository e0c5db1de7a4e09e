"""``kvpool router``: an OpenAI-compatible proxy in front of vLLM engines.

- ``/v1/completions`` and ``/v1/chat/completions``, streaming or not; SSE chunks are passed
  through as they arrive.  ``/v1/models``, ``/health`` and ``/metrics`` too.
- With prefill and decode engines, a request first goes to a prefill engine with
  ``max_tokens=1`` and streaming off (it computes the prompt's KV and saves it to the pool),
  then, unchanged, to a decode engine, which loads that KV from the pool.  A failed prefill
  is retried on another prefill engine, and failing that the request goes to decode alone
  (with a warning).  A failure before the first byte of the answer is retried on another
  engine, or, when an engine is the only one of its role (one prefill + one decode), on the
  same engine after a short backoff; once bytes flow, the answer is the engine's.
- Every routing decision is logged at debug level with each candidate's inputs (prefix
  blocks held, load, health), and the answer names its engine and why:
  ``x-kvpool-engine`` and ``x-kvpool-route``.
- A client that disconnects cancels the upstream requests.
- ``/admin/engines``: list (GET), add (POST ``{"url", "role", "node", "tenants"}``) and
  remove (DELETE ``?url=…``; drained first) engines at run time.

Nothing before authentication: with ``--tenants`` a completion's credential is checked
from its headers before a byte of its body is read, and a body is read only up to
``--max-body`` (4 MiB) and parsed off the event loop, at most ``--max-parsing`` of one
tenant's at a time (of everyone's without tenants): a stranger costs the router a header,
and a tenant its own bounded share.

Who may use what: with ``--tenants``, completions take a tenant's credential, and
``/admin/*`` and ``/metrics`` only the cluster's (the tenants file's ``[cluster]``; a
tenant's is refused): an engine added by anyone else would receive every tenant's
prompts.  A POST to ``/admin/*`` must say ``Content-Type: application/json``, so that no
web page can send one cross-site as a plain form or text.  ``/health`` and ``/v1/models``
stay open.  A tenant's request goes only to the engines that serve its tenant (each serves
exactly one: :func:`~kvpool.router.config.check_engine`), and is refused (403) where none
does: an engine's pool credential and its GPU prefix cache are shared by all it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvpool.errors import ConfigError
from kvpool.tenants import Credential, Registry
from kvpool.tls import CertFiles

from .config import RouterSettings, check_engine, engine_from
from .engines import Engine, EngineSet, attempts
from .policies import LeastLoad, Policy, RoutedRequest
from .prefix import PrefixLocator

log = logging.getLogger("kvpool.router")

# Bodies of other routes (``/admin/*``): small JSON.
MAX_ADMIN_BODY_BYTES = 64 << 10
MAX_IDLE_PER_ENGINE = 16  # idle upstream connections kept per engine
PARSE_THREADS = 2  # bodies parsed at once, off the event loop
INLINE_PARSE_BYTES = 64 << 10  # a body this small is parsed on the event loop (microseconds)
RETRY_BACKOFF_S = 0.1  # before retrying the only engine of a role; doubles per attempt
# An idle upstream connection is closed before the engine would close it (uvicorn, which
# serves vLLM, does after 5 s): a request sent as the engine closes it fails for nothing.
UPSTREAM_KEEPALIVE_S = 4.0
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "upgrade",
    "host",
}
# 0.5 ms .. 25 s, three buckets a decade.
LATENCY_BUCKETS = tuple(m * 10.0**e for e in range(-4, 1) for m in (5, 10, 25))


class BoundedIdleConnector(aiohttp.TCPConnector):
    """A connection pool that keeps at most ``max_idle`` idle connections per engine.

    aiohttp keeps every connection a burst opened (1,000 concurrent requests leave ~500 per
    engine) until its keep-alive expires, then the next request meets them all in the pool,
    oldest first, and closes them one by one before it can connect: the engine and the
    router then handle ~500 closes while that request waits (15-20 ms on 2 cores).  Closing
    the surplus as each connection is released spreads that cost over the burst.
    """

    def __init__(self, max_idle: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_idle = max_idle

    def _release(self, key: Any, protocol: Any, *, should_close: bool = False) -> None:
        if len(self._conns.get(key, ())) >= self.max_idle:
            should_close = True
        super()._release(key, protocol, should_close=should_close)


class UpstreamFailed(Exception):
    """An engine failed before sending the first byte of its answer (so: retry)."""


class BadBody(Exception):
    """A request's body the router refuses: its HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Router:
    def __init__(
        self,
        config: RouterSettings,
        engines: EngineSet,
        policy: Policy,
        prefill_policy: Policy | None = None,
        locator: PrefixLocator | None = None,
    ):
        self.config = config
        self.engines = engines
        self.policy = policy
        self.prefill_policy = prefill_policy or LeastLoad()
        # With a tokenizer: the chosen engine's node prefetches the prompt's blocks.
        self.locator = locator if config.prefetch_hold > 0 else None
        # With tenants, every request names its tenant's credential (Authorization: Bearer
        # ACCESS_ID:KEY), and looks only at that tenant's blocks.
        self.tenants = Registry(Path(config.tenants)) if config.tenants else None
        for engine in engines.engines:
            self._check(engine)
        self._prefetches: set[asyncio.Task[None]] = set()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpool_router_requests",
            "Requests answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvpool_router_retries",
            "Attempts after the first, by phase (on another engine, or on the only one).",
            ["phase"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kvpool_router_prefill_fallbacks",
            "Requests sent to decode alone after every prefill failed.",
            registry=self.registry,
        )
        self.first_byte = Histogram(
            "kvpool_router_first_byte_seconds",
            "Time from a request's arrival to the first byte of its answer.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.overhead = Histogram(
            "kvpool_router_overhead_seconds",
            "Time the router spends before the request leaves for its engine.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.healthy = Gauge(
            "kvpool_router_engines_healthy",
            "Engines available, by role.",
            ["role"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvpool_router_in_flight",
            "Requests open on each engine.",
            ["engine"],
            registry=self.registry,
        )
        self._session: aiohttp.ClientSession | None = None
        # Bodies read and parsed now, per tenant ("" without tenants), and the threads
        # that parse them: a tenant waits for its own, never for another's.
        self._parsing: dict[str, asyncio.Semaphore] = {}
        self._parser = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvpool-parse")

    async def start(self) -> None:
        connector = BoundedIdleConnector(
            MAX_IDLE_PER_ENGINE, limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S
        )
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout, sock_read=self.config.read_timeout
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        await self.engines.start()

    async def stop(self) -> None:
        await self.engines.stop()
        if self._session is not None:
            await self._session.close()
        self._parser.shutdown(wait=False)

    # -- completions ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        route = request.path
        # Who asks, from the headers alone: nothing of the body is read before.
        credential: Credential | None = None
        if self.tenants is not None:
            credential = self.tenants.authenticate(request.headers.get("Authorization", ""))
            if credential is None:
                return self._error(route, 401, "a tenant's credential is needed: ID:KEY")
            if credential.tenant is None:  # every engine serves one tenant, none the cluster
                return self._error(route, 403, "completions take a tenant's credential")
            if not self.engines.serving(credential.tenant.name):
                name = credential.tenant.name
                return self._error(route, 403, f"no engine serves tenant {name!r}")
        try:
            raw, body = await self._read_body(request, credential)
        except BadBody as exc:
            return self._error(route, exc.status, str(exc))
        session = request.headers.get(self.config.session_header.lower(), "") or str(
            body.get("user") or ""
        )
        routed = RoutedRequest(route, body, session=session)
        routed.notes["raw"] = raw  # forwarded as received: no second serialization
        tenant: str | None = None
        if credential is not None and credential.tenant is not None:
            # Each candidate serves this tenant alone, and its connector saves under this
            # tenant's credential: the namespaces the cache-aware scoring reads are the ones
            # the candidates write.
            routed.notes["tenant"] = credential.tenant
            tenant = routed.notes["tenant_name"] = credential.tenant.name
        if self.engines.is_disaggregated(tenant):
            await self._prefill(routed, request)
        candidates = self._decode_candidates(tenant)
        if not candidates:
            return self._error(route, 503, "no healthy engine can serve this request")
        ordered = await self.policy.order(candidates, routed)
        self._prefetch(ordered[0], routed)
        self.overhead.observe(time.perf_counter() - arrived)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s to %s; candidates: %s",
                route,
                ordered[0].url,
                " | ".join(
                    f"{e.url} ({self._state(e)}; {routed.why.get(e.url, '')})" for e in ordered
                ),
            )
        return await self._forward(request, routed, ordered, arrived)

    async def _read_body(
        self, request: web.Request, credential: Credential | None
    ) -> tuple[bytes, dict[str, Any]]:
        """The body, read and parsed within its tenant's bound (:class:`BadBody` if too
        large, too slow, or not a JSON object): a tenant's bodies wait for each other, up
        to ``max_parsing`` at a time, and are parsed off the event loop."""
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BadBody(413, f"the request body is larger than {limit} bytes")
        who = credential.tenant.name if credential and credential.tenant else ""
        bound = self._parsing.get(who)
        if bound is None:
            bound = self._parsing[who] = asyncio.Semaphore(self.config.max_parsing)
        async with bound:
            try:
                async with asyncio.timeout(self.config.body_timeout):
                    raw = await _read_at_most(request.content, limit)
            except TimeoutError:
                raise BadBody(408, "the request body did not arrive in time") from None
            try:
                if len(raw) <= INLINE_PARSE_BYTES:  # microseconds: not worth a thread's hop
                    body = msgspec.json.decode(raw)
                else:
                    loop = asyncio.get_running_loop()
                    body = await loop.run_in_executor(self._parser, msgspec.json.decode, raw)
            except msgspec.DecodeError:
                raise BadBody(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadBody(400, "the request body must be a JSON object")
        return raw, body

    def _prefetch(self, engine: Engine, routed: RoutedRequest) -> None:
        """Off the request's path: the chosen engine's node starts bringing the prompt's
        blocks up from its lower tiers while the request waits in the engine's queue."""
        if self.locator is None or not engine.node:
            return
        task = asyncio.ensure_future(
            self.locator.prefetch(
                routed.route,
                routed.body,
                engine.node,
                self.config.prefetch_hold,
                routed.notes.get("block_hashes"),
                routed.notes.get("tenant"),
            )
        )
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)

    def _decode_candidates(self, tenant: str | None) -> list[Engine]:
        """The engines that may answer a request of ``tenant`` (after its prefill, where that
        is apart)."""
        if self.engines.is_disaggregated(tenant):
            return self.engines.available("decode", tenant)
        return self.engines.available("any", tenant) or self.engines.available("decode", tenant)

    def _check(self, engine: Engine) -> None:
        check_engine(engine, self.config, self.tenants.current if self.tenants else None)

    def _forward_headers(self, request: web.Request) -> dict[str, str]:
        # With tenants the credential was the router's to check: it does not travel on.
        dropped = frozenset({"authorization"}) if self.tenants is not None else frozenset()
        return _forward_headers(request, drop=dropped)

    def _state(self, engine: Engine) -> str:
        return "healthy" if engine.is_available else "unavailable"

    async def _before_attempt(
        self, attempt: int, engine: Engine, previous: Engine | None, phase: str
    ) -> None:
        if not attempt:
            return
        self.retries.labels(phase).inc()
        if engine is previous:  # the only engine of its role: give it a moment
            await asyncio.sleep(RETRY_BACKOFF_S * (1 << (attempt - 1)))

    async def _prefill(self, routed: RoutedRequest, request: web.Request) -> None:
        tenant = routed.notes.get("tenant_name")
        candidates = self.engines.available("prefill", tenant)
        body = dict(routed.body, max_tokens=1, stream=False)
        body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        ordered = await self.prefill_policy.order(candidates, routed)
        if ordered:
            self._prefetch(ordered[0], routed)
        previous: Engine | None = None
        tries = attempts(
            ordered, lambda: self.engines.available("prefill", tenant), self.config.max_attempts
        )
        for attempt, engine in enumerate(tries):
            await self._before_attempt(attempt, engine, previous, "prefill")
            previous = engine
            self.engines.started(engine)
            try:
                timeout = aiohttp.ClientTimeout(
                    total=self.config.prefill_timeout, connect=self.config.connect_timeout
                )
                assert self._session is not None
                async with self._session.post(
                    engine.url + routed.route,
                    json=body,
                    timeout=timeout,
                    headers=self._forward_headers(request),
                ) as upstream:
                    await upstream.read()
                    if upstream.status < 500:
                        routed.notes["prefill"] = engine.url
                        return  # a 4xx will come back from decode the same way
                    raise UpstreamFailed(f"status {upstream.status}")
            except UpstreamFailed as exc:
                self.engines.errored(engine, exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.engines.failed(engine, exc)
            finally:
                self.engines.finished(engine)
        self.fallbacks.inc()
        log.warning(
            "prefill failed on every prefill engine (%d tried); sending the request to "
            "decode alone, which recomputes the prompt",
            min(len(ordered), self.config.max_attempts),
        )

    async def _forward(
        self, request: web.Request, routed: RoutedRequest, ordered: list[Engine], arrived: float
    ) -> web.StreamResponse:
        assert self._session is not None
        previous: Engine | None = None
        tenant = routed.notes.get("tenant_name")
        for attempt, engine in enumerate(
            attempts(ordered, lambda: self._decode_candidates(tenant), self.config.max_attempts)
        ):
            await self._before_attempt(attempt, engine, previous, "decode")
            previous = engine
            response: web.StreamResponse | None = None
            self.engines.started(engine)
            try:
                async with self._session.post(
                    engine.url + routed.route,
                    data=routed.notes["raw"],
                    headers=self._forward_headers(request),
                ) as upstream:
                    if upstream.status >= 500:
                        await upstream.read()
                        raise UpstreamFailed(f"status {upstream.status}")
                    # Streaming headers come at once; an engine can still fail before its
                    # first chunk (during prefill), and until then the request is retried
                    # elsewhere.  So the answer starts only with the first chunk.
                    chunks = upstream.content.iter_any()
                    first = await anext(chunks, b"")
                    self.first_byte.observe(time.perf_counter() - arrived)
                    response = web.StreamResponse(
                        status=upstream.status, headers=_reply_headers(upstream)
                    )
                    response.headers["x-kvpool-engine"] = engine.url
                    why = routed.why.get(engine.url, "")
                    response.headers["x-kvpool-route"] = why + (
                        f"; attempt={attempt + 1}" if attempt else ""
                    )
                    await response.prepare(request)
                    if first:
                        await response.write(first)
                    async for chunk in chunks:
                        await response.write(chunk)
                    await response.write_eof()
                    self.requests.labels(routed.route, str(upstream.status)).inc()
                    return response
            except (aiohttp.ClientError, TimeoutError, UpstreamFailed) as exc:
                if response is not None:  # bytes already went to the client: cannot retry
                    log.warning("engine %s failed mid-answer: %s", engine.url, exc)
                    raise
                if isinstance(exc, UpstreamFailed):
                    self.engines.errored(engine, exc)
                else:
                    self.engines.failed(engine, exc)
            finally:
                self.engines.finished(engine)
        return self._error(routed.route, 502, "every engine tried failed before answering")

    def _error(self, route: str, status: int, message: str) -> web.Response:
        self.requests.labels(route, str(status)).inc()
        body = {"error": {"message": message, "type": "router_error", "code": status}}
        return web.json_response(body, status=status)

    # -- other routes -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        for engine in self.engines.available("decode") + self.engines.available("prefill"):
            try:
                async with self._session.get(
                    engine.url + "/v1/models",
                    timeout=aiohttp.ClientTimeout(total=self.config.models_timeout),
                ) as upstream:
                    return web.Response(
                        body=await upstream.read(),
                        status=upstream.status,
                        content_type="application/json",
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.engines.failed(engine, exc)
        return self._error("/v1/models", 503, "no healthy engine")

    async def health(self, request: web.Request) -> web.Response:
        ok = bool(self.engines.available("decode") or self.engines.available("any"))
        return web.json_response(
            {"healthy": ok, "engines": len(self.engines.engines)}, status=200 if ok else 503
        )

    async def metrics(self, request: web.Request) -> web.Response:
        for role in ("both", "prefill", "decode"):
            self.healthy.labels(role).set(
                sum(1 for e in self.engines.engines if e.role == role and e.is_available)
            )
        for engine in self.engines.engines:
            self.in_flight.labels(engine.url).set(engine.in_flight)
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def list_engines(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"policy": self.policy.name, "engines": [e.describe() for e in self.engines.engines]}
        )

    async def add_engine(self, request: web.Request) -> web.Response:
        try:
            spec = await request.json()
            if not isinstance(spec, dict):
                raise ConfigError("the body must be a JSON object")
            engine = engine_from(spec)
            self._check(engine)
            self.engines.add(engine)
        except (json.JSONDecodeError, ConfigError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        await self.engines.check(engine)
        return web.json_response(engine.describe(), status=201)

    async def remove_engine(self, request: web.Request) -> web.Response:
        url = request.query.get("url", "")
        try:
            timeout = float(request.query.get("timeout", self.config.drain_timeout))
        except ValueError:
            return web.json_response({"error": "timeout must be a number of seconds"}, status=400)
        if not 0 <= timeout <= 3600:
            return web.json_response({"error": "timeout must be within 0-3600 s"}, status=400)
        try:
            drained = await self.engines.remove(url, timeout)
        except KeyError:
            return web.json_response({"error": f"no engine {url}"}, status=404)
        return web.json_response({"removed": url, "drained": drained})

    @web.middleware
    async def _operators_only(self, request: web.Request, handler: Any) -> Any:
        """``/admin/*`` and ``/metrics``: the cluster's credential, with tenants; a POST to
        ``/admin/*`` must be JSON (no cross-site form or text POST reaches it)."""
        is_admin = request.path.startswith("/admin/")
        if not is_admin and request.path != "/metrics":
            return await handler(request)
        if self.tenants is not None:
            credential = self.tenants.authenticate(request.headers.get("Authorization", ""))
            if credential is None:
                return web.json_response(
                    {"error": "the cluster's credential is needed (HTTP Basic or Bearer ID:KEY)"},
                    status=401,
                    headers={"WWW-Authenticate": 'Basic realm="kvpool router"'},
                )
            if credential.tenant is not None:
                return web.json_response({"error": "for the cluster's operators only"}, status=403)
        if is_admin and request.method == "POST" and request.content_type != "application/json":
            return web.json_response({"error": "Content-Type must be application/json"}, status=415)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_ADMIN_BODY_BYTES, middlewares=[self._operators_only]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/admin/engines", self.list_engines)
        app.router.add_post("/admin/engines", self.add_engine)
        app.router.add_delete("/admin/engines", self.remove_engine)

        async def lifecycle(_: web.Application) -> Any:
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app


async def _read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """A body of at most ``limit`` bytes (:class:`BadBody` 413 past it, read no further)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.read(limit + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise BadBody(413, f"the request body is larger than {limit} bytes")
    return b"".join(chunks)


def _forward_headers(request: web.Request, *, drop: frozenset[str] = frozenset()) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | drop}


def _reply_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def serve(
    router: Router,
    host: str,
    port: int,
    ready: asyncio.Event | None = None,
    tls: CertFiles | None = None,
) -> None:
    """Serve until cancelled.  Client disconnects cancel their handlers (and so the upstream
    requests).  With ``tls``, HTTPS, its certificate reloaded when the files change."""
    # A request refused before its body was read (no credential, too large) closes its
    # connection: the router reads nothing more of it (aiohttp would read and discard up
    # to 10 s of it, for a stranger).
    runner = web.AppRunner(
        router.app(), handler_cancellation=True, access_log=None, lingering_time=0
    )
    await runner.setup()
    context = tls.context if tls is not None else None
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True, ssl_context=context)
    await site.start()
    scheme = "https" if tls is not None else "http"
    log.info(
        "kvpool router on %s://%s:%d, %d engines, policy %s",
        scheme,
        host,
        port,
        len(router.engines.engines),
        router.policy.name,
    )
    print(f"KVPOOL_ROUTER_READY {scheme}://{host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        while True:
            await asyncio.sleep(1.0)
            if router.tenants is not None:
                router.tenants.reload()
            if tls is not None:
                tls.reload()
    finally:
        await runner.cleanup()
