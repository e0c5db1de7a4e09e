"""The admin HTTP endpoint of a node: health, readiness, Prometheus metrics, JSON status and
a small dashboard page.  It shares the daemon's event loop.

Whenever the data port asks for keys (a tenants file, or the node's own ``--access-key``),
everything but ``/healthz`` and ``/readyz`` asks for the same ones, as HTTP Basic
credentials (an access id and its key; over TLS off loopback): the cluster's identity sees
everything, a tenant only its own status, and ``/metrics`` is the cluster's.  Without keys
the admin HTTP, like the data port, is for loopback only (the node refuses to start
otherwise).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.node.server import NodeServer
from kvpool.tls import CertFiles

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def build_app(server: NodeServer, is_ready: Callable[[], bool]) -> web.Application:
    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

    @web.middleware
    async def keyed_and_tenants_only_see_their_own(request: web.Request, handler: Handler) -> Any:
        if not server.credentials.requires_auth or request.path in OPEN_PATHS:
            return await handler(request)
        credential = server.credentials.authenticate(request.headers.get("Authorization", ""))
        if credential is None:
            return web.Response(
                status=401,
                text="credentials needed: an access id and its key (HTTP Basic)\n",
                headers={"WWW-Authenticate": 'Basic realm="kvpool"'},
            )
        if credential.tenant is not None and request.path == "/metrics":
            return web.Response(status=403, text="the node's metrics are the cluster's\n")
        request["tenant"] = credential.tenant
        return await handler(request)

    app = web.Application(middlewares=[keyed_and_tenants_only_see_their_own])

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if is_ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(server.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(request: web.Request) -> web.Response:
        stats = server.stats(request.get("tenant"))
        return web.Response(body=msgspec.json.encode(stats), content_type="application/json")

    async def dashboard(_: web.Request) -> web.Response:
        page = resources.files("kvpool.node").joinpath("dashboard.html").read_text()
        return web.Response(text=page, content_type="text/html")

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/", dashboard)
    return app


async def start_admin(
    server: NodeServer,
    listener: socket.socket,
    is_ready: Callable[[], bool],
    tls: CertFiles | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the admin HTTP on ``listener`` (bound as the node started, before anything was
    written: :func:`kvpool.node.server.bind_tcp`); the runner and the port."""
    runner = web.AppRunner(build_app(server, is_ready), access_log=None)
    await runner.setup()
    context = tls.context if tls is not None else None  # reloaded in place by the server
    site = web.SockSite(runner, listener, ssl_context=context)
    await site.start()
    return runner, listener.getsockname()[1]
