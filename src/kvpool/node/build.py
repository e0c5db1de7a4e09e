"""The node's assembly root: :func:`build_node` constructs every part of a node daemon
top-down from its :class:`~kvpool.config.NodeConfig`, and hands each part its
collaborators through its constructor.  No part is given a hook or a collaborator after it
is built; this module is the one place that knows how the parts fit together.

Two phases.  **Open and check**: everything that can refuse the start, reading the node's
files and writing none of them, so that a start that does not get through leaves every
file of the node as it found it, contents and length (an earlier release rolled back to
adopts them as if this one never ran):

0. the tenants file and the TLS files (:func:`read_credentials`: a bad one stops the start);
1. the node directory's lock (a second daemon is refused here);
2. the KV event publisher (when ``--kv-events``), which the tiers below tell of blocks, and
   Kthena's Redis entries (when ``--kthena-redis``): the sinks of the store's one stream of
   block events;
3. the lower tiers, opened and checked (:func:`kvpool.tiers.build.open_lower_tiers`: the
   disk's directory and files, the bucket's answer);
4. the data port and the admin port, bound (one in use refuses here);
5. the arena (mapped as it is; its format checked), then the journal (replayed, read
   only), whose replayed entries are sealed against the arena (in memory).

**Commit**, once every check has passed (the only writes of a start):

6. the directory (before anything writes the arena: readers of an earlier daemon's
   directory stop trusting it, kvpool.directory rule 3); the arena, the journal and the
   disk migrated to this release's formats and opened for writing (kvpool.formats); the
   object tier's threads and the write-back (:func:`kvpool.tiers.build.commit_lower_tiers`);
7. the lease ledger, the account ledger, the prefetch holds kept in both, and the block
   store, adopting what the journal describes;
8. the cluster agent (when ``--peers`` or ``--etcd``), the tier view (which prefetches from
   the other nodes through the agent), and the protocol server.

Nothing is served yet: :class:`~kvpool.node.daemon.Daemon` starts the server (its Unix
socket), the admin HTTP and the cluster agent, in that order.  If a step fails, what the
earlier steps opened is closed again (the arena and the journal are kept, as after a
crash).  What a failure after the commit leaves (the cluster agent's registration in etcd
refused) is the node's files in this release's formats, as a crash would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.config import NodeConfig
from kvpool.directory import DirectoryWriter
from kvpool.errors import ConfigError
from kvpool.node.sealing import seal_replayed
from kvpool.node.server import NodeServer, bind_tcp
from kvpool.node.services import StoreChanges
from kvpool.store.accounts import Accounts
from kvpool.store.arena import Arena, NodeDirLock
from kvpool.store.block import Block, StoreEvents
from kvpool.store.block_store import BlockStore
from kvpool.store.holds import Holds, QueueAwareEviction
from kvpool.store.journal import Journal
from kvpool.store.leases import LeaseLedger
from kvpool.store.policies import new_policy
from kvpool.store.retention import Retention
from kvpool.tenants import Registry
from kvpool.tiers.build import commit_lower_tiers, open_lower_tiers
from kvpool.tiers.chain import LowerTiers, Tiers
from kvpool.tiers.tier import RemoteSource
from kvpool.tls import CertFiles

if TYPE_CHECKING:
    from kvpool.node.events import KVEventPublisher
    from kvpool.node.kthena import KthenaSink
    from kvpool.node.peers import NodeAgent


@dataclass(frozen=True)
class Credentials:
    """What the node authenticates and encrypts with, read before anything starts (a bad
    tenants or certificate file stops the start): the tenants registry, the TLS files, and
    the configuration with the cluster's own identity (a tenants file's ``[cluster]``
    section) as the access id and key its own clients present."""

    config: NodeConfig
    tenants: Registry | None
    tls: CertFiles | None


def read_credentials(config: NodeConfig) -> Credentials:
    """Read the tenants file and the TLS files ``config`` names (see :class:`Credentials`)."""
    tenants = Registry(Path(config.tenants_path)) if config.tenants_path else None
    if tenants is not None:
        cluster = tenants.current.cluster
        if cluster is None and config.cluster.is_clustered:
            raise ConfigError(
                f"{config.tenants_path}: a cluster needs a [cluster] section (the identity "
                "nodes use between themselves)"
            )
        if cluster is not None:  # what this node's own clients (write-through) present
            config = dataclasses.replace(
                config, access_id=cluster.access_id, access_key=cluster.key
            )
    tls = config.tls
    files = CertFiles(tls.cert, tls.key, tls.client_ca) if tls.cert else None
    return Credentials(config, tenants, files)


@dataclass(frozen=True)
class Node:
    """Every part of a node, built and not yet started (see :class:`~kvpool.node.daemon.
    Daemon` for starting and stopping them)."""

    config: NodeConfig  # with the cluster's identity, when a tenants file gives one
    tls: CertFiles | None  # the data port's and the admin HTTP's (reloaded in place)
    tcp: socket.socket  # the data port's listener, bound (the server serves it)
    admin: socket.socket  # the admin HTTP's listener, bound
    lock: NodeDirLock
    arena: Arena
    directory: DirectoryWriter
    journal: Journal
    events: KVEventPublisher | None
    kthena: KthenaSink | None
    lower: LowerTiers
    store: BlockStore
    cluster: NodeAgent | None
    server: NodeServer


async def build_node(config: NodeConfig, on_shutdown: Callable[[bool], None] | None = None) -> Node:
    """Build every part of the node ``config`` describes (validated); ``on_shutdown`` is
    called when a client asks the node to stop (with ``drain``: to empty itself)."""
    credentials = read_credentials(config)
    config = credentials.config
    with contextlib.ExitStack() as undo:
        # Open and check: nothing of the node's files is written.
        lock = NodeDirLock(config.node_dir)
        undo.callback(lock.release)
        events = open_events(config, credentials.tenants)
        if events is not None:
            undo.callback(events.close)
        kthena = open_kthena(config)
        if kthena is not None:
            undo.callback(kthena.close)
        lower = await open_lower_tiers(config, events)
        undo.callback(lower.close)
        tcp = bind_tcp(config.host, config.port)
        undo.callback(tcp.close)
        admin = bind_tcp(config.admin_host, config.admin_port)
        undo.callback(admin.close)
        arena, journal = _open_arena_and_journal(config, lock, undo)
        # Commit: every check has passed.  Each file is migrated in place and opened for
        # writing now, so that a refusal leaves every file as it was (kvpool.formats).
        directory = DirectoryWriter(config.directory_path, arena.num_bytes, arena.arena_id)
        undo.callback(directory.close, remove=True)
        arena.commit()
        journal.commit()
        lower = await commit_lower_tiers(lower, arena)
        store, holds, changes = _block_store(
            config, arena, journal, lower, directory, _one_stream(events, kthena)
        )
        if not store.counters.adopted:  # whatever an earlier daemon announced is gone
            for sink in (events, kthena):
                if sink is not None:
                    sink.cleared()
        cluster = _cluster_agent(config, store, arena)
        remote = RemoteSource(cluster.fetch) if cluster is not None else None  # prefetch too
        tiers = Tiers(store, arena, lower, holds, remote)
        server = NodeServer(
            config,
            store,
            arena,
            tiers,
            changes,
            cluster,
            on_shutdown=on_shutdown,
            tenants=credentials.tenants,
            tls=credentials.tls,
            kthena=kthena,
            tcp=tcp,
        )
        undo.pop_all()
    return Node(
        config,
        credentials.tls,
        tcp,
        admin,
        lock,
        arena,
        directory,
        journal,
        events,
        kthena,
        lower,
        store,
        cluster,
        server,
    )


def _open_arena_and_journal(
    config: NodeConfig, lock: NodeDirLock, undo: contextlib.ExitStack
) -> tuple[Arena, Journal]:
    """The arena, mapped as it is (its format checked), then the journal, replayed read
    only, whose replayed entries are sealed against the arena in memory (step 5)."""
    arena = Arena(
        config.arena_path,
        config.memory_bytes,
        hugepages=config.hugepages,
        fresh=config.fresh,
        dir_fd=lock.fd,
    )
    undo.callback(arena.close)
    journal = Journal(
        config.journal_path,
        arena.dev,
        arena.ino,
        arena.num_bytes,
        fresh=config.fresh or not arena.is_kept,
        dir_fd=lock.fd,
        deferred=True,
    )
    undo.callback(journal.close)
    seal_replayed(journal.replayed, arena)
    return arena, journal


def _block_store(
    config: NodeConfig,
    arena: Arena,
    journal: Journal,
    lower: LowerTiers,
    directory: DirectoryWriter,
    events: StoreEvents | None,
) -> tuple[BlockStore, Holds, StoreChanges]:
    """The block store, adopting what the journal describes, with the ledgers it shares
    with the prefetch holds, and the stream of its changes (step 7)."""
    # One lease ledger for every hold: the store's reservations, pins and write areas,
    # and the prefetch holds.
    ledger = LeaseLedger(config.leases)
    # One account ledger for what each tenant holds of every shared resource: the
    # store's journal and labels, the holds, the tiers' prefetches, the connections.
    accounts = Accounts(config.budgets)
    holds = Holds(arena.num_bytes // 2, ledger, accounts)
    changes = StoreChanges()
    # Retention hints order blocks within the policy; queued requests' blocks stay.
    retention = Retention(new_policy(config.eviction))
    store = BlockStore(
        arena.num_bytes,
        eviction=QueueAwareEviction(retention, holds),
        retention=retention,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        ledger=ledger,
        journal=journal,
        spill=lower.writeback,
        directory=directory,
        events=events,
        on_change=changes.notify,
        accounts=accounts,
    )
    return store, holds, changes


def open_events(config: NodeConfig, tenants: Registry | None = None) -> KVEventPublisher | None:
    """The KV event publisher, bound to its endpoints (None without ``--kv-events``); with
    tenants, each block's events also go to its tenant's stream."""
    if not config.events.endpoint:
        return None
    from kvpool.node.events import KVEventPublisher  # imports zmq: only when publishing

    whose = tenants.tenant_name if tenants is not None else None
    return KVEventPublisher(config.events, whose)


def open_kthena(config: NodeConfig) -> KthenaSink | None:
    """Kthena's Redis entries for the engines that load from this node (None without
    ``--kthena-redis``)."""
    if not config.kthena.redis_url:
        return None
    from kvpool.node.kthena import KthenaSink  # imports redis: only when writing to it

    return KthenaSink(config.kthena, f"{config.host_id}/{config.name}")


class _Stream:
    """The store's one stream of block events, told to each of its sinks."""

    def __init__(self, sinks: list[StoreEvents]):
        self.sinks = sinks

    def stored(self, block: Block) -> None:
        for sink in self.sinks:
            sink.stored(block)

    def removed(self, block: Block) -> None:
        for sink in self.sinks:
            sink.removed(block)


def _one_stream(*sinks: StoreEvents | None) -> StoreEvents | None:
    present = [sink for sink in sinks if sink is not None]
    if len(present) > 1:
        return _Stream(present)
    return present[0] if present else None


def _cluster_agent(config: NodeConfig, store: BlockStore, arena: Arena) -> NodeAgent | None:
    if not config.cluster.is_clustered:
        return None
    from kvpool.node.peers import NodeAgent  # the client's code: only in a cluster

    return NodeAgent(config, store, arena)
