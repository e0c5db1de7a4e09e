"""The node daemon (``kvpool serve``): arena, journal, store, lower tiers, protocol server,
admin HTTP and cluster membership, started and stopped together.

Start-up order: lock the node directory (refusing a second daemon), map the arena and
replay its journal (adopting the blocks an earlier daemon left, unless ``--fresh``), open
the disk tier (re-indexing its segments), start serving, then join the cluster.  Once ready
it prints one line ``KVPOOL_READY {json}`` with its actual addresses and what it adopted.
:func:`kvpool.node.build.build_node` builds the parts; the daemon starts and stops them.

Stopping: on SIGTERM or SIGINT it leaves the cluster, stops serving, writes back what is
queued for disk, and keeps the arena, the journal and the disk tier: the next start (a
restart, an upgrade, the next pod of a DaemonSet) finds the blocks again.  A crash or
``kill -9`` leaves the same state.  ``kvpool drain`` (the SHUTDOWN operation with ``drain``)
empties the node: it removes the arena, the journal and the disk tier's segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.config import NodeConfig, format_size
from kvpool.node.admin import start_admin
from kvpool.node.build import Node, build_node
from kvpool.tiers.disk import empty_disk_dir

log = logging.getLogger("kvpool.node")

READY_PREFIX = "KVPOOL_READY "


class Daemon:
    """A node daemon's life: :meth:`start` builds and starts the node, :meth:`stop` stops
    it (idempotent; also after a failed start), :meth:`run` does both around serving."""

    def __init__(self, config: NodeConfig):
        self.config = config.validate()
        self.node: Node | None = None
        self._admin: Any = None
        self._is_serving = False
        self.admin_port = self.config.admin_port
        self._stopped = asyncio.Event()
        self._drain = False
        self.started_in_s = 0.0

    async def start(self) -> None:
        started = time.perf_counter()
        node = self.node = await build_node(self.config, on_shutdown=self.request_stop)
        try:
            self._is_serving = True
            await node.server.start()
            self._admin, self.admin_port = await start_admin(
                node.server, node.admin, self.is_ready, node.tls
            )
            if node.cluster is not None:
                await node.cluster.start(node.server.tcp_address, self.admin_port)
        except BaseException:
            await self.stop()
            raise
        self.started_in_s = time.perf_counter() - started
        # What the start built lives as long as the node (the store's index among it): a
        # full garbage collection need not walk it each time, millions of entries included.
        gc.freeze()
        self._log_ready(node)

    def _log_ready(self, node: Node) -> None:
        log.info(
            "kvpool node %s ready in %.2f s: %s arena at %s (%d blocks adopted%s), unix:%s, "
            "tcp %s, admin http://%s:%d",
            self.config.name,
            self.started_in_s,
            format_size(node.arena.num_bytes),
            node.arena.path,
            node.store.counters.adopted,
            f", {len(node.lower.disk)} on disk" if node.lower.disk is not None else "",
            self.config.socket_path,
            node.server.tcp_address,
            self.config.admin_host,
            self.admin_port,
        )

    def ready_info(self) -> dict[str, Any]:
        node = self.node
        assert node is not None
        events = node.events
        return {
            "name": self.config.name,
            "unix": str(self.config.socket_path),
            "tcp": node.server.tcp_address,
            "admin": f"http://{self.config.admin_host}:{self.admin_port}",
            "arena": str(node.arena.path),
            "arena_bytes": node.arena.num_bytes,
            "adopted_blocks": node.store.counters.adopted,
            "disk_blocks": len(node.lower.disk) if node.lower.disk is not None else 0,
            "started_in_s": round(self.started_in_s, 3),
            "kv_events": events.endpoint if events is not None else "",
            "kv_events_replay": events.replay_endpoint if events is not None else "",
            "kv_events_tenants": events.tenant_endpoints if events is not None else {},
        }

    def is_ready(self) -> bool:
        node = self.node
        if node is None or not self._is_serving:
            return False
        return node.cluster is None or node.cluster.is_joined

    def request_stop(self, drain: bool = False) -> None:
        """Stop soon; with ``drain``, empty the node as it stops."""
        self._drain = self._drain or drain
        self._stopped.set()

    async def stop(self) -> None:
        """Leave the cluster, stop the admin HTTP and the server (which writes back what is
        queued for disk), then close the events, the directory, the journal and the arena
        (removing them when draining), and release the node directory."""
        node, self.node = self.node, None
        if node is None:
            return
        if node.cluster is not None:
            with contextlib.suppress(Exception):
                await node.cluster.stop()
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        node.admin.close()  # bound at start, served or not
        node.tcp.close()
        if self._is_serving:
            self._is_serving = False
            await node.server.stop()
        else:
            node.lower.close()
        self._close_files(node)

    def _close_files(self, node: Node) -> None:
        drain = self._drain
        for sink in (node.events, node.kthena):
            if sink is not None:
                if drain:
                    sink.cleared()
                sink.close()
        node.directory.close(remove=True)  # retired: its readers ask the next daemon
        node.journal.close(remove=drain)
        node.arena.close(remove=drain)
        # Only if no other daemon holds the directory: never another's segments.
        if drain and self.config.disk.path and not empty_disk_dir(Path(self.config.disk.path)):
            log.warning("drain: %s is another daemon's now: its files stay", self.config.disk.path)
        node.lock.release()
        if drain:
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
            log.info(
                "kvpool node %s stopping (%s)",
                self.config.name,
                "draining: its contents go"
                if self._drain
                else "its contents stay for the next start",
            )
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
