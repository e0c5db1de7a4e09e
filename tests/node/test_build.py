"""The assembly root: every part built with its collaborators, and a start that fails half
way releases what it took (the node directory's lock first)."""

import asyncio
from pathlib import Path

import pytest

from kvpool.config import ClusterConfig, DiskConfig, EventsConfig, KthenaConfig, NodeConfig
from kvpool.errors import ConfigError
from kvpool.node.build import Node, build_node

MiB = 1 << 20


def node_config(run_dir: Path, **sections: object) -> NodeConfig:
    return NodeConfig(
        name="built",
        run_dir=str(run_dir),
        memory_bytes=8 * MiB,
        port=0,  # a start binds its ports: any free ones
        admin_port=0,
        **sections,  # type: ignore[arg-type]
    )


def close(node: Node) -> None:
    node.tcp.close()
    node.admin.close()
    node.lower.close()
    for sink in (node.events, node.kthena):
        if sink is not None:
            sink.close()
    node.directory.close(remove=True)
    node.journal.close()
    node.arena.close()
    node.lock.release()


def test_the_parts_are_handed_their_collaborators(run_dir: Path) -> None:
    config = node_config(
        run_dir,
        disk=DiskConfig(str(run_dir / "disk"), 8 * MiB),
        events=EventsConfig("tcp://127.0.0.1:*"),
        cluster=ClusterConfig(peers=("127.0.0.1:1", "127.0.0.1:2")),
    )

    async def build() -> Node:
        return await build_node(config.validate())

    node = asyncio.run(build())
    try:
        assert node.store.events is node.events and node.events is not None
        assert node.store.spill is node.lower.writeback and node.lower.writeback is not None
        assert node.lower.disk is not None and node.lower.disk._events is node.events
        assert node.lower.disk._below is None  # no object store below it
        assert node.lower.chain == [node.lower.disk]
        tiers = node.server.tiers
        assert tiers.lower is node.lower
        # One lease ledger: the store's leases and the prefetch holds.
        assert tiers.holds.ledger is node.store.ledger
        assert node.store.on_change == node.server.changes.notify
        assert node.cluster is not None and tiers.remote is not None
        assert tiers.remote._fetch == node.cluster.fetch
        assert node.server.cluster is node.cluster and node.server.store is node.store
    finally:
        close(node)


def test_the_stores_events_go_to_every_sink(run_dir: Path) -> None:
    """The ZMQ publisher and Kthena's Redis entries are two sinks of one stream; the
    sessions are handed the engines table (nothing is sent to Redis to build them)."""
    config = node_config(
        run_dir,
        events=EventsConfig("tcp://127.0.0.1:*"),
        kthena=KthenaConfig("redis://127.0.0.1:1/0"),
    )
    node = asyncio.run(build_node(config.validate()))
    try:
        assert node.events is not None and node.kthena is not None
        assert node.store.events is not None
        assert node.store.events.sinks == [node.events, node.kthena]  # type: ignore[attr-defined]
        assert node.server.services.attach_engine == node.kthena.attach
    finally:
        close(node)


def test_a_node_alone_in_memory_has_no_lower_tiers_events_or_cluster(run_dir: Path) -> None:
    node = asyncio.run(build_node(node_config(run_dir).validate()))
    try:
        assert node.lower.disk is None and node.lower.writeback is None
        assert node.events is None and node.store.events is None and node.kthena is None
        assert node.cluster is None and node.server.tiers.remote is None
    finally:
        close(node)


def test_a_build_that_fails_half_way_releases_the_node_directory(run_dir: Path) -> None:
    # The events endpoint cannot be bound: the arena, journal and lock taken before it
    # are let go, and the next build of the same node succeeds.
    bad = node_config(run_dir, events=EventsConfig("nonsense://here"))
    with pytest.raises(ConfigError, match="KV events"):
        asyncio.run(build_node(bad.validate()))
    node = asyncio.run(build_node(node_config(run_dir).validate()))
    close(node)
