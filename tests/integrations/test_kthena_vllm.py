"""A real vLLM engine with the connector (``kthena_pod``) and a node writing Kthena's Redis
entries: the blocks the engine saves are Kthena's blocks of the prompt's tokens (as the
engine's own ``/tokenize`` gives them, which is how Kthena's router tokenizes) for the
engine's pod, scored by a scorer written from Kthena's Go source (tests/kthena.py), and
they go when the pool evicts the blocks.  One engine process: about two minutes here, most
of it the engine's start."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvpool import Client, Namespace
from kvpool.cli.bench_peers import RedisPeer
from kvpool.harness.process import wait_until
from tests import kthena
from tests.integrations.engine import prompts
from tests.integrations.test_router_vllm import complete
from tests.integrations.vllm_server import VllmServer, connector_config

pytestmark = [pytest.mark.vllm]

POD = "llama-0.serving"
ENGINE_BLOCK = 32  # ENGINE_ARGS' --block-size: two of Kthena's blocks


def tokenize(url: str, model: str, prompt: str) -> list[int]:
    body = json.dumps({"model": model, "prompt": prompt}).encode()
    request = urllib.request.Request(
        url + "/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return list(json.loads(response.read())["tokens"])


def test_saved_blocks_are_kthena_entries_of_the_engines_pod_until_evicted(model, start_node):
    redis = RedisPeer()
    node = start_node(
        name="kthena",
        memory="32MiB",
        extra=["--kthena-redis", f"redis://127.0.0.1:{redis.port}/0"],
    )
    engine = VllmServer(
        model, kv_transfer_config=connector_config(node.unix_address, "kv_both", kthena_pod=POD)
    )
    try:
        text = prompts(40, 1, words=120)[0]
        complete(engine.url, model, text, max_tokens=2)
        tokens = tokenize(engine.url, model, text)
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
        engine.stop()
        redis.close()
