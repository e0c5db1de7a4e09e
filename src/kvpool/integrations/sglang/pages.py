"""SGLang's HiCache host pool as the pool sees it: its pages as a
:class:`~kvpool.kvcache.PagedLayout`, its namespace, and the pages a call names.

A pool block is one host page, plane after plane, in exactly the bytes of SGLang's own
flat data page (``get_data_page(flat=True)``), so that the zero-copy path
(``batch_get_v1``/``batch_set_v1``, straight between the host pool and pool memory) and the
generic one (flat page tensors) read each other's blocks:

==================  =================================  =====================================
host pool, layout   ``kv_buffer``                      planes of a page
==================  =================================  =====================================
MHA layer_first     ``[2, L, tokens, heads, dim]``     K of each layer, then V of each
MHA page_first      ``[2, tokens, L, heads, dim]``     K, then V (``[page, L, heads, dim]``)
MHA                 ``[2, pages, L, page, heads,       K, then V (``[L, page, heads, dim]``)
page_first_direct   dim]``
MLA layer_first     ``[L, tokens, 1, dim]``            the latent of each layer
MLA page_first      ``[tokens, L, 1, dim]``            the latents (``[page, L, 1, dim]``)
MLA                 ``[pages, L, page, 1, dim]``       the latents (``[L, page, 1, dim]``)
page_first_direct
==================  =================================  =====================================

Other host pools (asymmetric K/V widths, split MLA components, HiSparse, FP4 scales) and
layouts (``page_head``, ``page_unified``) are refused at start, with the supported ones
named: their pages are not one of these byte orders.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvpool.errors import ConfigError
from kvpool.keys import Namespace
from kvpool.kvcache.layouts import PagedLayout, Plane, dense_plane

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_layout(host_pool: Any) -> PagedLayout:
    """The planes of ``host_pool``'s pages (see the module's table)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kind = type(host_pool)
    if kind not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost) or (
        host_pool.layout not in LAYOUTS
    ):
        raise ConfigError(
            f"kvpool: an SGLang {kind.__name__} with layout {host_pool.layout!r} is not "
            f"supported: use an MHA or MLA model with --hicache-mem-layout one of "
            f"{', '.join(LAYOUTS)}"
        )
    if getattr(host_pool, "dcp_size", 1) != 1 or host_pool.kv_buffer is None:
        raise ConfigError("kvpool: decode context parallel and allocator-only host pools")
    planes_of = _mha_planes if kind is MHATokenToKVPoolHost else _mla_planes
    layout = PagedLayout(planes_of(host_pool))
    flat_page = host_pool.get_dummy_flat_data_page()
    if flat_page.numel() * flat_page.element_size() != layout.block_bytes:
        raise ConfigError(
            f"kvpool: a {kind.__name__} page is {flat_page.numel() * flat_page.element_size()}"
            f" bytes, its planes {layout.block_bytes}"
        )
    return layout


def _by_page(tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """A tensor whose first dimension is tokens, with pages first: ``[pages, page, ...]``."""
    return tokens.unflatten(0, (tokens.shape[0] // page_size, page_size))


def _mha_planes(pool: Any) -> list[Plane]:
    buffer, page = pool.kv_buffer, pool.page_size
    planes = []
    for part, name in ((buffer[0], "k"), (buffer[1], "v")):
        if pool.layout == "layer_first":
            planes += [
                dense_plane(_by_page(part[layer], page), f"{name}{layer}")
                for layer in range(pool.layer_num)
            ]
        elif pool.layout == "page_first":
            planes.append(dense_plane(_by_page(part, page), name))
        else:
            planes.append(dense_plane(part, name))
    return planes


def _mla_planes(pool: Any) -> list[Plane]:
    buffer, page = pool.kv_buffer, pool.page_size
    if pool.layout == "layer_first":
        return [
            dense_plane(_by_page(buffer[layer], page), f"latent{layer}")
            for layer in range(pool.layer_num)
        ]
    if pool.layout == "page_first":
        return [dense_plane(_by_page(buffer, page), "latent")]
    return [dense_plane(buffer, "latent")]


def page_namespace(
    storage_config: Any, host_pool: Any, layout: PagedLayout, tenant: str
) -> Namespace:
    """The namespace this rank's pages are saved and loaded under: two SGLang engines share
    pages exactly when they agree on the model (with SGLang's page-format tag), the host
    pool's kind and layout, its dtype and shape, the page size, the parallel rank (MLA's
    latent: one copy for every tensor-parallel rank, :meth:`Namespace.for_rank`), the
    context-parallel rank (whose slice of each page is its own) and the tenant.  SGLang's
    page hashes are its own chained sha256 of the tokens: stable across processes."""
    is_mla = bool(storage_config.is_mla_model)
    head_dim = host_pool.kv_cache_dim if hasattr(host_pool, "kv_cache_dim") else host_pool.head_dim
    engine = Namespace(
        model=storage_config.model_name or "",
        dtype=str(host_pool.dtype).removeprefix("torch."),
        layout=f"sglang/{type(host_pool).__name__}/{host_pool.layout}",
        num_layers=int(host_pool.layer_num),
        block_size=int(host_pool.page_size),
        num_kv_heads=int(getattr(host_pool, "head_num", 1)),
        head_dim=int(head_dim),
        is_mla=is_mla,
        tp_size=int(storage_config.tp_size),
        pp_size=int(storage_config.pp_size),
        tenant=tenant,
        hash_algo="sglang",
        extra=(
            f"pages={[end - start for start, end in layout.plane_bounds]} "
            f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}"
        ),
    )
    return engine.for_rank(int(storage_config.tp_rank), int(storage_config.pp_rank))


def page_ids(host_indices: torch.Tensor, page_size: int, num_pages: int) -> list[int] | None:
    """The host pages that ``host_indices`` (token slots, ``page_size`` per page) name, or
    None if they are not whole pages of the pool in order."""
    if host_indices.numel() != num_pages * page_size or not num_pages:
        return None
    slots = host_indices.reshape(num_pages, page_size).to(torch.int64)
    starts = slots[:, 0]
    in_order = torch.arange(page_size, dtype=torch.int64).expand_as(slots)
    if bool((starts % page_size).any()) or not torch.equal(slots - starts[:, None], in_order):
        return None
    ids: list[int] = (starts // page_size).tolist()
    return ids


def block_hash(sglang_key: str) -> bytes:
    """A key SGLang names a page by, as a block hash: its page hashes are sha256 in hex (32
    bytes once decoded); any other string is hashed, so two keys never meet."""
    if len(sglang_key) == 64:
        try:
            return bytes.fromhex(sglang_key)
        except ValueError:
            pass
    return hashlib.blake2b(sglang_key.encode(), digest_size=32, person=b"kvpool-sglang").digest()
