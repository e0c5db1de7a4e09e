"""The node's lower tiers, built from its configuration in one place: the disk tier (and
the write-back that feeds it from DRAM), and the object store below it.

Two steps, as a node starts (:mod:`kvpool.node.build`): :func:`open_lower_tiers` opens
and checks them and writes nothing (a start refused later leaves their files as they
were); :func:`commit_lower_tiers`, once every check of the start has passed, writes what
opening them needs written and starts them.

Order of construction, so that no hook is assigned afterwards: the object tier first (the
disk hands it the segments it evicts), then the disk (re-indexing its segments, on a
thread), then (at commit) the write-back over the disk; each is given the KV-event sink, if
any.  The store is built next with ``spill=lower.writeback``, and the chain over both with
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


async def open_lower_tiers(config: NodeConfig, events: TierEvents | None = None) -> LowerTiers:
    """The tiers below DRAM that ``config`` asks for, open and checked (the disk's
    directory and files, the bucket's answer), with nothing written yet.  Blocking work
    runs on a thread."""
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
            path,
            config.disk.capacity,
            below=objects,
            events=events,
            fresh=config.fresh,
            deferred=True,
        ),
    )
    chain: list[Tier] = [disk]
    if objects is not None:
        try:
            await loop.run_in_executor(None, objects.check)
        except BaseException:
            disk.close()
            raise
        chain.append(objects)
    return LowerTiers(chain, None, disk)


async def commit_lower_tiers(lower: LowerTiers, arena: Arena) -> LowerTiers:
    """Once every check of the start has passed: the disk writes what opening it needs
    (:meth:`DiskTier.commit`), the object tier starts (its staging emptied, its threads
    running), and the write-back over the disk is built (its thread starts with
    ``Tiers.start``)."""
    disk = lower.disk
    if disk is None:
        return lower
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, disk.commit)
    if lower.objects is not None:
        await loop.run_in_executor(None, lower.objects.start)
    return LowerTiers(lower.chain, WriteBack(disk, arena), disk)
