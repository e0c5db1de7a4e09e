"""``ems.cc_v1``: context caching, version 1."""

from kvpool.ems.cc_v1.cc_config import CcConfig_v1, KVCacheType

__all__ = ["CcConfig_v1", "KVCacheType"]
