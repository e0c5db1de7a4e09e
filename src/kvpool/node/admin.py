"""The admin HTTP endpoint of a node: health, readiness, Prometheus metrics, JSON status and
a small dashboard page.  It shares the daemon's event loop."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.node.server import NodeServer


def build_app(server: NodeServer, is_ready: Callable[[], bool]) -> web.Application:
    app = web.Application()

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if is_ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(server.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(_: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(server.stats()), content_type="application/json"
        )

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
    server: NodeServer, host: str, port: int, is_ready: Callable[[], bool]
) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_app(server, is_ready), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or ()
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
