"""A real vLLM engine with the connector: the node's KV events name the blocks exactly as
the engine's own KV events do (vLLM's ``--kv-events-config`` publisher, on the same
prompts), with the same tokens and parents, so a router indexing either finds the other."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

from tests.cluster.fabric import free_port
from tests.integrations.engine import prompts
from tests.integrations.test_router_vllm import complete
from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer, connector_config

pytestmark = [pytest.mark.vllm]


def collect(sock, decoder, until, timeout=60.0):
    events = []
    deadline = time.monotonic() + timeout
    while not until(events):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out with {len(events)} events"
        if sock.poll(int(left * 1000)):
            events += decoder.decode(sock.recv_multipart()[2]).events
    return events


def test_the_pools_events_name_blocks_as_the_engine_does(model, start_node):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    node = start_node(
        name="ev",
        memory="256MiB",
        extra=["--kv-events", "tcp://127.0.0.1:0", "--kv-events-token-ids"],
    )
    engine_port = free_port()
    engine_events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{engine_port}",  # vLLM binds wildcard endpoints only
            "topic": "engine",
        }
    )
    ctx = zmq.Context()
    subs = []
    for endpoint in (node.info["kv_events"], f"tcp://127.0.0.1:{engine_port}"):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        subs.append(sock)
    engine = VllmServer(
        model,
        kv_transfer_config=connector_config(node.unix_address, "kv_both"),
        engine_args=[*ENGINE_ARGS, "--kv-events-config", engine_events],
    )
    try:
        time.sleep(0.5)  # SUB sockets connect
        for prompt in prompts(21, 2, words=150):
            complete(engine.url, model, prompt, max_tokens=2)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

        def stored(events):
            return {e.block_hashes[0]: e for e in events if isinstance(e, BlockStored)}

        pool = stored(collect(subs[0], decoder, lambda ev: len(stored(ev)) >= 4))

        def every_hash(events):
            return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}

        mine = collect(subs[1], decoder, lambda ev: set(pool) <= every_hash(ev), timeout=30)
        # The engine publishes several blocks per event; the pool one per block.
        by_hash = {}
        for e in mine:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    bs = e.block_size
                    by_hash[h] = (parent, e.token_ids[i * bs : (i + 1) * bs])
        assert set(pool) <= set(by_hash)
        for h, event in pool.items():
            parent, tokens = by_hash[h]
            assert event.parent_block_hash == parent
            assert event.token_ids == tokens and event.block_size == len(tokens)
            assert event.medium == "CPU"
    finally:
        engine.stop()
        for sock in subs:
            sock.close(linger=0)
        ctx.term()
