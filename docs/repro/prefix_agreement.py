"""Does vLLM alone answer a prompt the same when it computes its prefix as when the prefix
comes from its own prefix cache?  It depends on the CPU (docs/testing.md): this prints both
answers for the suite's prompts, so that a run says which kind of host it was on.

No connector, no kvpool code on the path but the harness that builds the tiny models and
runs the engine (``kvpool.harness``: an offline ``LLM`` in a process of its own, one plan of
steps).  For each family and dtype, each batch of prompts is generated twice in one plan:
computed, then at once again (every full block but the last token's from the engine's own
prefix cache).

    .venv/bin/python docs/repro/prefix_agreement.py [FAMILY ...]

FAMILY: llama (default), gemma3, qwen3-next, deepseek-v3 (kvpool.harness.tiny_model).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvpool.harness.engine import EngineProcess
from kvpool.harness.tiny_model import build_tiny_model

ENGINE = {"block_size": 32, "max_model_len": 4096, "kv_cache_memory_bytes": 64 << 20}
DTYPES = ("bfloat16", "float32")


def prompts(seed: int, count: int, words: int = 300) -> list[str]:
    """The suite's prompts (tests/integrations/engine.py ``prompts``)."""
    return [" ".join(f"w{seed}x{i}y{j % 97}" for j in range(words)) for i in range(count)]


# The batches of tests/integrations/test_vllm.py.
BATCHES = {"S1": prompts(1, 3), "S2": prompts(2, 2), "S3": prompts(3, 3), "S4": prompts(4, 2)}


def main() -> None:
    families = sys.argv[1:] or ["llama"]
    amx = Path("/proc/cpuinfo").read_text().count("amx_tile")
    print(f"CPUs with amx_tile: {amx}")
    num_differ = 0
    with tempfile.TemporaryDirectory() as models:
        for family in families:
            model = str(build_tiny_model(Path(models) / family, family=family))
            for dtype in DTYPES:
                with EngineProcess(model, engine={**ENGINE, "dtype": dtype}).start() as engine:
                    for name, batch in BATCHES.items():
                        ask = {"op": "generate", "prompts": batch, "max_tokens": 12}
                        computed, cached = engine.run(
                            [{**ask, "name": "computed"}, {**ask, "name": "cached"}]
                        )
                        pairs = zip(computed["token_ids"], cached["token_ids"], strict=True)
                        for i, (fresh, again) in enumerate(pairs):
                            same = "agree " if fresh == again else "DIFFER"
                            num_differ += fresh != again
                            print(
                                f"{family:12} {dtype:9} {name}[{i}] {same} "
                                f"cached {cached['num_cached_tokens'][i]:5} tokens  "
                                f"computed {fresh}  from its own cache {again}",
                                flush=True,
                            )
    print(f"{num_differ} answer(s) differ")


if __name__ == "__main__":
    main()
