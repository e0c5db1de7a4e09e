"""``ems.cc_v1.cc_config``: the context-caching identity of one engine rank."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVCacheType(enum.Enum):
    MHA = "MHA"  # keys and values per head (also GQA)
    MLA = "MLA"  # a latent cache (DeepSeek-style multi-head latent attention)


@dataclass
class CcConfig_v1:
    rank_id: int = 0
    device_id: int = 0
    model_id: str = ""
    tp_world_size: int = 1
    pp_world_size: int = 1
    rank_in_tp_group: int = 0
    rank_in_pp_group: int = 0
    llm_engine: str = ""
    kvcache_type: KVCacheType = KVCacheType.MHA
