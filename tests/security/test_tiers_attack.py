"""The tiers below DRAM under attack (issue 28, items 8 and 9, and the disk directory): real
daemons, real files.

- A DELETE lasts on every tier: a restarted node (even one killed) does not serve a
  deleted disk block again; another node does not read it from the object store; the home
  node that got a write-through copy drops it too.
- One daemon per disk directory: a second one, even with ``--fresh``, is refused and
  deletes nothing of the first's; a directory another user owns, or one others may write
  in, is refused; a new segment never replaces a file that is there.
"""

from __future__ import annotations

import os
import time

import pytest
import xxhash

from kvpool import Client
from kvpool.errors import ConfigError
from kvpool.stats import TIER_DISK
from kvpool.tiers.disk import DiskTier
from tests.commands import said, serve
from tests.helpers import content, key
from tests.tiered import BLOCK, disk_node, fill, wait_written


def fill_to_disk(client: Client, tag: str, num_blocks: int = 64) -> list[bytes]:
    """Put ``num_blocks`` blocks through an 8 MiB arena; the keys that ended up on disk only."""
    keys = fill(client, tag, num_blocks)
    wait_written(client, client.stats().evictions, timeout=30)
    tiers = client.lookup_state(keys).tiers
    return [k for k, t in zip(keys, tiers, strict=True) if t == TIER_DISK]


# -- deletes last ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["stop", "kill"])
def test_a_deleted_disk_block_is_not_served_after_a_restart(start_node, tmp_path, stop):
    disk = tmp_path / "disk"
    node = disk_node(start_node, disk)
    with Client(node.unix_address, timeout=10) as client:
        on_disk = fill_to_disk(client, "del")
        assert len(on_disk) >= 16
        deleted, kept = on_disk[:8], on_disk[8:12]
        assert all(s.name == "OK" for s in client.delete(deleted))
        assert client.get(deleted).num_found == 0
    getattr(node, stop)()
    again = disk_node(start_node, disk)
    with Client(again.unix_address, timeout=10) as client:
        assert client.get(deleted).num_found == 0, "a deleted block came back after a restart"
        assert not any(client.lookup_state(deleted).tiers)
        got = client.get(kept)  # the others are still there
        assert got.num_found == len(kept)
        assert all(
            bytes(v) == content(k, BLOCK).tobytes() for k, v in zip(kept, got.values, strict=True)
        )


# -- one daemon per disk directory ----------------------------------------------------------


def test_a_second_daemon_on_the_same_disk_directory_is_refused_and_deletes_nothing(
    start_node, tmp_path, run_dir
):
    disk = tmp_path / "disk"
    node = disk_node(start_node, disk)
    with Client(node.unix_address, timeout=10) as client:
        on_disk = fill_to_disk(client, "two")
        assert on_disk
        segments = sorted(p.name for p in disk.glob("seg-*.kvs"))
        for fresh in ([], ["--fresh"]):
            second = serve(
                run_dir,
                "--name",
                "intruder",
                "--disk",
                str(disk),
                "--disk-size",
                "64MiB",
                *fresh,
            )
            assert second.returncode != 0
            assert "another kvpool daemon uses the disk directory" in said(second)
            assert sorted(p.name for p in disk.glob("seg-*.kvs")) == segments
        got = client.get(on_disk[:8])
        assert got.num_found == len(on_disk[:8])
        assert all(
            bytes(v) == content(k, BLOCK).tobytes()
            for k, v in zip(on_disk[:8], got.values, strict=True)
        )


def test_a_disk_directory_others_may_write_in_or_own_is_refused(start_node, tmp_path, run_dir):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    refused = serve(run_dir, "--disk", str(shared), "--disk-size", "64MiB")
    assert refused.returncode != 0 and "may be written by its group or by others" in said(refused)
    assert not list(shared.iterdir())  # nothing written there
    if os.geteuid() == 0:  # a directory another user created first
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        refused = serve(run_dir, "--disk", str(theirs), "--disk-size", "64MiB")
        assert refused.returncode != 0 and "belongs to uid 65534" in said(refused)
    created = tmp_path / "new" / "disk"
    disk_node(start_node, created, name="created").stop()
    assert (created.stat().st_mode & 0o777) == 0o700


