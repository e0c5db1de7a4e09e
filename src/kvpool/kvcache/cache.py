"""``PagedCache``: an engine's paged KV cache as the pool sees it, and how pool memory is
viewed as a batch of its blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.client.transactions import ReadTransaction, WriteTransaction

from .copies import Copies
from .guard import PoolGuard
from .layouts import PagedLayout


@dataclass(frozen=True)
class PagedCache:
    """A registered paged cache: its copies (which know its layout) and the guard its pool
    calls run under.  Built once the engine has registered its cache; the client is passed
    to each load or save (an engine may use several)."""

    copies: Copies
    guard: PoolGuard

    @property
    def layout(self) -> PagedLayout:
        return self.copies.layout


def num_of_layout(layout: PagedLayout, lease: ReadTransaction, num: int) -> int:
    """How many of a read lease's first ``num`` blocks are one block of ``layout`` each
    (``block_bytes``, its page's size): a load delivers those, the rest are misses."""
    for i, view in enumerate(lease.views[:num]):
        if view is None or len(view) != layout.block_bytes:
            return i
    return num


def pool_rows(
    layout: PagedLayout, lease: ReadTransaction | WriteTransaction, num: int
) -> torch.Tensor:
    """The first ``num`` blocks of a lease as a ``[num, block_elems]`` tensor: over the
    pool's memory when they are adjacent there, else a staged copy (reads only).  Each must
    be one block of the layout (:func:`num_of_layout`): adjacent blocks of another size are
    never sliced into pages (``ValueError``)."""
    views = lease.views[:num]
    if len(views) != num or any(v is None or len(v) != layout.block_bytes for v in views):
        sizes = sorted({len(v) if v is not None else 0 for v in views})
        raise ValueError(f"pool blocks of {sizes} bytes, not {layout.block_bytes}")
    extent = lease.extent(num) if isinstance(lease, ReadTransaction) else lease.extent()
    if extent is not None:
        return layout.pool_view(extent, num)
    return layout.stage(views)
