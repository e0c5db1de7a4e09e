"""vLLM's reference MLA kernels (CPU_MLA) continue a prefix they did not compute wrongly:
a minimal reproduction through vLLM's own ExampleConnector, no kvpool involved.

One engine, CPU_MLA (vLLM's choice on a CPU without AMX; asked for here so that it runs on
any x86 CPU), vLLM's reference connector saving every prompt's KV to files.  Each prompt is
asked twice, one request at a time:

1. computed (nothing saved yet): the engine's own answer, saved by the connector;
2. loaded: vLLM keeps no MLA prefix cache of its own on these kernels, so the connector
   loads the prompt's prefix from its files (``num_cached_tokens`` > 0) and the engine
   computes the rest.

The KV loaded is the KV the first request computed, byte for byte (kvpool's suite reads both
from vLLM's paged cache: tests/integrations/test_bytes_vllm.py), yet the loaded requests
answer differently from the computed ones.  With AMX_MLA (the default where AMX exists) the
same script answers alike.

    python docs/repro/cpu_mla_prefix.py MODEL_DIR [CPU_MLA|AMX_MLA]

MODEL_DIR: any DeepSeek-V2/V3-shaped checkpoint; kvpool's tiny one is built by
``python -c "from kvpool.harness.tiny_model import build_tiny_model as b;
b('/tmp/dsv3', family='deepseek-v3')"``.
"""

from __future__ import annotations

import sys
import tempfile

from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "CPU_MLA"
    prompts = [" ".join(f"w9x{i}y{j % 97}" for j in range(250)) for i in range(4)]
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
        # logprobs: the first answer token's log-probability, computed and after a load
        greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
        differ = 0
        for i, prompt in enumerate(prompts):
            computed = llm.generate([prompt], greedy, use_tqdm=False)[0]
            loaded = llm.generate([prompt], greedy, use_tqdm=False)[0]
            same = computed.outputs[0].token_ids == loaded.outputs[0].token_ids
            differ += not same
            first = [_first_logprob(out) for out in (computed, loaded)]
            print(
                f"prompt {i}: {len(computed.prompt_token_ids)} tokens, "
                f"loaded {loaded.num_cached_tokens}; computed {list(computed.outputs[0].token_ids)}"
                f" loaded {list(loaded.outputs[0].token_ids)}: {'same' if same else 'DIFFERENT'}; "
                f"first token's logprob {first[0]:.4f} computed, {first[1]:.4f} loaded"
            )
        print(f"{backend}: {differ} of {len(prompts)} answers differ after a load")


def _first_logprob(output: object) -> float:
    completion = output.outputs[0]  # type: ignore[attr-defined]
    return float(completion.logprobs[0][completion.token_ids[0]].logprob)


if __name__ == "__main__":
    main()
