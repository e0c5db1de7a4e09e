"""A real vLLM engine with the connector (``kthena_pod``) and a node writing Kthena's Redis
entries: the blocks the engine saves are Kthena's blocks of the prompt's tokens (as the
engine's own tokenizer gives them, which is how Kthena's router tokenizes: its engine's
``/tokenize``) for the engine's pod, scored by a scorer written from Kthena's Go source
(tests/kthena.py), and they go when the pool evicts the blocks."""

from __future__ import annotations

import pytest

from kvpool import Client, Namespace
from kvpool.cli.bench_peers import RedisPeer
from kvpool.harness.process import wait_until
from tests import kthena
from tests.integrations.engine import BLOCK_SIZE, connector, prompts, run_engine

pytestmark = [pytest.mark.vllm]

POD = "llama-0.serving"
ENGINE_BLOCK = BLOCK_SIZE  # the engine's blocks: two of Kthena's each


def test_saved_blocks_are_kthena_entries_of_the_engines_pod_until_evicted(model, start_node):
    redis = RedisPeer()
    node = start_node(
        name="kthena",
        memory="32MiB",
        extra=["--kthena-redis", f"redis://127.0.0.1:{redis.port}/0"],
    )
    try:
        text = prompts(40, 1, words=120)[0]
        # Its own engine: the test's node, which names the engine's pod.
        (result,) = run_engine(
            model,
            [{"op": "generate", "prompts": [text], "max_tokens": 2}],
            connector_config=connector(node.unix_address, kthena_pod=POD),
        )
        tokens = result["prompt_token_ids"][0]
        num_saved = len(tokens) // ENGINE_BLOCK  # the prompt's full blocks
        num_blocks = len(kthena.block_hashes(tokens))
        expected = {POD: int(2 * num_saved / num_blocks * 100)}

        def scores() -> dict:
            return kthena.scores(redis.client, model, tokens, [POD, "other.serving"])

        assert num_saved >= 2
        assert wait_until(lambda: scores() == expected, 30), scores()
        with Client(node.unix_address) as client:  # 64 MiB through a 32 MiB arena
            filler = Namespace(model="filler")
            for i in range(64):
                client.put(filler.keys([bytes([i]) * 32]), [b"\0" * (1 << 20)])
        assert wait_until(lambda: scores() == {}, 30), scores()
    finally:
        redis.close()
