"""A burst larger than DRAM is kept when the disk has room (issue 29, point 6): a real
daemon with a small arena and a disk tier, 1 MiB blocks put 16 at a time as fast as the SDK
goes; the writers are slowed while the disk's write-back catches up instead of the evicted
blocks being refused.  Then SIGKILL and a wiped run directory: the disk alone serves them."""

import asyncio
import shutil
import threading
import time

from kvpool import Client
from kvpool.store.arena import Arena
from kvpool.store.block import Block, BlockState
from kvpool.tiers.admission import PRESSURE_FILL, AdmitAll
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.writeback import WriteBack
from tests.helpers import content, key
from tests.tiered import check_all, disk_node, tier, wait_written

BLOCK = 1 << 20
BATCH = 16
NUM_BLOCKS = 96  # 96 MiB through a 16 MiB arena


def wait_idle(client, timeout=60):
    """Until the disk's write-back is done: what it wrote or turned away stops changing
    (blocks promoted from disk and evicted again are not written twice, nor counted; where
    nothing was read, :func:`tests.tiered.wait_written` knows exactly when it is done)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        disk = tier(client.stats(), "disk")
        now = (disk.writes, disk.dropped, disk.refused)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return last
        time.sleep(0.05)
    return last


def test_a_burst_larger_than_dram_is_kept_on_disk_also_after_sigkill(start_node, run_dir, tmp_path):
    disk_dir = tmp_path / "disk"
    node = disk_node(start_node, disk_dir, name="burst", memory="16MiB", disk="512MiB")
    keys = [key(f"burst-{i}") for i in range(NUM_BLOCKS)]
    values = {k: content(k, BLOCK) for k in keys}
    with Client(node.unix_address, timeout=30) as client:
        for start in range(0, NUM_BLOCKS, BATCH):
            batch = keys[start : start + BATCH]
            client.put(batch, [values[k] for k in batch])
        wait_written(client, client.stats().evictions, timeout=60)  # nothing read yet
        kept = check_all(client, keys, BLOCK)
        wait_idle(client)  # the reads promoted blocks: what they evicted goes to disk too
    assert kept >= 0.94 * NUM_BLOCKS, f"{kept} of {NUM_BLOCKS} kept"

    node.kill()
    shutil.rmtree(run_dir)  # a reboot: /dev/shm is empty, the disk is not
    run_dir.mkdir(mode=0o770)
    again = disk_node(start_node, disk_dir, name="burst", memory="16MiB", disk="512MiB")
    with Client(again.unix_address, timeout=30) as client:
        after = check_all(client, keys, BLOCK)
    assert after >= 0.94 * NUM_BLOCKS, f"{after} of {NUM_BLOCKS} kept after SIGKILL"


def not_kept(client):
    """What the node's stats say it did not keep: evicted blocks the disk's write-back
    refused or dropped."""
    disk = tier(client.stats(), "disk")
    return disk.refused + disk.dropped


def put_in_place(client, keys, values):
    """A zero-copy write: views filled in place and committed without checksums, so the node
    hashes the blocks after its reply (their publish then evicts, behind the writer); the
    lookup waits for that seal, so the connection's next put reply carries what it lost."""
    transaction = client.begin_write(keys, [BLOCK] * len(keys))
    for view, value in zip(transaction.views, values, strict=True):
        view[:] = value.tobytes()
    result = transaction.commit()
    assert client.lookup(keys) == len(keys)
    return result


def test_the_writer_is_told_how_many_blocks_its_puts_evictions_lost(start_node, tmp_path):
    """Puts whose evictions the disk takes report 0; puts larger than the write-back's
    pressure point (each evicts more than the staging queue admits at once) report what the
    write-back turned away, over every write path (RESERVE/COMMIT in the arena, a zero-copy
    commit the node seals after its reply, a TCP PUT), and the sum the writers were told is
    what the node counted."""
    node = disk_node(start_node, tmp_path / "disk", name="told", memory="128MiB", disk="512MiB")
    keys = [key(f"told-{i}") for i in range(384)]
    with (
        Client(node.unix_address, timeout=30) as local,
        Client(node.tcp_address, use_shm=False, timeout=30) as remote,
    ):
        calm = []  # 128 blocks, 8 at a time, the write-back idle before each put
        for start in range(0, 128, 8):
            batch = keys[start : start + 8]
            calm.append(local.put(batch, [content(k, BLOCK) for k in batch]))
            wait_written(local, local.stats().evictions, timeout=60)  # nothing is read here
        assert all(r.all_stored for r in calm)
        assert local.stats().evictions > 0  # the watermark evicted, and the disk took them
        assert [r.num_not_kept for r in calm] == [0] * len(calm)
        assert not_kept(local) == 0

        told = 0
        for i, start in enumerate(range(128, 384, 64)):  # 64 MiB a put, as fast as they go
            batch = keys[start : start + 64]
            values = [content(k, BLOCK) for k in batch]
            if i == 1:
                result = remote.put(batch, values)  # a PUT, over TCP
            elif i == 2:
                result = put_in_place(local, batch, values)
            else:
                result = local.put(batch, values)  # RESERVE or AREA, then COMMIT
            assert result.all_stored
            told += result.num_not_kept
        wait_written(local, local.stats().evictions, timeout=60)
        counted = not_kept(local)
    assert counted > 0  # the burst lost blocks: the write-back turned some away
    assert told == counted, f"writers told of {told} lost blocks, the node counted {counted}"


def test_a_writer_is_held_while_the_disk_is_behind_and_counted(tmp_path):
    """The backpressure itself, with a disk made busy on demand (its writer lock held, as
    the daemon's own write-back would find it behind a slow device; a disk that is slow
    when a test needs it cannot be had here): a write that would evict more than the staging
    queue has room for waits until the disk catches up, or until its deadline, and each
    wait is counted (``slowed`` in stats and metrics); with the disk idle, nobody waits."""
    arena = Arena(tmp_path / "arena", 4 << 20)
    disk = DiskTier(tmp_path / "disk", 256 << 20, segment_bytes=16 << 20)
    writeback = WriteBack(disk, arena, AdmitAll())
    writeback.start()
    block_bytes = 1 << 20
    half = int(PRESSURE_FILL * writeback.budget_bytes)

    def offer(i: int) -> None:
        assert writeback.offer(Block(key(f"held-{i}"), 0, block_bytes, BlockState.COMMITTED, 1))

    async def wait(timeout: float) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await writeback.wait_for_room(half, started + timeout)
        return loop.time() - started

    try:
        assert asyncio.run(wait(5.0)) < 0.5 and writeback.num_waits == 0  # idle: no wait
        with disk._writer:  # the disk is busy: what is offered stays staged
            for i in range(half // block_bytes + 1):
                offer(i)
            assert not writeback.has_room(half)
            waited = asyncio.run(wait(0.3))  # up to the writer's deadline, not past it
            assert 0.3 <= waited < 2.0 and writeback.num_waits == 1
            threading.Timer(0.3, disk._writer.release).start()  # the disk catches up
            waited = asyncio.run(wait(30.0))
            disk._writer.acquire()  # (the with block releases it again)
        assert 0.2 <= waited < 20.0 and writeback.num_waits == 2
        assert writeback.num_not_kept == 0
    finally:
        writeback.stop()
        disk.close()
        arena.close(remove=True)