def test_a_new_segment_never_replaces_a_file_that_is_there(tmp_path):
    disk = DiskTier(tmp_path, 16 << 20, segment_bytes=4 << 20)
    data = memoryview(b"x" * (1 << 20))
    checksum = xxhash.xxh3_64_intdigest(data)
    disk.write([(key(f"a-{i}"), data, checksum) for i in range(3)])  # segment 1
    planted = tmp_path / "seg-00000002.kvs"
    planted.write_bytes(b"someone else's file")
    with pytest.raises(FileExistsError):
        disk.write([(key(f"b-{i}"), data, checksum) for i in range(3)])  # would open segment 2
    assert planted.read_bytes() == b"someone else's file"
    with pytest.raises(ConfigError, match="another kvpool daemon uses the disk directory"):
        DiskTier(tmp_path, 16 << 20, segment_bytes=4 << 20)


def test_a_tombstone_outlives_its_segment_while_the_block_it_hides_is_on_disk(tmp_path):
    disk = DiskTier(tmp_path, 16 << 20, segment_bytes=4 << 20)  # four segments
    data = memoryview(b"y" * (256 << 10))
    checksum = xxhash.xxh3_64_intdigest(data)
    first = [key(f"old-{i}") for i in range(16)]
    disk.write([(k, data, checksum) for k in first])  # segment 1 full, segment 2 open
    assert disk.location(first[0]).segment_id == 1 and disk.location(first[-1]).segment_id == 2
    assert disk.delete([first[0]]) == 1  # its tombstone goes into segment 2
    for n in range(6):  # segment 2 goes before segment 1, which reads keep recent
        for k in first[1:3]:
            disk.read_into(k, memoryview(bytearray(len(data))))
        disk.write([(key(f"new-{n}-{i}"), data, checksum) for i in range(12)])
    assert disk.location(first[1]) is not None and disk.location(first[1]).segment_id == 1
    assert not (tmp_path / "seg-00000002.kvs").exists()
    disk._dir_lock.release()  # a crash
    again = DiskTier(tmp_path, 16 << 20, segment_bytes=4 << 20)
    assert not again.contains([first[0]])[0], "a deleted block came back"
    assert again.contains([first[1]])[0]


# -- deletes reach the object store and the homes --------------------------------------------


@pytest.fixture
def s3_env(s3_server) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_REGION": s3_server.region,
    }


def test_a_deleted_block_is_not_read_from_the_object_store_by_another_node(
    start_node, s3_server, s3_bucket, s3_env, tmp_path
):
    from kvpool.stats import TIER_OBJECT
    from tests.node.test_object_tier import fill as fill_hosts
    from tests.node.test_object_tier import start_host, wait_for, written_to_bucket

    a = start_host(start_node, s3_server, s3_bucket, s3_env, tmp_path, "a")
    with Client(a.tcp_address, use_shm=False, timeout=10) as c:
        prefix = fill_hosts(c, "gone", 12)
    written_to_bucket(a, prefix)
    b = start_host(start_node, s3_server, s3_bucket, s3_env, tmp_path, "b")
    with Client(b.tcp_address, use_shm=False, timeout=10) as reader:
        wait_for(lambda: reader.lookup(prefix) == len(prefix))
        assert reader.lookup_state(prefix).tiers == bytes([TIER_OBJECT]) * len(prefix)
        with Client(a.tcp_address, use_shm=False, timeout=10) as writer:
            writer.delete(prefix[:6])
            assert writer.lookup(prefix) == 0  # the writer forgets them at once
        wait_for(lambda: reader.lookup(prefix) == 0)  # another node, after its refresh
        assert reader.get(prefix[:6]).num_found == 0, "another node read a deleted block"
        assert reader.get(prefix[6:]).num_found == 6  # the others are still there
    c = start_host(start_node, s3_server, s3_bucket, s3_env, tmp_path, "c")  # a new node
    with Client(c.tcp_address, use_shm=False, timeout=10) as late:
        wait_for(lambda: late.lookup(prefix[6:]) == 6)
        assert late.get(prefix[:6]).num_found == 0, "a node started later read a deleted block"


