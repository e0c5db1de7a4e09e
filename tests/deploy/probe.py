"""What an engine container's ``vllm serve`` would do with the pool, run in its place
(tests/deploy/kubelet.py): its connector configuration, read the way kvpool's connector
reads it (``kv_connector_extra_config`` of its ``--kv-transfer-config`` argument, then its
``KVPOOL_*`` environment), reaches the node: a block is put and read back, through the
node's shared arena when the node is on this server; with ``KVPOOL_PROBE_READ``, the block
another engine's probe put under that name is read too.  Prints one JSON line."""

from __future__ import annotations

import hashlib
import json
import os

from kvpool import Client
from kvpool.integrations.vllm.config import connector_config


def block_of(name: str) -> tuple[bytes, bytes]:
    """The key and the bytes of the probe block called ``name``: the same in every probe."""
    seed = hashlib.sha256(name.encode()).digest()
    return b"\x01" * 16 + seed[:16], seed * 2048


def main() -> None:
    argv = json.loads(os.environ["KVPOOL_POD_COMMAND"])
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    config = connector_config(transfer.get("kv_connector_extra_config"), environ=os.environ)
    mapped: list[bool] = []
    key, block = block_of(os.environ.get("KVPOOL_PROBE_WRITE") or os.urandom(8).hex())
    other = os.environ.get("KVPOOL_PROBE_READ")
    with Client(config=config.client) as client:
        client._require_local().on_arena_mapped(lambda arena, _old: mapped.append(True))
        stored = client.put([key], [block]).all_stored
        got = client.get([key]).values[0]
        if other:
            other_key, other_block = block_of(other)
            value = client.get([other_key]).values[0]
            read_other = value is not None and bytes(value) == other_block
    print(
        json.dumps(
            {
                "uid": os.getuid(),
                "connector": transfer["kv_connector"],
                "module": transfer["kv_connector_module_path"],
                "role": transfer["kv_role"],
                "address": config.client.address,
                "etcd": config.client.etcd,
                "kthena_pod": config.kthena_pod,
                "stored": stored,
                "read_back": got is not None and bytes(got) == block,
                "shared_arena": bool(mapped),
                "read_other": read_other if other else None,
            }
        )
    )


if __name__ == "__main__":
    main()
