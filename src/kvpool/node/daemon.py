"""The node daemon (``kvpool serve``): arena, journal, store, lower tiers, protocol server,
admin HTTP and cluster membership, started and stopped together.

Start-up order: lock the node directory (refusing a second daemon), map the arena and
replay its journal (adopting the blocks an earlier daemon left, unless ``--fresh``), open
the disk tier (re-indexing its segments), start serving, then join the cluster.  Once ready
it prints one line ``KVPOOL_READY {json}`` with its actual addresses and what it adopted.

Stopping: on SIGTERM or SIGINT it leaves the cluster, stops serving, writes back what is
queued for disk, and keeps the arena, the journal and the disk tier: the next start (a
restart, an upgrade, the next pod of a DaemonSet) finds the blocks again.  A crash or
``kill -9`` leaves the same state.  ``kvpool drain`` (the SHUTDOWN operation with ``drain``)
empties the node: it removes the arena, the journal and the disk tier's segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.config import NodeConfig, format_size
from kvpool.directory import DirectoryWriter
from kvpool.errors import ConfigError
from kvpool.node.admin import start_admin
from kvpool.node.sealing import seal_replayed
from kvpool.node.server import NodeServer
from kvpool.store.arena import Arena, NodeDirLock
from kvpool.store.eviction import LRUPolicy
from kvpool.store.holds import Holds, QueueAwareEviction
from kvpool.store.journal import Journal
from kvpool.store.pool import BlockStore
from kvpool.tenants import Registry
from kvpool.tiers.build import empty_disk_dir, open_lower_tiers
from kvpool.tiers.chain import Tiers
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.tier import RemoteSource
from kvpool.tls import CertFiles

if TYPE_CHECKING:
    from kvpool.node.cluster_agent import NodeAgent
    from kvpool.node.events import KVEventPublisher

log = logging.getLogger("kvpool.node")

READY_PREFIX = "KVPOOL_READY "


class Daemon:
    def __init__(self, config: NodeConfig):
        config = config.validate()
        # Tenants and TLS files are read before anything starts: a bad one stops the start.
        self.tenants = Registry(Path(config.tenants_path)) if config.tenants_path else None
        if self.tenants is not None:
            cluster = self.tenants.current.cluster
            if cluster is None and (config.peers or config.etcd):
                raise ConfigError(
                    f"{config.tenants_path}: a cluster needs a [cluster] section (the identity "
                    "nodes use between themselves)"
                )
            if cluster is not None:  # what this node's own clients (write-through) present
                config = dataclasses.replace(
                    config, access_id=cluster.access_id, access_key=cluster.key
                )
        self.tls = (
            CertFiles(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert
            else None
        )
        self.config = config
        self.lock: NodeDirLock | None = None
        self.arena: Arena | None = None
        self.journal: Journal | None = None
        self.directory: DirectoryWriter | None = None
        self.disk: DiskTier | None = None
        self.store: BlockStore | None = None
        self.server: NodeServer | None = None
        self.cluster: NodeAgent | None = None
        self.events: KVEventPublisher | None = None
        self._admin: Any = None
        self.admin_port = config.admin_port
        self._stopped = asyncio.Event()
        self._drain = False
        self.started_in_s = 0.0

    async def start(self) -> None:
        started = time.perf_counter()
        config = self.config
        self.lock = NodeDirLock(config.node_dir)
        try:
            arena = self.arena = Arena(
                config.arena_path,
                config.memory_bytes,
                hugepages=config.hugepages,
                fresh=config.fresh,
            )
            # Before anything writes the arena: readers of an earlier daemon's directory
            # stop trusting it (kvpool.directory, rule 3).
            self.directory = DirectoryWriter(config.directory_path, arena.num_bytes, arena.arena_id)
            self.journal = Journal(
                config.journal_path,
                arena.dev,
                arena.ino,
                arena.num_bytes,
                fresh=config.fresh or not arena.is_kept,
            )
            seal_replayed(self.journal.replayed, arena)
            if config.kv_events:
                from kvpool.node.events import EventsConfig, KVEventPublisher

                self.events = KVEventPublisher(
                    EventsConfig(
                        config.kv_events,
                        config.kv_events_replay,
                        config.kv_events_topic,
                        config.kv_events_encoding,
                    )
                )
            lower = await open_lower_tiers(config, arena, self.events)
            self.disk = lower.disk
            holds = Holds(arena.num_bytes // 2)
            store = self.store = BlockStore(
                arena.num_bytes,
                eviction=QueueAwareEviction(LRUPolicy(), holds),
                high_watermark=config.high_watermark,
                low_watermark=config.low_watermark,
                leases=config.leases,
                journal=self.journal,
                spill=lower.writeback,
                directory=self.directory,
                events=self.events,
            )
            if self.events is not None and not store.counters.adopted:
                self.events.cleared()  # whatever an earlier daemon announced is gone
            remote = None
            if config.peers or config.etcd:
                from kvpool.node.cluster_agent import NodeAgent

                self.cluster = NodeAgent(config, store, arena)
                remote = RemoteSource(self.cluster.fetch)  # prefetch reads other nodes too
            tiers = Tiers(store, arena, lower, holds, remote)
            self.server = NodeServer(
                config,
                store,
                arena,
                tiers,
                self.cluster,
                on_shutdown=self.request_stop,
                tenants=self.tenants,
                tls=self.tls,
            )
            await self.server.start()
            self._admin, self.admin_port = await start_admin(
                self.server, config.admin_host, config.admin_port, self.is_ready, self.tls
            )
            if self.cluster is not None:
                await self.cluster.start(self.server.tcp_address, self.admin_port)
        except BaseException:
            await self.stop()
            raise
        self.started_in_s = time.perf_counter() - started
        log.info(
            "kvpool node %s ready in %.2f s: %s arena at %s (%d blocks adopted%s), unix:%s, "
            "tcp %s, admin http://%s:%d",
            config.name,
            self.started_in_s,
            format_size(arena.num_bytes),
            arena.path,
            store.counters.adopted,
            f", {len(self.disk)} on disk" if self.disk is not None else "",
            config.socket_path,
            self.server.tcp_address,
            config.admin_host,
            self.admin_port,
        )

    def ready_info(self) -> dict[str, Any]:
        assert self.server is not None and self.arena is not None and self.store is not None
        return {
            "name": self.config.name,
            "unix": str(self.config.socket_path),
            "tcp": self.server.tcp_address,
            "admin": f"http://{self.config.admin_host}:{self.admin_port}",
            "arena": str(self.arena.path),
            "arena_bytes": self.arena.num_bytes,
            "adopted_blocks": self.store.counters.adopted,
            "disk_blocks": len(self.disk) if self.disk is not None else 0,
            "started_in_s": round(self.started_in_s, 3),
            "kv_events": self.events.endpoint if self.events is not None else "",
            "kv_events_replay": self.events.replay_endpoint if self.events is not None else "",
        }

    def is_ready(self) -> bool:
        return self.server is not None and (self.cluster is None or self.cluster.is_joined)

    def request_stop(self, drain: bool = False) -> None:
        """Stop soon; with ``drain``, empty the node as it stops."""
        self._drain = self._drain or drain
        self._stopped.set()

    async def stop(self) -> None:
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                await self.cluster.stop()
            self.cluster = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        if self.server is not None:
            await self.server.stop()  # writes back what is queued for disk
            self.server = None
        if self.events is not None:
            if self._drain:
                self.events.cleared()
            self.events.close()
            self.events = None
        if self.directory is not None:
            self.directory.close(remove=True)  # retired: its readers ask the next daemon
            self.directory = None
        if self.journal is not None:
            self.journal.close(remove=self._drain)
            self.journal = None
        if self.arena is not None:
            self.arena.close(remove=self._drain)
            self.arena = None
        if self._drain and self.config.disk_path:
            empty_disk_dir(self.config.disk_path)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            if self._drain:
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
