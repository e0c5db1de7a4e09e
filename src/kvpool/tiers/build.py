"""The node's lower tiers, built from its configuration in one place: the disk tier (and
the write-back that feeds it from DRAM), and the object store below it.

Order of construction, so that no hook is assigned afterwards: the object tier first (the
disk hands it the segments it evicts), then the disk (re-indexing its segments, on a
thread), then the write-back over the disk; each is given the KV-event sink, if any.  The
store is built next with ``spill=lower.writeback``, and the chain over both with
``Tiers(store, arena, lower, holds, remote)``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvpool.config import NodeConfig
from kvpool.store.arena import Arena
from kvpool.tiers.chain import LowerTiers
from kvpool.tiers.disk import OUTGOING_DIR, DiskTier
from kvpool.tiers.objects import ObjectTier
from kvpool.tiers.tier import Tier, TierEvents
from kvpool.tiers.writeback import WriteBack


async def open_lower_tiers(
    config: NodeConfig, arena: Arena, events: TierEvents | None = None
) -> LowerTiers:
    """The tiers below DRAM that ``config`` asks for, open and running (the object tier's
    threads started; the write-back's starts with ``Tiers.start``).  With ``fresh``, the
    disk tier's files are removed first, once it holds its directory.  Blocking work runs
    on a thread."""
    if not config.disk.path:
        return LowerTiers()
    loop = asyncio.get_running_loop()
    path = Path(config.disk.path)
    objects = None
    if config.objects.url:
        objects = ObjectTier(config.objects, path / OUTGOING_DIR, writer=config.name)
    disk = await loop.run_in_executor(
        None,
        lambda: DiskTier(
            path, config.disk.capacity, below=objects, events=events, fresh=config.fresh
        ),
    )
    chain: list[Tier] = [disk]
    if objects is not None:
        try:
            await loop.run_in_executor(None, objects.start)
        except BaseException:
            disk.close()
            raise
        chain.append(objects)
    return LowerTiers(chain, WriteBack(disk, arena), disk)
