"""The object-store tier and prefetch, with real node daemons and a real S3 server.

Each node runs as its own process with its own host id, run directory and disk: two
simulated hosts, which reach each other's data only through the S3 bucket (clients use TCP,
never a shared arena).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool import Client
from kvpool.harness.process import NodeProcess
from kvpool.stats import TIER_DRAM, TIER_OBJECT
from tests.conftest import NodeFactory
from tests.helpers import content, key
from tests.nodes import own_node
from tests.s3server import S3Server

BLOCK = 256 << 10
MiB = 1 << 20


def serve_args(server: S3Server, bucket: str, disk: Path, host: str) -> list[str]:
    return [
        "--disk",
        str(disk),
        "--disk-size",
        "8MiB",
        "--object-store",
        f"s3://{bucket}/pool",
        "--object-store-endpoint",
        server.endpoint,
        "--object-refresh",
        "0.2",
        "--host-id",
        host,
    ]


def s3_env_of(server: S3Server) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": server.region,
    }


@pytest.fixture
def s3_env(s3_server: S3Server) -> dict[str, str]:
    return s3_env_of(s3_server)


def start_host(
    start_node: NodeFactory,
    s3_server: S3Server,
    bucket: str,
    env: dict[str, str],
    tmp_path: Path,
    name: str,
    memory: str = "8MiB",
) -> NodeProcess:
    """A node named ``name`` on a host of its own (an id no other test's node has)."""
    host = f"host-{name}-{secrets.token_hex(3)}"
    args = serve_args(s3_server, bucket, tmp_path / f"disk-{name}", host)
    return start_node(name, memory, extra=args, env=env)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def fill(client: Client, prefix: str, n: int) -> list[bytes]:
    keys = [key(f"{prefix}-{i}") for i in range(n)]
    for start in range(0, n, 8):
        batch = keys[start : start + 8]
        client.put(batch, [content(k, BLOCK) for k in batch])
    return keys


def written_to_bucket(node: NodeProcess, prefix_keys: list[bytes]) -> None:
    """Write enough behind ``prefix_keys`` that they leave DRAM and then the disk."""
    with Client(node.tcp_address, use_shm=False, timeout=10) as c:
        fill(c, "pushing", 120)  # 30 MiB through 8 MiB of DRAM and 8 MiB of disk
        wait_for(lambda: c.stats().tiers[2].writes >= len(prefix_keys))


@pytest.fixture(scope="module")
def written(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[bytes]]]:
    """A bucket, and the 12-block prefix a node on host A wrote that has left its DRAM and
    disk for it, the node then dead (SIGKILL).  The module's tests share it: each reads it
    from nodes of its own, on hosts of their own."""
    bucket = s3_server.make_bucket(f"kvpool-test-{secrets.token_hex(6)}")
    disk = tmp_path_factory.mktemp("host-a") / "disk"
    args = serve_args(s3_server, bucket, disk, "host-a")
    with own_node("a", "8MiB", extra=args, env=s3_env_of(s3_server)) as a:
        with Client(a.tcp_address, use_shm=False, timeout=10) as c:
            prefix = fill(c, "prefix", 12)
        written_to_bucket(a, prefix)
        a.kill()
    yield bucket, prefix


@pytest.fixture
def shared(
    start_node: NodeFactory,
    s3_server: S3Server,
    written: tuple[str, list[bytes]],
    s3_env: dict,
    tmp_path: Path,
) -> tuple[list[bytes], Callable[..., NodeProcess]]:
    """The prefix host A wrote to the bucket (``written``); a factory for nodes on other
    hosts."""
    bucket, prefix = written

    def other(name: str, memory: str = "8MiB") -> NodeProcess:
        return start_host(start_node, s3_server, bucket, s3_env, tmp_path, name, memory)

    return prefix, other


def test_another_host_reads_the_prefix_after_its_writer_died(shared: tuple) -> None:
    prefix, other = shared
    b = other("b")
    with Client(b.tcp_address, use_shm=False, timeout=10) as c:
        wait_for(lambda: c.lookup(prefix) == len(prefix))  # the first index refresh
        state = c.lookup_state(prefix)
        assert state.tiers == bytes([TIER_OBJECT]) * len(prefix)
        values = c.get(prefix).values
        for k, v in zip(prefix, values, strict=True):
            assert v is not None and np.array_equal(np.frombuffer(v, np.uint8), content(k, BLOCK))
        # Read once, the blocks are in B's DRAM.
        assert c.lookup_state(prefix).tiers == bytes([TIER_DRAM]) * len(prefix)
        objects = c.stats().tiers[2]
        assert objects.name == "object" and objects.promotions >= len(prefix)
        assert objects.corrupt == 0