def test_a_delete_reaches_the_home_node_that_got_a_write_through_copy(start_node):
    from tests.cluster.fabric import free_port

    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    a, b = (
        start_node(name=name, extra=["--port", str(port), "--peers", peers])
        for name, port in zip(("home-a", "home-b"), ports, strict=True)
    )
    keys = [key(f"homed-{i}") for i in range(40)]
    with (
        Client(a.unix_address, timeout=10) as writer,
        Client(b.tcp_address, use_shm=False, timeout=10) as home,
    ):
        assert writer.put(keys, [content(k, 4096) for k in keys]).all_stored
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and home.get(keys).num_found < 10:
            time.sleep(0.02)
        at_b = [k for k, v in zip(keys, home.get(keys).values, strict=True) if v is not None]
        assert len(at_b) >= 10  # rendezvous puts about half of them at b
        writer.delete(keys)  # a client that knows only its local node
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and home.get(at_b).num_found:
            time.sleep(0.02)
        assert home.get(at_b).num_found == 0, "the home kept its write-through copies"


# -- quotas on the lower tiers -----------------------------------------------------------------


def test_a_tenant_churning_within_its_quota_never_evicts_anothers_disk_blocks(start_node, tmp_path):
    from tests.security.tenants import CLUSTER, TenantsFile, client

    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha", quota="4MiB")[0]
    beta = tenants.add("beta", quota="4MiB")[0]
    tenants.write()
    node = start_node(
        name="shares",
        memory="12MiB",
        extra=["--tenants", str(tenants.path), "--disk", str(tmp_path / "disk"),
               "--disk-size", "32MiB"],  # 16 MiB each: the quotas' shares
    )  # fmt: skip

    def on_disk(pool: Client, keys: list[bytes]) -> list[bytes]:
        return [k for k in keys if pool.lookup_state([k]).tiers == bytes([TIER_DISK])]

    with client(node.tcp_address, beta) as victim, client(node.tcp_address, alpha) as churner:
        held = fill(victim, "beta", 40, pause=0.02)  # 10 MiB past a 4 MiB quota: ~6 MiB to disk
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(on_disk(victim, held)) < 16:
            time.sleep(0.02)
        before = on_disk(victim, held)
        assert len(before) >= 16
        churned = fill(churner, "alpha", 240, pause=0.02)  # 60 MiB through alpha's 4 MiB quota
        with client(node.tcp_address, CLUSTER) as operator:  # the whole node's counts
            wait_written(operator, operator.stats().evictions, timeout=30)  # the write-back
        after = on_disk(victim, before)
        assert len(after) == len(before), (
            f"alpha's churn evicted beta's disk blocks: {len(before)} -> {len(after)}"
        )
        got = victim.get(after[:8])
        assert got.num_found == 8
        assert all(
            bytes(v) == content(k, BLOCK).tobytes()
            for k, v in zip(after[:8], got.values, strict=True)
        )
        assert len(on_disk(churner, churned)) >= 16  # alpha's use the rest of the disk


