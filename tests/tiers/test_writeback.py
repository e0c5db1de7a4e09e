"""The write-back and a DELETE that races it (issue 43): a block already on its way to disk
when it is deleted never lands there after the delete, nor comes back after a restart."""

from __future__ import annotations

import threading
from typing import Any

import xxhash

from kvpool.store.arena import Arena
from kvpool.store.block import Block
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.writeback import WriteBack
from tests.helpers import key

DISK_BYTES = 16 << 20
SEGMENT_BYTES = 4 << 20


class PausedDisk(DiskTier):
    """A real disk tier whose ``write`` waits, before it starts, until the test lets it go:
    the write-back's thread taken off the CPU right after it took its batch from the queue.
    (A stand-in for the scheduler, the one thing a test cannot otherwise arrange: the
    window is a few microseconds wide.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.go = threading.Event()

    def write(self, *args: Any, **kwargs: Any) -> int:
        self.entered.set()
        assert self.go.wait(10)
        return super().write(*args, **kwargs)


def test_a_delete_racing_a_batch_already_taken_is_not_undone(tmp_path):
    arena = Arena(tmp_path / "arena", 4 << 20)
    disk = PausedDisk(tmp_path / "disk", DISK_BYTES, segment_bytes=SEGMENT_BYTES)
    writeback = WriteBack(disk, arena)
    writeback.start()
    raced, kept = key("raced"), key("kept")
    for offset, k in ((0, raced), (4096, kept)):
        data = bytes([offset >> 12]) * 4096
        arena.slice(offset, 4096)[:] = data
        assert writeback.offer(Block(k, offset, 4096, checksum=xxhash.xxh3_64_intdigest(data)))
    assert disk.entered.wait(10)  # the writer took its batch, and is about to write it
    # What a DELETE does (kvpool.tiers.chain.Tiers.delete): the write-back first, then
    # the disk, whose tombstone (if the block were there) goes down before the batch does.
    writeback.discard([raced])
    disk.delete([raced])
    disk.go.set()
    writeback.stop()  # writes what it took, then stops
    assert disk.contains([raced, kept]) == [False, True]
    disk.close()
    again = DiskTier(tmp_path / "disk", DISK_BYTES, segment_bytes=SEGMENT_BYTES)
    assert again.contains([raced, kept]) == [False, True]  # nor after a restart
    again.close()
    arena.close()
