"""The lower tiers built from a node's configuration: none without a disk, the disk and
its write-back with one, found again at a restart, emptied with ``fresh``."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from kvpool.config import DiskConfig, NodeConfig
from kvpool.store.arena import Arena
from kvpool.tiers.build import commit_lower_tiers, open_lower_tiers
from kvpool.tiers.chain import LowerTiers
from tests.tiers.test_disk import blocks


def test_the_chain_is_built_from_the_node_configuration(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", 16 << 20)
    config = NodeConfig(name="c", disk=DiskConfig(str(tmp_path / "disk"), 16 << 20))

    async def build(config: NodeConfig) -> LowerTiers:
        return await commit_lower_tiers(await open_lower_tiers(config), arena)

    assert asyncio.run(build(NodeConfig(name="c"))).chain == []
    lower = asyncio.run(build(config))
    assert lower.chain == [lower.disk] and lower.writeback is not None
    assert lower.disk is not None and lower.writeback.disk is lower.disk
    lower.disk.write(blocks("f", 2))
    lower.disk.close()
    again = asyncio.run(build(config))  # a restart finds the blocks again
    assert again.disk is not None and len(again.disk) == 2
    again.disk.close()
    fresh = asyncio.run(build(dataclasses.replace(config, fresh=True)))
    assert fresh.disk is not None and len(fresh.disk) == 0
    fresh.disk.close()
