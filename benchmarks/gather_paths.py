"""How fast torch gathers a batch of pages out of a cache laid out as the engines lay it out,
beside a memcpy of the same bytes in the same run (the ceiling).

A cache of ``planes`` planes (K and V, or layers) in one storage, plane after plane
(``[planes, blocks, page]``, as SGLang's ``page_first`` host pool and vLLM's CPU cache are),
gathered for ``n`` random blocks into a ``[n, planes, page]`` batch four ways:

- ``index_select``: one ``torch.index_select`` over the strided ``[blocks, planes, page]``
  view (:meth:`kvpool.kvcache.layouts.PagedLayout.gather`'s path);
- ``per page``: a ``copy_`` per block and plane (each a dense run);
- ``per plane``: an ``index_select`` per plane, then a copy into the batch's columns;
- ``memcpy``: one copy of as many contiguous bytes.

    .venv/bin/python -m benchmarks.gather_paths [--json]
    .venv-sglang/bin/python -m benchmarks.gather_paths [--json]   # SGLang's torch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

# (page bytes of one plane, blocks in the cache, blocks gathered, planes)
SHAPES = [(2 << 20, 200, 32, 2), (16 << 10, 4000, 512, 8), (2 << 10, 20000, 2000, 32)]


def _median_s(step: Callable[[], object], repeat: int = 7) -> float:
    step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(page_bytes: int, num_blocks: int, n: int, planes: int) -> dict[str, float]:
    page = page_bytes // 2  # bfloat16
    storage = torch.empty(planes * num_blocks * page, dtype=torch.bfloat16)
    by_plane = storage.view(planes, num_blocks, page)
    strided = torch.as_strided(storage, (num_blocks, planes, page), (page, num_blocks * page, 1))
    ids = torch.randperm(num_blocks)[:n]
    id_list = ids.tolist()
    out = torch.empty(n, planes, page, dtype=torch.bfloat16)
    flat = torch.empty(n * planes * page, dtype=torch.bfloat16)

    def per_page() -> None:
        for j, i in enumerate(id_list):
            for p in range(planes):
                out[j, p].copy_(by_plane[p, i])

    def per_plane() -> None:
        for p in range(planes):
            out[:, p].copy_(by_plane[p].index_select(0, ids))

    gbps = {
        "index_select": _median_s(lambda: torch.index_select(strided, 0, ids, out=out)),
        "per page": _median_s(per_page),
        "per plane": _median_s(per_plane),
        "memcpy": _median_s(lambda: out.view(-1).copy_(flat)),
    }
    num_bytes = out.numel() * out.element_size()
    result = {name: round(num_bytes / s / 1e9, 2) for name, s in gbps.items()}
    result["index_select_to_memcpy"] = round(result["index_select"] / result["memcpy"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [
        {"page_bytes": page, "planes": planes, "gathered": n, "torch": torch.__version__}
        | measure(page, blocks, n, planes)
        for page, blocks, n, planes in SHAPES
    ]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    for row in rows:
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
