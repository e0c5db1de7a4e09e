"""kvpool for vLLM: ``KVPoolConnector`` (load it with ``kv_connector_module_path =
"kvpool.integrations.vllm"``) and a tiny model for tests and demos.

Importing this package does not import vLLM; the connector is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":
        from .connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(name)