def test_a_tenant_past_its_share_of_the_bucket_loses_its_own_packs_never_anothers(
    s3_server, s3_bucket, s3_env, tmp_path, monkeypatch
):
    from kvpool.store.accounts import Accounts, Resource
    from kvpool.tenants import Tenant
    from kvpool.tiers.objects import ObjectTier
    from tests.tiers.test_objects import config, wait_for

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    tenants = [Tenant("alpha", b"salt-alpha-0123456789", 1), Tenant("beta", b"salt-beta-0123", 1)]
    alpha, beta = (t.tag for t in tenants)  # tenants' tags lead their keys

    def tenant_blocks(tag: bytes, n: int, seed: int):
        return [(tag + b"ns" * 6 + f"{seed}-{i}".encode(), os.urandom(BLOCK)) for i in range(n)]

    def write(disk: DiskTier, items) -> None:
        disk.write([(k, memoryview(v), xxhash.xxh3_64_intdigest(v)) for k, v in items])

    MiB = 1 << 20
    bucket = ObjectTier(config(s3_server, s3_bucket, capacity=16 * MiB), tmp_path / "out", "a")
    disk = DiskTier(tmp_path / "disk", 8 * MiB, segment_bytes=4 * MiB, below=bucket)
    accounts = Accounts()  # equal quotas: half of each tier each, 4 MiB and 8 MiB
    shares = {disk.resource: disk.capacity, bucket.resource: bucket.capacity}
    accounts.set_tenants(tenants, held_bytes=0, prefetch_bytes=0, tier_bytes=shares)
    assert accounts.limit(alpha, Resource.DISK_BYTES) == 4 * MiB
    assert accounts.limit(beta, Resource.OBJECT_BYTES) == 8 * MiB
    disk.recount_quotas(accounts)  # what Tiers.recount_quotas has them do
    bucket.recount_quotas(accounts)
    bucket.start()
    try:
        held = []
        for seed in range(3):  # beta: two segments reach the bucket (within its share)
            items = tenant_blocks(beta, 14, seed)
            held += [k for k, _ in items]
            write(disk, items)
            wait_for(lambda: not bucket._queue)
        wait_for(lambda: bucket.counters.uploads >= 2)
        bucket.refresh()
        in_bucket = [k for k in held if bucket.contains([k])[0]]
        assert len(in_bucket) >= 28
        for seed in range(10, 18):  # alpha churns seven segments into the bucket
            write(disk, tenant_blocks(alpha, 14, seed))
            wait_for(lambda: not bucket._queue)
        wait_for(lambda: bucket.counters.uploads + bucket.counters.dropped_segments >= 9)
        bucket.refresh()
        assert bucket.counters.deleted_packs >= 1 and bucket.used_bytes <= 16 * MiB
        assert all(bucket.contains(in_bucket)), "alpha's churn evicted beta's packs"
    finally:
        bucket.close()
        disk.close()


def test_a_block_deleted_on_its_way_to_disk_does_not_land_there(tmp_path):
    from kvpool.store.arena import Arena
    from kvpool.store.block import Block, BlockState
    from kvpool.tiers.admission import AdmitAll
    from kvpool.tiers.writeback import WriteBack

    arena = Arena(tmp_path / "arena", 4 << 20)
    disk = DiskTier(tmp_path / "disk", 16 << 20, segment_bytes=4 << 20)
    writeback = WriteBack(disk, arena, AdmitAll())
    writeback.start()
    blocks = []
    for i in range(2):
        data = bytes([i + 1]) * 4096
        arena.slice(i * 4096, 4096)[:] = data
        checksum = xxhash.xxh3_64_intdigest(data)
        blocks.append(Block(key(f"wb-{i}"), i * 4096, 4096, BlockState.COMMITTED, checksum))
    try:
        with disk._writer:  # the disk is busy: the write-back's writer waits on it
            assert writeback.offer(blocks[0])
            deadline = time.monotonic() + 10
            while writeback._queue:  # until the writer took the first (and waits on the disk)
                assert time.monotonic() < deadline, "the write-back never took the first block"
                time.sleep(0.01)
            assert writeback.offer(blocks[1])  # the second stays queued
            writeback.discard([blocks[1].key])  # a DELETE of it
    finally:
        writeback.stop()
    assert disk.contains([blocks[0].key, blocks[1].key]) == [True, False]
    disk.close()
    arena.close(remove=True)


