"""``Ems``: initialise the SDK, reach the context-caching object, check health.

``Ems.init`` builds a kvpool client from the environment (``KVPOOL_ADDRESS``, default the
local node's socket; ``KVPOOL_PEERS`` / ``KVPOOL_ETCD`` for a cluster; ``KVPOOL_TIMEOUT``)
with the config's access id and key, and checks that the pool answers.  A pool that does
not answer is ``EMS_RECOVERD_ERROR``: the guide's connector then initialises again once
``check_health`` says the pool is back.  ``check_health`` never raises.
"""

from __future__ import annotations

import logging
import threading

from kvpool.client.client import Client
from kvpool.config import ClientConfig, client_config_from
from kvpool.errors import ConfigError, KVPoolError

from .cc_v1.cc_config import CcConfig_v1
from .config import EmsConfig
from .context import ContextCaching
from .errors import EmsErrorCode, EmsException, invalid

log = logging.getLogger("kvpool.ems")

HEALTH_TIMEOUT_S = 1.0


class Ems:
    _lock = threading.Lock()
    _client_config: ClientConfig | None = None
    _cc: ContextCaching | None = None

    @classmethod
    def init(cls, config: EmsConfig) -> None:
        if not isinstance(config, EmsConfig) or not isinstance(config.cc_config_v1, CcConfig_v1):
            raise invalid("Ems.init needs an EmsConfig with a CcConfig_v1")
        options: dict[str, object] = {}
        if config.access_id:
            options["access_id"] = config.access_id
        if config.access_key:
            options["access_key"] = config.access_key
        try:
            client_config = client_config_from(options)
        except ConfigError as exc:
            raise invalid(str(exc)) from None
        with cls._lock:
            cls._client_config = client_config
            client = Client(config=client_config)
            try:
                client.health(timeout=HEALTH_TIMEOUT_S)
            except KVPoolError as exc:
                client.close()
                raise EmsException(
                    EmsErrorCode.EMS_RECOVERD_ERROR, f"the pool at {client_config.address}: {exc}"
                ) from None
            if cls._cc is not None:
                cls._cc.close()
            cls._cc = ContextCaching(client, config.cc_config_v1)
        log.info("kvpool EMS initialised on %s", client_config.address or "the cluster")

    @classmethod
    def get_cc(cls) -> ContextCaching:
        if cls._cc is None:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED, "call Ems.init first")
        return cls._cc

    @classmethod
    def check_health(cls) -> bool:
        config = cls._client_config
        if config is None:
            return False
        try:
            if cls._cc is not None:
                cls._cc.client.health(timeout=HEALTH_TIMEOUT_S)
            else:
                with Client(config=config) as client:
                    client.health(timeout=HEALTH_TIMEOUT_S)
            return True
        except Exception:  # a health check answers; it never raises
            return False
