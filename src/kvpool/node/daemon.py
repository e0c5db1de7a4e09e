"""The node daemon (``kvpool serve``): arena, store, protocol server, admin HTTP and cluster
membership, started and stopped together.

Start-up order: lock the node directory (refusing a second daemon, reclaiming what a
crashed one left), create the arena, start serving, then join the cluster.  On SIGTERM or
SIGINT it leaves the cluster, stops serving and removes the arena and the socket.  Once
ready it prints one line ``KVPOOL_READY {json}`` with its actual addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from kvpool.config import NodeConfig, format_size
from kvpool.node.admin import start_admin
from kvpool.node.server import NodeServer
from kvpool.store.arena import Arena, NodeDirLock
from kvpool.store.pool import BlockStore

if TYPE_CHECKING:
    from kvpool.node.cluster_agent import NodeAgent

log = logging.getLogger("kvpool.node")

READY_PREFIX = "KVPOOL_READY "


class Daemon:
    def __init__(self, config: NodeConfig):
        self.config = config.validate()
        self.lock: NodeDirLock | None = None
        self.arena: Arena | None = None
        self.server: NodeServer | None = None
        self.cluster: NodeAgent | None = None
        self._admin: Any = None
        self.admin_port = config.admin_port
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        config = self.config
        self.lock = NodeDirLock(config.node_dir)
        try:
            self.arena = Arena(config.arena_path, config.memory_bytes, hugepages=config.hugepages)
            store = BlockStore(
                self.arena.num_bytes,
                high_watermark=config.high_watermark,
                low_watermark=config.low_watermark,
                leases=config.leases,
            )
            if config.peers or config.etcd:
                from kvpool.node.cluster_agent import NodeAgent

                self.cluster = NodeAgent(config, store, self.arena)
            self.server = NodeServer(config, store, self.arena, self.cluster)
            await self.server.start()
            self._admin, self.admin_port = await start_admin(
                self.server, config.admin_host, config.admin_port, self.is_ready
            )
            if self.cluster is not None:
                await self.cluster.start(self.server.tcp_address, self.admin_port)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kvpool node %s ready: %s arena at %s, unix:%s, tcp %s, admin http://%s:%d",
            config.name,
            format_size(self.arena.num_bytes),
            self.arena.path,
            config.socket_path,
            self.server.tcp_address,
            config.admin_host,
            self.admin_port,
        )

    def ready_info(self) -> dict[str, Any]:
        assert self.server is not None and self.arena is not None
        return {
            "name": self.config.name,
            "unix": str(self.config.socket_path),
            "tcp": self.server.tcp_address,
            "admin": f"http://{self.config.admin_host}:{self.admin_port}",
            "arena": str(self.arena.path),
            "arena_bytes": self.arena.num_bytes,
        }

    def is_ready(self) -> bool:
        return self.server is not None and (self.cluster is None or self.cluster.is_joined)

    async def stop(self) -> None:
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                await self.cluster.stop()
            self.cluster = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            with contextlib.suppress(OSError):
                self.config.node_dir.rmdir()  # only if empty

    async def run(self) -> None:
        """Start, print the ready line, serve until SIGTERM / SIGINT, then clean up."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self.start()
        try:
            print(READY_PREFIX + json.dumps(self.ready_info()), flush=True)
            await self._stopped.wait()
            log.info("kvpool node %s stopping", self.config.name)
        finally:
            await self.stop()


def run_daemon(config: NodeConfig) -> None:
    """Run a daemon on uvloop when it is available."""
    daemon = Daemon(config)
    try:
        import uvloop

        uvloop.run(daemon.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(daemon.run())
    sys.stdout.flush()