# -- reads larger than DRAM: the staging memory ----------------------------------------------


def test_a_tenant_that_never_reads_its_gets_holds_only_its_share_of_the_stages(
    start_node, tmp_path
):
    """From the attacker's side: tenant alpha (4 MiB quota) opens 18 GETs of its own blocks
    on disk (each more than a stage) and stops reading their replies (a proxy that holds
    them, as a client that stops reading).  Beta's read of 16 of its own disk blocks gets
    all 16 meanwhile (before the fix: 8, alpha's stalled replies held the node's whole
    staging budget); alpha holds at most its share of the stages, and its stalled replies
    give them back within their send bound (their connections closed)."""
    import threading

    from kvpool.store.accounts import MIN_STAGED_SHARE
    from kvpool.tiers.chain import MAX_STAGED_BYTES, STAGE_SEND_S
    from tests.proxy import GateProxy
    from tests.security.tenants import CLUSTER, TenantsFile, client

    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha", quota="4MiB")[0]
    beta = tenants.add("beta", quota="12MiB")[0]
    tenants.write()
    node = start_node(
        name="stages",
        memory="32MiB",
        extra=["--tenants", str(tenants.path), "--disk", str(tmp_path / "disk"),
               "--disk-size", "256MiB", "--scrub-rate", "0"],
    )  # fmt: skip
    size = 1 << 20
    with client(node.tcp_address, alpha) as a, client(node.tcp_address, beta) as b:
        alpha_keys = fill(a, "alpha-stage", 48, size=size, pause=0.02)
        beta_keys = fill(b, "beta-stage", 32, size=size, pause=0.02)
        with client(node.tcp_address, CLUSTER) as operator:
            wait_written(operator, operator.stats().evictions, timeout=30)
        alpha_below = [k for k in alpha_keys if a.lookup_state([k]).tiers == bytes([TIER_DISK])]
        beta_below = [k for k in beta_keys if b.lookup_state([k]).tiers == bytes([TIER_DISK])]
    assert len(alpha_below) >= 20 and len(beta_below) >= 16

    proxy = GateProxy(int(node.tcp_address.rsplit(":", 1)[1]))
    stalled = [client(f"127.0.0.1:{proxy.port}", alpha) for _ in range(18)]
    outcomes: list[object] = []
    try:
        for c in stalled:
            c.health()  # connected and authenticated before the replies are held
        proxy.hold_replies()

        def read_and_stall(c) -> None:
            try:
                outcomes.append(c.get(alpha_below[:20]).num_found)
            except Exception as exc:  # closed by the node: what a stalled reader gets
                outcomes.append(exc)

        threads = [threading.Thread(target=read_and_stall, args=(c,)) for c in stalled]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # the node has begun to answer every one of them
        with client(node.tcp_address, beta) as b, client(node.tcp_address, CLUSTER) as op:
            got = b.get(beta_below[:16])
            assert got.num_found == 16, f"beta got {got.num_found} of 16 of its blocks"
            for k, v in zip(beta_below[:16], got.values, strict=True):
                assert bytes(v) == content(k, size).tobytes()
            usage = {row.tenant: row.used for row in op.stats().accounts}
            assert usage["alpha"]["staged_bytes"] <= max(
                MIN_STAGED_SHARE, MAX_STAGED_BYTES * 4 // 16
            ), usage["alpha"]
            deadline = time.monotonic() + STAGE_SEND_S + 10
            while usage["alpha"]["staged_bytes"] and time.monotonic() < deadline:
                time.sleep(0.2)
                usage = {row.tenant: row.used for row in op.stats().accounts}
            assert usage["alpha"]["staged_bytes"] == 0, "a stalled reader kept its stage"
    finally:
        proxy.release()
        for thread in threads:
            thread.join(30)
        for c in stalled:
            c.close()
        proxy.close()
