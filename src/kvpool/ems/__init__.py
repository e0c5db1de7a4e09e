"""``kvpool.ems``: the Python SDK of a commercial elastic memory service (EMS) for KV cache,
on kvpool, so that a connector written for that service runs unchanged on kvpool.

``kvpool ems install DIR`` writes a thin top-level ``ems`` package into DIR that re-exports
this one (``from ems import Ems, ...``), without shadowing a real one.

- :class:`Ems`: ``init(EmsConfig)``, ``get_cc()``, ``check_health()``.
- :class:`EmsConfig`, :class:`CcKvOption`, and ``ems.cc_v1.cc_config``'s
  :class:`CcConfig_v1` and :class:`KVCacheType`.
- :class:`EmsException` with ``status_code()`` an :class:`EmsErrorCode`.
- The context-caching object: see :mod:`kvpool.ems.context`.
"""

from kvpool.ems.api import Ems
from kvpool.ems.cc_v1.cc_config import CcConfig_v1, KVCacheType
from kvpool.ems.config import CcKvOption, EmsConfig
from kvpool.ems.context import CcFuture, CcResult, ContextCaching
from kvpool.ems.errors import EmsErrorCode, EmsException

__all__ = [
    "CcConfig_v1",
    "CcFuture",
    "CcKvOption",
    "CcResult",
    "ContextCaching",
    "Ems",
    "EmsConfig",
    "EmsErrorCode",
    "EmsException",
    "KVCacheType",
]
