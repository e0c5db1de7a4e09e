"""The local disk tier with a real daemon and real files: write-back on eviction, reads
from disk, a host that lost /dev/shm, corrupted and truncated segments, a full disk."""

import json
import os
import random
import urllib.request

import numpy as np
import pytest

from kvpool import Client, Status
from kvpool.stats import TIER_DISK, TIER_DRAM
from tests.commands import run_kvpool
from tests.helpers import content, key
from tests.tiered import BLOCK, check_all, disk_node, fill, tier, wait_written


@pytest.fixture
def disk_dir(tmp_path):
    return tmp_path / "disk"


def test_a_working_set_larger_than_dram_is_served_from_disk(start_node, disk_dir):
    node = disk_node(start_node, disk_dir)
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "ws", 96)  # 24 MiB through an 8 MiB arena
        stats = client.stats()
        assert stats.evictions > 40
        disk = wait_written(client, stats.evictions)
        assert disk.writes >= 0.9 * stats.evictions and disk.num_blocks == disk.writes
        state = client.lookup_state(keys)
        assert state.num_prefix == len(keys)  # every block is somewhere: DRAM or disk
        assert state.num_in(TIER_DISK) >= 40 and state.num_in(TIER_DRAM) > 0
        assert state.tiers[0] == TIER_DISK and state.tiers[-1] == TIER_DRAM  # oldest below
        assert check_all(client, keys[:30]) == 30  # read back from disk, promoted into DRAM
        assert tier(client.stats(), "disk").promotions >= 30
        with Client(node.tcp_address, use_shm=False, timeout=10) as remote:
            assert check_all(remote, keys[30:60]) == 30  # over TCP too
        with client.acquire(keys[60:70]) as lease:  # zero-copy leases promote first as well
            assert lease.num_prefix == 10
            assert all(
                bytes(v) == content(k, BLOCK).tobytes()
                for k, v in zip(keys[60:70], lease.views, strict=True)
            )


def test_a_host_that_lost_dev_shm_finds_its_disk_blocks(start_node, disk_dir):
    node = disk_node(start_node, disk_dir, name="reboot")
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "rb", 64)
        wait_written(client, client.stats().evictions)
        on_disk = [
            k for k, t in zip(keys, client.lookup_state(keys).tiers, strict=True) if t == TIER_DISK
        ]
    assert len(on_disk) >= 20
    node.stop()
    arena = node.info["arena"]
    os.unlink(arena)  # a reboot: /dev/shm is empty, the disk is not
    os.unlink(os.path.join(os.path.dirname(arena), "index"))
    again = disk_node(start_node, disk_dir, name="reboot")
    assert again.info["adopted_blocks"] == 0 and again.info["disk_blocks"] >= len(on_disk)
    with Client(again.unix_address, timeout=10) as client:
        assert client.lookup(on_disk) == len(on_disk)
        assert check_all(client, on_disk) == len(on_disk)
        assert tier(client.stats(), "disk").recovered >= len(on_disk)


def test_garbled_and_truncated_segments_are_detected_never_served(start_node, disk_dir):
    node = disk_node(start_node, disk_dir, name="garble")
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "gb", 64)
        wait_written(client, client.stats().evictions)
    node.stop()
    segments = sorted(disk_dir.glob("seg-*.kvs"))
    assert segments
    rng = random.Random(3)
    for segment in segments:
        size = segment.stat().st_size
        with open(segment, "r+b") as f:
            for _ in range(200):  # flip bytes all over, headers and payloads alike
                f.seek(rng.randrange(size))
                f.write(bytes([rng.randrange(256)]))
    with open(segments[-1], "r+b") as f:
        f.truncate(segments[-1].stat().st_size // 2)
    again = disk_node(start_node, disk_dir, name="garble")
    with Client(again.unix_address, timeout=10) as client:
        check_all(client, keys)  # asserts every block served is exactly right
        stats = tier(client.stats(), "disk")
        assert stats.corrupt > 0  # found out at read time, counted, dropped


def test_a_full_disk_evicts_its_least_recently_used_blocks(start_node, disk_dir):
    node = disk_node(start_node, disk_dir, name="full", disk="16MiB")
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "fd", 160)  # 40 MiB through 8 MiB of DRAM and 16 MiB of disk
        disk = wait_written(client, client.stats().evictions)
        assert disk.evictions > 0 and disk.used_bytes <= 16 << 20
        total = sum(f.stat().st_size for f in disk_dir.glob("seg-*.kvs"))
        assert total <= 16 << 20
        assert check_all(client, keys[-40:]) >= 36  # the newest are kept
        assert check_all(client, keys[:10]) < 10  # the oldest went


