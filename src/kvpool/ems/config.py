"""``EmsConfig`` and ``CcKvOption``: how an engine reaches the pool, and per-call options."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.ems.cc_v1.cc_config import CcConfig_v1


@dataclass
class EmsConfig:
    """``access_id`` / ``access_key`` become kvpool's authentication (the node's
    ``--access-id`` / ``--access-key``); the node's address comes from the environment, as
    for every kvpool client (``KVPOOL_ADDRESS``, default the local node's socket;
    ``KVPOOL_PEERS`` or ``KVPOOL_ETCD`` for a cluster)."""

    access_id: str = ""
    access_key: str = ""
    cc_config_v1: CcConfig_v1 = field(default_factory=CcConfig_v1)


@dataclass
class CcKvOption:
    """Per call: ``write_rcache`` (also write the block's home copy in a cluster),
    ``read_local_only`` (look at the local node only), ``timeout`` (milliseconds)."""

    write_rcache: bool = True
    read_local_only: bool = False
    timeout: int = 5000
