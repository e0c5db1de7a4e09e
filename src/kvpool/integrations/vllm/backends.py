"""The attention backends kvpool loads nothing into: the one list, and how an engine's are
known.

A load from the pool makes an engine continue a prefix it did not compute.  An attention
backend that cannot do that correctly (a fault of the backend: it gives the same wrong
answers after a load by vLLM's own ``ExampleConnector``) would answer differently with the
pool than without it.  For an engine that runs one, the connector offers no load (every
lookup is a miss, the engine recomputes) and says why once; it still saves, for engines
that can use the blocks (a decode engine on another host).

The backend is the one vLLM selected, as each layer of the worker holds it
(``layer.get_attn_backend()``): the worker reports its backends to the scheduler once, at
start, through vLLM's connector handshake (``get_handshake_metadata`` →
``set_xfer_handshake_metadata``), before any request.  Never a guess from the host.

Remove a backend from :data:`DECLINED` once vLLM fixes it: docs/declined-backends.md keeps
the reproduction of each, through vLLM's own connector.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Backend name (``AttentionBackend.get_name()``) -> why kvpool loads nothing into it.
DECLINED: Mapping[str, str] = {
    "CPU_MLA": (
        "vLLM's reference MLA kernels (CPU_MLA, its choice on CPUs without AMX) continue a "
        "prefix they did not compute with the rotary part of the first new tokens at the "
        "wrong position, and answer differently from the engine alone (vLLM 0.32; its own "
        "ExampleConnector too)"
    ),
}


# What the scheduler logs, once, for an engine it loads nothing into (then the reason).
DECLINED_LOG = "no prefix is loaded into this engine (every lookup a miss), its blocks are saved"


def declined_reason(backend_names: Iterable[str]) -> str:
    """Why an engine running ``backend_names`` is loaded nothing ("" when it may be)."""
    reasons = [
        f"{name}: {DECLINED[name]}" for name in sorted(set(backend_names)) if name in DECLINED
    ]
    return "; ".join(reasons)


def selected_backends(vllm_config: Any) -> tuple[str, ...]:
    """The attention backends vLLM selected for the model's layers in this worker (its
    ``static_forward_context``, filled as the model was built), by name."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    return tuple(sorted({layer.get_attn_backend().get_name() for layer in layers.values()}))
