"""Admission policies: which blocks evicted from DRAM are worth writing to a lower tier.

The interface (:class:`AdmissionPolicy`): ``admit(block, queue_fill)``, where ``queue_fill``
is how full the write-back queue is (0 to 1).  The caller guarantees the block is a
committed block being evicted; the policy only decides, it never blocks.

:class:`ReusedFirst` is the default.  Why not a frequency filter (TinyLFU) or "skip blocks
written once and never read": in a pool of KV cache, the block that matters most is the
history of a conversation whose next turn has not come yet.  It was written once, and read
never so far; a policy that needs evidence of reuse turns away exactly the multi-turn
working set the disk tier is there to keep.  So every evicted block is admitted while the
write-back queue has room to spare.  When it is more than half full (the disk cannot keep
up), only blocks already read since they were stored are admitted: proven reuse first, the
rest dropped before they cost disk bandwidth.  A full queue drops everything (that is the
write-back queue's rule, not the policy's): DRAM never waits for the disk.
"""

from __future__ import annotations

from typing import Protocol

from kvpool.store.block import Block

PRESSURE_FILL = 0.5


class AdmissionPolicy(Protocol):
    name: str

    def admit(self, block: Block, queue_fill: float) -> bool: ...


class ReusedFirst:
    name = "reused-first"

    def admit(self, block: Block, queue_fill: float) -> bool:
        return queue_fill < PRESSURE_FILL or block.num_reads > 0


class AdmitAll:
    """Every evicted block, queue permitting (for tests and benchmarks)."""

    name = "all"

    def admit(self, block: Block, queue_fill: float) -> bool:
        return True