def test_a_frozen_or_dead_object_store_only_makes_misses(
    shared: tuple, s3_server: S3Server
) -> None:
    prefix, other = shared
    b = other("b")
    with Client(b.tcp_address, use_shm=False, timeout=3.0) as c:
        wait_for(lambda: c.lookup(prefix) == len(prefix))
        for stall, resume in (
            (s3_server.freeze, s3_server.thaw),
            (s3_server.kill_gateway, s3_server.restart_gateway),
        ):
            stall()
            try:
                started = time.monotonic()
                assert c.lookup(prefix) == len(prefix)  # lookups never ask the store
                values = c.get(prefix[:4], timeout=3.0).values
                assert time.monotonic() - started < 3.0 + 0.5  # within the caller's deadline
                assert values == [None] * 4  # misses, never wrong bytes
                assert c.health().ok  # and the node serves on
                # Blocks still coming up (their read outlives the caller) are not "pending".
                state = c.lookup_state(prefix)
                assert state.num_prefix == len(prefix) and not state.is_next_pending
            finally:
                resume()
        values = c.get(prefix[:4], timeout=10).values
        for k, v in zip(prefix[:4], values, strict=True):
            assert v is not None and np.array_equal(np.frombuffer(v, np.uint8), content(k, BLOCK))


def test_prefetch_brings_blocks_up_and_holds_them_for_the_queue(shared: tuple) -> None:
    prefix, other = shared
    b = other("b", memory="8MiB")
    with Client(b.tcp_address, use_shm=False, timeout=10) as c:
        wait_for(lambda: c.lookup(prefix) == len(prefix))
        held, others = prefix[:8], prefix[8:]
        answer = c.prefetch(held, hold=60)
        assert answer.num_started == len(held) and answer.num_refused == 0
        wait_for(lambda: c.lookup_state(held).tiers == bytes([TIER_DRAM]) * len(held))
        again = c.prefetch(held, hold=60)  # a duplicate costs nothing: they are in DRAM
        assert again.num_in_dram == len(held) and again.num_started == 0
        # Other traffic fills B's DRAM several times over: the held blocks stay.
        fill(c, "traffic", 64)
        assert c.lookup_state(held).tiers == bytes([TIER_DRAM]) * len(held)
        assert c.stats().prefetch.held_blocks == len(held)
        c.get(held)  # the queued request runs
        stats = c.stats().prefetch
        assert stats.useful == len(held) and stats.held_blocks == 0
        # A prefetch of what is nowhere, and a cancelled one.
        assert c.prefetch([key("nowhere")]).num_absent == 1
        c.prefetch(others, hold=60)
        c.prefetch(others, cancel=True)
        wait_for(lambda: c.stats().prefetch.held_blocks == 0)
        assert c.stats().prefetch.completed >= len(held)


def test_a_lookup_with_prefetch_starts_the_promotion(shared: tuple) -> None:
    """The connector's hint: the lookup that finds the prefix in a lower tier also starts
    bringing it up, with no second round trip."""
    prefix, other = shared
    b = other("b")
    with Client(b.tcp_address, use_shm=False, timeout=10) as c:
        wait_for(lambda: c.lookup(prefix) == len(prefix))
        state = c.lookup_state(prefix, prefetch=30)
        assert TIER_OBJECT in state.tiers
        wait_for(lambda: c.lookup_state(prefix).tiers == bytes([TIER_DRAM]) * len(prefix))
        assert c.stats().prefetch.started >= len(prefix)


def test_object_store_flags_are_checked(tmp_path: Path) -> None:
    from kvpool.config import node_config_from
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --disk"):
        node_config_from({"object_store": "s3://bucket/p"}, environ={})
    with pytest.raises(ConfigError, match="s3://"):
        node_config_from(
            {"object_store": "gs://b", "disk_path": str(tmp_path), "disk_bytes": 8 * MiB},
            environ={},
        )
    assert os.environ.get("KVPOOL_OBJECT_STORE") is None


