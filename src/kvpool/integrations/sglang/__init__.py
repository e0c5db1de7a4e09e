"""``kvpool.integrations.sglang``: kvpool as an SGLang HiCache storage backend.

SGLang (0.5.23) loads :class:`KVPoolStorage` as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolStorage",
        "interface_v1": 1}'

- :mod:`.backend`: the backend, SGLang's calls and the house rules they keep.
- :mod:`.pages`: the host pool's pages as a :class:`~kvpool.kvcache.PagedLayout`, the
  namespace, and the pages a call names.
- :mod:`.config`: the extra config's keys.

:class:`KVPoolStorage` imports SGLang (it subclasses its ``HiCacheStorage``): install
kvpool with the ``sglang`` extra beside SGLang.  It is imported when first named, so that
:mod:`.config` (its options, for the docs and the manifests' checks) reads without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVPoolStorage":
        from kvpool.integrations.sglang.backend import KVPoolStorage

        return KVPoolStorage
    raise AttributeError(name)