def test_tiers_show_in_status_metrics_and_drain_empties_the_disk(start_node, disk_dir):
    node = disk_node(start_node, disk_dir, name="seen")
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "st", 64)
        wait_written(client, client.stats().evictions)
        check_all(client, keys[-16:])  # reads: accesses the curve is made of
    status = run_kvpool("status", "--address", node.unix_address, "--json")
    (row,) = json.loads(status.stdout)["nodes"]
    tiers = {t["name"]: t for t in row["tiers"]}
    assert tiers["disk"]["num_blocks"] > 0 and tiers["dram"]["capacity_bytes"] == 8 << 20
    # What more memory would buy, per tier: a hit rate at each scale of its capacity, never
    # less with more.
    for name in ("dram", "disk"):
        estimates = tiers[name]["estimates"]
        assert [e["scale"] for e in estimates] == [0.5, 1.0, 2.0, 4.0], tiers[name]
        rates = [e["hit_rate"] for e in estimates]
        assert rates == sorted(rates) and rates[0] >= 0 and rates[-1] <= 1
    table = run_kvpool("status", "--address", node.unix_address).stdout
    assert "tiers" in table and "disk" in table and "promotions" in table
    assert "what more memory would buy" in table
    with urllib.request.urlopen(node.admin_url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvpool_tier_blocks{node="seen",tier="disk"}' in metrics
    assert 'kvpool_tier_writes_total{node="seen",tier="disk"}' in metrics
    assert 'kvpool_tier_estimated_hit_rate{node="seen",scale="4",tier="disk"}' in metrics
    drained = run_kvpool("drain", "--address", node.unix_address)
    assert drained.returncode == 0, drained.stderr
    assert node.proc.wait(30) == 0
    assert not list(disk_dir.glob("seg-*.kvs"))
    again = disk_node(start_node, disk_dir, name="seen")
    assert again.info["disk_blocks"] == 0 and again.info["adopted_blocks"] == 0
    with Client(again.unix_address) as client:
        assert client.get([key("st-0")]).statuses == [Status.NOT_FOUND]


MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_one_get_larger_than_dram_returns_every_block_from_disk(start_node, disk_dir, transport):
    """256 blocks of 1 MiB behind a 64 MiB arena: one get of all of them returns all of
    them, verified.  DRAM takes what it has room for; the rest is read from disk straight
    into the reply (same host: the pin says which, and a GET on the socket brings them)."""
    node = disk_node(start_node, disk_dir, name="big", memory="64MiB", disk="1GiB")
    with Client(node.unix_address, timeout=30) as client:
        keys = fill(client, "big", 256, size=MiB)
        wait_written(client, client.stats().evictions)
        assert client.lookup(keys) == 256
        address = node.unix_address if transport == "shm" else node.tcp_address
    with Client(address, use_shm=transport == "shm", timeout=30) as reader:
        got = reader.get(keys)
        assert got.num_found == 256
        for k, value in zip(keys, got.values, strict=True):
            assert value is not None and bytes(value) == content(k, MiB).tobytes()
        buffers = [np.empty(MiB, np.uint8) for _ in keys]  # into the caller's buffers too
        assert reader.get(keys, buffers, prefix=True).num_prefix == 256
        assert all(np.array_equal(b, content(k, MiB)) for k, b in zip(keys, buffers, strict=True))
        disk = tier(reader.stats(), "disk")
        assert disk.served >= 256 - 64 and disk.corrupt == 0


def test_a_footer_that_claims_more_than_was_written_costs_a_start_nothing(start_node, disk_dir):
    """From a writer of the disk directory's side (a stray tool, a damaged file system): a
    sparse 1 GiB segment file, 4 KiB on disk, whose trailer says its footer spans it all.
    The daemon's peak memory at start stays near an empty node's (before the fix: 1,103
    MiB, the claimed footer read whole), the blocks really written are found, and the
    planted segment is not."""
    from kvpool.formats import DISK_SEGMENT, pack_stamp
    from kvpool.tiers.disk import FOOTER_MAGIC, SEGMENT_MAGIC, TRAILER

    node = disk_node(start_node, disk_dir, name="footer")
    with Client(node.unix_address, timeout=10) as client:
        keys = fill(client, "ft", 64)
        wait_written(client, client.stats().evictions)
        on_disk = [
            k for k, t in zip(keys, client.lookup_state(keys).tiers, strict=True) if t == TIER_DISK
        ]
    node.stop()
    assert on_disk
    planted = disk_dir / "seg-90000000.kvs"
    size = 1 << 30
    with open(planted, "wb") as f:
        f.write(pack_stamp(SEGMENT_MAGIC, DISK_SEGMENT.version))
        f.seek(size - TRAILER.size)
        f.write(TRAILER.pack(FOOTER_MAGIC, 4096, 12345))
    assert os.stat(planted).st_blocks * 512 <= 64 << 10  # sparse: a few KiB really written
    again = disk_node(start_node, disk_dir, name="footer")
    with open(f"/proc/{again.pid}/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    assert peak_kib < 400 << 10, f"peak RSS at start {peak_kib >> 10} MiB"
    with Client(again.unix_address, timeout=10) as client:
        assert client.lookup(on_disk) == len(on_disk)
        assert check_all(client, on_disk) == len(on_disk)