def test_object_tier_and_prefetch_are_visible(shared: tuple) -> None:
    """In `kvpool status`, /metrics and the dashboard (rendered by Chromium)."""
    import subprocess
    import sys
    import urllib.request

    from tests.node.test_dashboard import render

    prefix, other = shared
    b = other("b")
    with Client(b.tcp_address, use_shm=False, timeout=10) as c:
        wait_for(lambda: c.lookup(prefix) == len(prefix))
        c.prefetch(prefix[:5], hold=60)
        wait_for(lambda: c.stats().prefetch.completed == 5)
        c.get(prefix[:3])  # three of the five were worth it (so far)
    metrics = urllib.request.urlopen(b.admin_url + "/metrics", timeout=10).read().decode()
    assert 'kvpool_tier_hits_total{node="b",tier="object"}' in metrics
    assert 'kvpool_prefetch_completed_total{node="b"} 5.0' in metrics
    assert 'kvpool_prefetch_useful_total{node="b"} 3.0' in metrics
    assert 'kvpool_prefetch_held_blocks{node="b"} 2.0' in metrics
    status = subprocess.run(
        [str(Path(sys.executable).parent / "kvpool"), "status", "--address", b.tcp_address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert status.returncode == 0, status.stderr
    assert "prefetch" in status.stdout and "object" in status.stdout
    dom = render(b.admin_url + "/")
    assert '<tr class="tier-object"><td>object</td>' in dom
    assert '<td class="prefetch-useful">3</td>' in dom


def test_one_get_larger_than_dram_returns_every_block_from_the_object_store(
    start_node: NodeFactory, s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    """256 blocks of 1 MiB behind a 64 MiB arena and an 8 MiB disk, most of them in the
    bucket: one get of all of them returns all of them, verified, the blocks DRAM has no
    room for read from the object store straight into the reply (same host and TCP)."""
    node = start_host(start_node, s3_server, s3_bucket, s3_env, tmp_path, "huge", "64MiB")
    keys = [key(f"huge-{i}") for i in range(256)]
    with Client(node.tcp_address, use_shm=False, timeout=30) as c:
        for start in range(0, len(keys), 8):
            batch = keys[start : start + 8]
            assert c.put(batch, [content(k, MiB) for k in batch]).all_stored
            # The disk hands the bucket 4 segments at a time at most (past that it drops
            # them): let the uploads keep up, no more than DRAM's worth behind the writes.
            behind = start + len(batch) - 64
            wait_for(lambda behind=behind: c.stats().tiers[2].writes >= behind, timeout=60)
        wait_for(lambda: c.lookup(keys) == len(keys))
        state = c.lookup_state(keys)
        assert state.num_in(TIER_OBJECT) >= 128 and c.stats().tiers[2].dropped == 0
    for address, use_shm in ((node.unix_address, True), (node.tcp_address, False)):
        with Client(address, use_shm=use_shm, timeout=30) as reader:
            got = reader.get(keys)
            assert got.num_found == len(keys)
            for k, value in zip(keys, got.values, strict=True):
                assert value is not None
                assert np.array_equal(np.frombuffer(value, np.uint8), content(k, MiB))
    with Client(node.tcp_address, use_shm=False, timeout=10) as c:
        objects = c.stats().tiers[2]
    assert objects.served >= 128 and objects.corrupt == 0


def test_segments_the_object_store_drops_are_told_to_their_writer(
    start_node: NodeFactory, s3_server: S3Server, s3_bucket: str, s3_env: dict, tmp_path: Path
) -> None:
    """The fault's side: the S3 gateway frozen while a writer pushes blocks through DRAM
    and the disk, so that the disk's evicted segments find the object store's upload queue
    full and are dropped (their blocks gone).  The node logs each drop, counts the blocks
    (the object tier's ``dropped``, exported as ``kvpool_tier_dropped_total``), and the
    writer's PUT replies count them as not kept."""
    node = start_host(start_node, s3_server, s3_bucket, s3_env, tmp_path, "drops")
    not_kept = 0
    s3_server.freeze()
    try:
        with Client(node.tcp_address, use_shm=False, timeout=10) as c:
            keys = [key(f"drop-{i}") for i in range(160)]  # 40 MiB through 8 + 8 MiB
            for start in range(0, len(keys), 4):
                batch = keys[start : start + 4]
                not_kept += c.put(batch, [content(k, BLOCK) for k in batch]).num_not_kept
                time.sleep(0.02)
            wait_for(lambda: c.stats().tiers[2].dropped > 0)
            for _ in range(50):  # the last drops, told with the next put reply
                not_kept += c.put([key("after")], [content(key("after"), BLOCK)]).num_not_kept
                time.sleep(0.05)
            dropped = c.stats().tiers[2].dropped
    finally:
        s3_server.thaw()
    assert dropped > 0
    assert not_kept >= dropped, (not_kept, dropped)
    said = "".join(node.output)
    assert "object store: segment" in said and "dropped" in said, said[-3000:]
