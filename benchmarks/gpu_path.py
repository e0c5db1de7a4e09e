"""The GPU path, beside its ceilings in one run: a real node, the connector's worker
(:class:`~kvpool.integrations.vllm.worker.KVPoolWorker`, driven step by step the way vLLM's
model runner drives it) and a torch-only, 8B-Llama-shaped forward.

    python -m benchmarks.gpu_path [--tokens 16384] [--rounds 3] [--json]
    python -m benchmarks.gpu_path --device cpu --small    # the same code, small, on a CPU

What it measures:

1. **Ceilings**, same run: host<->device copies of pinned memory (``cudaHostAlloc``).
2. **Saves and loads of a paged cache** of ``--tokens`` tokens: 32 layers, each
   ``[2, blocks, 16, 8, 128]`` bf16 (vLLM's flash-attention layout, one tensor per layer),
   so a pool block is 2 MiB.  A save is timed from ``wait_for_save`` (the forward is done)
   to its commit; a load from the step's start to its blocks in the cache and the pin
   released.  Both include the pool's round trips, not only the copies.
3. **Time to first token** of a prompt whose ``--tokens - 64`` leading tokens are in the
   pool: the worker's layer-by-layer load, then the 64-token suffix's forward reading the
   paged cache; against the full prefill, and against the ceiling of the same run: the
   prefix's KV copied from pinned host memory, then the same suffix.  The logits of the load
   are checked against the full prefill's.

Goals (issue 15): at least 45 GB/s for loads and saves; TTFT within 1.2x of the ceiling.

On the lent GPU machine, which has torch but no network, kvpool's other dependencies come
along as a folder built here: ``pip install --target .gpu-deps --python-version 3.X
--only-binary=:all: msgspec xxhash uvloop aiohttp prometheus_client typer rich redis
etcd3gw pyzmq obstore``; then ``PYTHONPATH=src:.gpu-deps python -m benchmarks.gpu_path``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvpool.harness.process import NodeProcess
from kvpool.integrations.vllm.config import connector_config
from kvpool.integrations.vllm.metadata import KVPoolMetadata, TransferJob
from kvpool.integrations.vllm.worker import KVPoolWorker
from kvpool.keys import Namespace

SUFFIX_TOKENS = 64


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    block_size: int


LLAMA_8B = Shape(32, 8, 32, 128, 4096, 14336, 128256, 16)
SMALL = Shape(2, 2, 4, 16, 64, 128, 256, 16)


def layer_names(shape: Shape) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]


class Model:
    """Random weights; the KV of each layer lives in a paged cache, ``[2, blocks, block_size,
    kv_heads, head_dim]`` (vLLM's flash-attention layout)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype):
        self.shape, self.device, self.dtype = shape, device, dtype
        generator = torch.Generator(device="cpu").manual_seed(0)

        def weight(*size: int) -> torch.Tensor:
            w = torch.randn(*size, generator=generator, dtype=torch.float32) * 0.02
            return w.to(device=device, dtype=dtype)

        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            {
                "qkv": weight(qkv, s.hidden),
                "o": weight(s.hidden, s.heads * s.head_dim),
                "gate_up": weight(2 * s.intermediate, s.hidden),
                "down": weight(s.hidden, s.intermediate),
            }
            for _ in range(s.layers)
        ]
        self.embed = weight(s.vocab, s.hidden)
        self.head = weight(s.vocab, s.hidden)

    def cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        s = self.shape
        size = (2, num_blocks, s.block_size, s.kv_heads, s.head_dim)
        return {
            name: torch.zeros(size, dtype=self.dtype, device=self.device) for name in layer_names(s)
        }

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        cache: dict[str, torch.Tensor],
        block_ids: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        before_layer: Callable[[str], None] = lambda name: None,
    ) -> torch.Tensor:
        """Logits of the last token; the new tokens' KV goes into ``cache``.  The KV of
        positions before ``start`` comes from ``past`` if given, else from ``cache``."""
        s = self.shape
        num = tokens.numel()
        end = start + num
        x = self.embed[tokens]
        mask = None
        if start:
            mask = torch.ones(num, end, dtype=torch.bool, device=self.device).tril(start)
        positions = torch.arange(start, end, device=self.device)
        slots_block = block_ids.to(self.device)[positions // s.block_size]
        slots_offset = positions % s.block_size
        blocks_read = block_ids[: math.ceil(end / s.block_size)].to(self.device)
        for i, (name, w) in enumerate(zip(layer_names(s), self.layers, strict=True)):
            before_layer(name)
            h = F.rms_norm(x, (s.hidden,))
            q, k, v = (h @ w["qkv"].T).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
            )
            k = k.reshape(num, s.kv_heads, s.head_dim)
            v = v.reshape(num, s.kv_heads, s.head_dim)
            layer = cache[name]
            layer[0, slots_block, slots_offset] = k
            layer[1, slots_block, slots_offset] = v
            if past is not None and start:
                keys = torch.cat([past[i][0], k])
                values = torch.cat([past[i][1], v])
            else:
                keys = layer[0].index_select(0, blocks_read).flatten(0, 1)[:end]
                values = layer[1].index_select(0, blocks_read).flatten(0, 1)[:end]
            attended = F.scaled_dot_product_attention(
                q.view(num, s.heads, s.head_dim).transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=not start,
                enable_gqa=True,
            )
            x = x + attended[0].transpose(0, 1).reshape(num, -1) @ w["o"].T
            gate, up = (F.rms_norm(x, (s.hidden,)) @ w["gate_up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        return F.rms_norm(x[-1:], (s.hidden,)) @ self.head.T


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` runs after one warm-up."""
    fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def ceilings(device: torch.device, num_bytes: int, reps: int) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    h2d = timed(device, lambda: on_device.copy_(pinned, non_blocking=True), reps)
    d2h = timed(device, lambda: pinned.copy_(on_device, non_blocking=True), reps)
    return {"h2d_pinned_GBps": num_bytes / h2d / 1e9, "d2h_pinned_GBps": num_bytes / d2h / 1e9}


def make_worker(node: NodeProcess, namespace: Namespace, cache: dict[str, torch.Tensor]) -> Any:
    config = connector_config(
        {"address": node.unix_address, "lookup_timeout": 5.0, "transfer_timeout": 60.0},
        environ={},
    )
    first = next(iter(cache.values()))
    page_bytes = 2 * first[0, 0].numel() * first.element_size()
    worker = KVPoolWorker(config, namespace, page_bytes)
    worker.register_kv_caches(cache)
    return worker


def drain(worker: KVPoolWorker) -> None:
    deadline = time.monotonic() + 120
    while worker._saving and time.monotonic() < deadline:
        time.sleep(0.001)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = SMALL if args.small else LLAMA_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens if not args.small else 512
    num_blocks = tokens // shape.block_size
    prefix_blocks = (tokens - SUFFIX_TOKENS) // shape.block_size
    prefix_tokens = prefix_blocks * shape.block_size
    model = Model(shape, device, dtype)
    namespace = Namespace(model=f"gpu-path-{shape.layers}", block_size=shape.block_size)
    block_bytes = 2 * shape.layers * shape.block_size * shape.kv_heads * shape.head_dim
    block_bytes *= torch.finfo(dtype).bits // 8
    arena = max(4 * num_blocks * block_bytes, 64 << 20)
    out: dict[str, Any] = {"device": str(device), "shape": shape.__dict__, "tokens": tokens}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["ceilings"] = ceilings(device, num_blocks * block_bytes, args.rounds)

    with tempfile.TemporaryDirectory() as run_dir:
        node = NodeProcess.private("gpu-path", arena, run_dir=run_dir, ephemeral=True).start()
        try:
            source, target = model.cache(num_blocks + 8), model.cache(num_blocks + 8)
            saver = make_worker(node, namespace, source)
            loader = make_worker(node, namespace, target)
            prompt = torch.randint(0, shape.vocab, (tokens,), device=device)
            ids = torch.arange(num_blocks)
            full_prefill = timed(device, lambda: model.forward(prompt, 0, source, ids), 1)
            full_logits = model.forward(prompt, 0, source, ids)

            # Saves: fresh keys each round, the blocks as the prefill left them.
            saves = []
            for round_ in range(args.rounds + 1):
                hashes = [
                    hashlib.blake2b(b"%d-%d" % (round_, i), digest_size=16).digest()
                    for i in range(num_blocks)
                ]
                meta = KVPoolMetadata(saves=[TransferJob(f"s{round_}", ids.tolist(), hashes)])
                saver.begin_step(meta)
                time.sleep(0.05)  # the forward: the reservation is granted meanwhile
                synchronize(device)
                started = time.perf_counter()
                saver.wait_for_save(meta)
                drain(saver)
                saves.append(time.perf_counter() - started)
            prefix_hashes = hashes[:prefix_blocks]  # the last round's keys

            # Loads: the prefix into the other engine's cache, each layer before its use.
            target_ids = torch.arange(8, 8 + prefix_blocks + 8)
            load_job = TransferJob("load", target_ids[:prefix_blocks].tolist(), prefix_hashes)

            def load_only() -> None:
                meta = KVPoolMetadata(loads=[load_job])
                loader.begin_step(meta)
                for name in layer_names(shape):
                    loader.wait_for_layer_load(name)
                loader.wait_for_save(meta)

            suffix = prompt[prefix_tokens:]

            def load_and_suffix() -> torch.Tensor:
                meta = KVPoolMetadata(loads=[load_job])
                loader.begin_step(meta)
                logits = model.forward(
                    suffix,
                    prefix_tokens,
                    target,
                    target_ids,
                    before_layer=loader.wait_for_layer_load,
                )
                loader.wait_for_save(meta)
                return logits

            load = timed(device, load_only, args.rounds)
            ttft_pool = timed(device, load_and_suffix, args.rounds)
            errors = loader.get_block_ids_with_load_errors()
            pool_logits = load_and_suffix()
            synchronize(device)

            # The ceiling: the prefix's KV from pinned host memory, then the same suffix.
            prefix_ids = ids[:prefix_blocks].to(device)

            def on_host(name: str, kv: int) -> torch.Tensor:
                pages = source[name][kv].index_select(0, prefix_ids).flatten(0, 1).cpu()
                return pages.pin_memory() if device.type == "cuda" else pages

            host_past = [(on_host(name, 0), on_host(name, 1)) for name in layer_names(shape)]
            scratch = model.cache(num_blocks + 8)

            def ceiling() -> torch.Tensor:
                past = [
                    (k.to(device, non_blocking=True), v.to(device, non_blocking=True))
                    for k, v in host_past
                ]
                return model.forward(suffix, prefix_tokens, scratch, ids, past=past)

            ttft_ceiling = timed(device, ceiling, args.rounds)
            loaded_bytes = prefix_blocks * block_bytes
            saved_bytes = num_blocks * block_bytes
            save_s = sorted(saves[1:])[len(saves[1:]) // 2]
            rel_err = (
                (pool_logits.float() - full_logits.float()).norm() / full_logits.float().norm()
            ).item()
            out["kvpool"] = {
                "save_GBps": saved_bytes / save_s / 1e9,
                "load_GBps": loaded_bytes / load / 1e9,
                "load_errors": len(errors),
                "layout": saver.pool.layout.describe() if saver.pool else "",
            }
            out["ttft"] = {
                "prefix_tokens": prefix_tokens,
                "full_prefill_s": full_prefill,
                "pool_load_plus_suffix_s": ttft_pool,
                "ceiling_load_plus_suffix_s": ttft_ceiling,
                "ratio_to_ceiling": ttft_pool / ttft_ceiling,
                "speedup_over_prefill": full_prefill / ttft_pool,
                "logits_rel_err": rel_err,
            }
            for name, ceiling_key, figure in (
                ("save", "d2h_pinned_GBps", "save_GBps"),
                ("load", "h2d_pinned_GBps", "load_GBps"),
            ):
                if ceiling_key in out["ceilings"]:
                    out["kvpool"][f"{name}_ratio_to_pinned"] = (
                        out["kvpool"][figure] / out["ceilings"][ceiling_key]
                    )
            saver.shutdown()
            loader.shutdown()
        finally:
            node.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny model: checks the code")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for section in ("ceilings", "kvpool", "ttft"):
        for key, value in result.get(section, {}).items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{section:9s} {key:28s} {shown}")


if __name__ == "__main__":
    main()
