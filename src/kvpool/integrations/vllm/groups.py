"""The KV cache groups of an engine (vLLM's hybrid memory allocator) as the pool sees them.

vLLM gives every group of layers that share one kind of KV cache its own block table; a
request's blocks are one list per group, and a block id means a page in every layer tensor,
holding the layers of the group that owns it.  A pool block is one block of one group, so
each group saves and loads under its own namespace (:func:`group_namespace`), and a prefix
of ``N`` blocks is reusable only if every group has what the engine reads of it:

- **full attention** (MLA included): all ``N`` blocks;
- **sliding window** of ``W`` tokens: only the trailing blocks the next token's window
  reaches, the same rule as vLLM's sliding-window manager, which pads the blocks before
  them with its null block (:meth:`CacheGroup.first_needed_block`);
- **recurrent state** (Mamba / linear attention in vLLM's ``align`` prefix-caching mode):
  only the state at the prefix's end, which vLLM keeps in the prefix's last block (the
  blocks before it are null blocks).  Which blocks hold a state at a block boundary only
  vLLM knows (a state block is copied forward and freed as the request runs), so such
  states are saved from vLLM's boundary-state hand-offs, never from the block table;
- **anything else** (chunked local attention, Mamba outside ``align`` mode, ...): not
  reusable through the pool; an engine with such a group is offered no pool blocks.

An engine with one group is the same: its group is of one of these kinds (a model whose every
layer has a sliding window, a pure state-space model), though vLLM's allocator is not
hybrid then.

Rules:
1. An engine with one group keeps the namespace it always had (keys unchanged).
2. A group never reads another group's keys: its kind, window and index are in its
   namespace.
3. A load writes only the blocks the engine reads; the engine's null block is never a
   destination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool.keys import Namespace

FULL = "full"
SLIDING = "sliding"
STATE = "state"
UNSUPPORTED = "unsupported"

# vLLM's null block: the placeholder for blocks a group does not keep (block id 0).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: its index in the engine's config, its kind, and for a sliding
    window group the window in tokens."""

    index: int
    kind: str
    sliding_window: int = 0
    spec_name: str = ""
    layer_names: tuple[str, ...] = ()
    page_bytes: int = 0  # one block of one layer, as vLLM's spec sizes it (0: unknown)

    @property
    def is_reusable(self) -> bool:
        return self.kind != UNSUPPORTED

    def first_needed_block(self, num_blocks: int, block_size: int) -> int:
        """Of a prefix of ``num_blocks`` computed blocks, the first block the engine reads
        when it computes the next token: 0 for full attention; for a sliding window, the
        block of the first token inside the window; for a recurrent state, the last block
        (earlier blocks are null blocks)."""
        if self.kind == STATE:
            return max(num_blocks - 1, 0)
        if self.kind != SLIDING:
            return 0
        num_skipped_tokens = max(0, num_blocks * block_size - self.sliding_window + 1)
        return min(num_skipped_tokens // block_size, num_blocks)

    def tag(self) -> str:
        if self.kind == SLIDING:
            return f"group={self.index}:{self.kind}{self.sliding_window}"
        return f"group={self.index}:{self.kind}"


def cache_groups(kv_cache_config: Any, block_size: int) -> list[CacheGroup]:
    """The groups of vLLM's ``KVCacheConfig`` (one full-attention group without one).  A
    group whose blocks are not ``block_size`` tokens (the size the request's block hashes
    cover) is not reusable."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return [CacheGroup(0, FULL)]  # no config: every block, as before the hybrid allocator
    # A request's block hashes must be one per block: finer hashes (groups of several block
    # sizes) would put a block under another block's key.
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    return [_group(index, group, block_size, hash_block_size) for index, group in enumerate(groups)]


def _group(index: int, group: Any, block_size: int, hash_block_size: int) -> CacheGroup:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    name = type(spec).__name__
    if hash_block_size != block_size:
        return CacheGroup(index, UNSUPPORTED, spec_name=f"{name}(hashes of {hash_block_size})")
    if int(getattr(spec, "block_size", 0)) != block_size:
        return CacheGroup(index, UNSUPPORTED, spec_name=f"{name}(block {spec.block_size})")
    layers = tuple(getattr(group, "layer_names", ()))
    page_bytes = int(getattr(spec, "page_size_bytes", 0) or 0)
    # Exact types only: a subclass may keep its blocks by another rule.
    if type(spec) is SlidingWindowSpec:
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
        return CacheGroup(index, SLIDING, window, name, layers, page_bytes)
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return CacheGroup(index, FULL, spec_name=name, layer_names=layers, page_bytes=page_bytes)
    if type(spec) is MambaSpec and spec.mamba_cache_mode == "align":
        return CacheGroup(index, STATE, spec_name=name, layer_names=layers, page_bytes=page_bytes)
    mode = getattr(spec, "mamba_cache_mode", None)
    return CacheGroup(index, UNSUPPORTED, spec_name=f"{name}(cache mode {mode})" if mode else name)


def group_namespace(base: Namespace, group: CacheGroup, num_groups: int) -> Namespace:
    """The namespace of ``group``'s blocks: ``base`` itself for a single-group engine."""
    if num_groups == 1:
        return base
    extra = f"{base.extra};{group.tag()}" if base.extra else group.tag()
    return msgspec.structs.replace(base, extra=extra)


def group_namespaces(
    spaces: dict[tuple[int, int], Namespace], groups: list[CacheGroup]
) -> dict[tuple[int, int], list[Namespace]]:
    """Per rank, the namespace of each group (indexed like ``groups``)."""
    return {
        rank: [group_namespace(base, group, len(groups)) for group in groups]
        for rank, base in spaces.items()
    }


def unsupported_reason(groups: list[CacheGroup]) -> str:
    """Why an engine's prefixes cannot come from the pool ("" when they can)."""
    kinds = [g.spec_name or g.kind for g in groups if not g.is_reusable]
    if not kinds:
        return ""
    return (
        f"KV cache group(s) of kind {', '.join(sorted(set(kinds)))} keep KV the pool "
        "cannot key or reuse; no prefix is loaded or saved"
    )
