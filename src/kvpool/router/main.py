"""Assemble and run the router from its settings."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.config import client_config_from
from kvpool.limits import ROUTER_LOOKUP_BUDGET_S
from kvpool.tls import CertFiles

from .app import Router, serve
from .config import RouterSettings, settings_from
from .engines import EngineSet
from .policies import make_policy
from .prefix import PrefixLocator, PromptHasher


def build_router(settings: RouterSettings) -> Router:
    locator = None
    if settings.tokenizer:
        hasher = PromptHasher(settings.tokenizer, settings.block_size, settings.hash_algo)
        # One client per engine's node; the most a request waits on the pool to be placed.
        pool = client_config_from({"timeout": ROUTER_LOOKUP_BUDGET_S, "use_shm": False})
        locator = PrefixLocator(hasher, pool, settings.model)
    policy = (
        make_policy(
            settings.policy,
            locator,
            cache_weight=settings.cache_weight,
            load_weight=settings.load_weight,
            max_load_gap=settings.max_load_gap,
        )
        if settings.policy == "cache_aware"
        else make_policy(settings.policy)
    )
    engines = EngineSet(settings.engines, interval_s=settings.health_interval)
    return Router(settings, engines, policy, make_policy(settings.prefill_policy), locator)


def run_router(config_file: str | None, overrides: dict[str, Any], engine_specs: list[str]) -> None:
    settings = settings_from(config_file, overrides, engine_specs)
    router = build_router(settings)
    tls = CertFiles(settings.tls_cert, settings.tls_key) if settings.tls_cert else None
    try:
        import uvloop

        uvloop.run(serve(router, settings.host, settings.port, tls=tls))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(router, settings.host, settings.port, tls=tls))
