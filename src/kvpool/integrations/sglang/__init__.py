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

Importing this package imports SGLang (the backend subclasses its ``HiCacheStorage``):
install kvpool with the ``sglang`` extra beside SGLang.
"""

from kvpool.integrations.sglang.backend import KVPoolStorage

__all__ = ["KVPoolStorage"]
