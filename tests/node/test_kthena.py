"""Kthena's Redis entries, written by real nodes (``kvpool serve --kthena-redis``) to a real
``redis-server``, read with a scorer written from Kthena's Go source (tests/kthena.py):
blocks the node stores are Kthena's blocks of their tokens for the engines that named
themselves, and they go when the node's copies go."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.cli.bench_peers import RedisPeer
from kvpool.errors import KVPoolError
from kvpool.harness.process import NodeProcess, wait_until
from kvpool.keys import ENGINE_TTL_S, BlockOrigin, EngineRef, Namespace, chained_hashes
from kvpool.node.kthena import EngineTable, kthena_hash, kthena_hashes
from tests import kthena
from tests.security.tenants import TenantsFile
from tests.security.tenants import client as tenant_client

BS = 32  # the engine's block: two of Kthena's
MODEL = "org/model-7b"
POD, OTHER_POD = "engine-0.serving", "engine-1.serving"
NodeFactory = Callable[..., NodeProcess]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisPeer]:
    peer = RedisPeer()
    yield peer
    peer.close()


def kthena_node(start_node: NodeFactory, redis: RedisPeer, name: str = "kt", **kw) -> NodeProcess:
    extra = ["--kthena-redis", f"redis://127.0.0.1:{redis.port}/0", *kw.pop("extra", [])]
    return start_node(name=name, extra=extra, **kw)


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(num_blocks * BS)]


def save(client: Client, ns: Namespace, tokens: list[int]) -> list[bytes]:
    """Blocks of ``tokens`` saved as the vLLM connector saves them (with their origins; 8 KiB
    each, so that a tenant's block pays for its origin too)."""
    hashes = chained_hashes(tokens, BS)
    origins = [
        BlockOrigin(tokens[i * BS : (i + 1) * BS], hashes[i - 1] if i else b"")
        for i in range(len(hashes))
    ]
    keys = ns.keys(hashes)
    assert client.put(keys, [b"kv" * 4096] * len(keys), origins=origins).all_stored
    return keys


def score(redis: RedisPeer, tokens: list[int]) -> dict:
    return kthena.scores(redis.client, MODEL, tokens, [POD, OTHER_POD])


def settles(redis: RedisPeer, tokens: list[int], expected: dict) -> dict:
    """Kthena's scores once the node's writes land (bounded): they are off the event loop."""
    wait_until(lambda: score(redis, tokens) == expected, 10)
    return score(redis, tokens)


def test_kthenas_hash_is_sha256_of_big_endian_token_ids() -> None:
    tokens = list(range(100, 132))
    assert kthena_hashes(tokens, 16) == kthena.block_hashes(tokens, 16)
    assert kthena_hash([1]) == kthena.block_hashes([1])[0]
    assert kthena_hashes(tokens[:24], 16) == []  # not whole Kthena blocks: not announced


def test_stored_blocks_score_their_engines_and_go_when_the_node_drops_them(
    start_node: NodeFactory, redis: RedisPeer
) -> None:
    node = kthena_node(start_node, redis)
    ns = Namespace(model="kt-a", block_size=BS)
    tokens = prompt(1, 3)
    with Client(node.unix_address) as client:
        client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        keys = save(client, ns, tokens)
        assert settles(redis, tokens, {POD: 100}) == {POD: 100}
        # 6 Kthena blocks, each with one owner, valued with the second it was written
        entries = [
            redis.client.hgetall(kthena.PREFIX + f"{MODEL}@{h}")
            for h in kthena.block_hashes(tokens)
        ]
        assert all(set(e) == {POD.encode()} for e in entries) and len(entries) == 6
        assert all(abs(int(e[POD.encode()]) - time.time()) < 60 for e in entries)
        # The last engine block goes: its two Kthena blocks with it.
        client.delete(keys[2:])
        assert settles(redis, tokens, {POD: 66}) == {POD: 66}
        client.delete(keys[:1])
        assert settles(redis, tokens, {}) == {}
        assert redis.client.hgetall(kthena.PREFIX + f"{MODEL}@{kthena.block_hashes(tokens)[2]}")


def test_a_kthena_block_two_pool_blocks_hold_stays_until_both_go(
    start_node: NodeFactory, redis: RedisPeer
) -> None:
    """Two namespaces (two tensor-parallel shards, say) hold the same tokens: Kthena's
    entry counts both, and goes with the second."""
    node = kthena_node(start_node, redis, name="kt-refs")
    shards = [Namespace(model="kt-b", block_size=BS, tp_size=2, tp_rank=r) for r in range(2)]
    tokens = prompt(2, 2)
    with Client(node.unix_address) as client:
        for ns in shards:
            client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        keys = [save(client, ns, tokens) for ns in shards]
        assert settles(redis, tokens, {POD: 100}) == {POD: 100}
        client.delete(keys[0])
        assert kthena_node_flushed(client, redis, tokens) == {POD: 100}
        client.delete(keys[1])
        assert settles(redis, tokens, {}) == {}


def kthena_node_flushed(client: Client, redis: RedisPeer, tokens: list[int]) -> dict:
    """Scores after a marker block's entry lands: every earlier change has been written
    (the node writes its changes in order)."""
    marker_ns = Namespace(model="kt-marker", block_size=BS)
    client.describe(marker_ns, engine=EngineRef(pod=OTHER_POD, model=MODEL))
    marker = prompt(99, 1)
    save(client, marker_ns, marker)
    assert wait_until(lambda: score(redis, marker) == {OTHER_POD: 100}, 10)
    return score(redis, tokens)


def test_only_the_engines_of_a_namespace_are_owners(
    start_node: NodeFactory, redis: RedisPeer
) -> None:
    node = kthena_node(start_node, redis, name="kt-who")
    mine, theirs = Namespace(model="kt-c", block_size=BS), Namespace(model="kt-d", block_size=BS)
    with Client(node.unix_address) as client:
        client.describe(mine, engine=EngineRef(pod=POD, model=MODEL))
        client.describe(theirs, engine=EngineRef(pod=OTHER_POD, model=MODEL))
        save(client, mine, prompt(3, 2))
        save(client, theirs, prompt(4, 2))
        unnamed = Namespace(model="kt-e", block_size=BS)
        save(client, unnamed, prompt(5, 2))  # no engine named: nobody's
        assert settles(redis, prompt(3, 2), {POD: 100}) == {POD: 100}
        assert settles(redis, prompt(4, 2), {OTHER_POD: 100}) == {OTHER_POD: 100}
        assert kthena_node_flushed(client, redis, prompt(5, 2)) == {}


def test_evicted_blocks_leave_kthenas_entries(start_node: NodeFactory, redis: RedisPeer) -> None:
    node = kthena_node(start_node, redis, name="kt-evict", memory="4MiB")
    ns = Namespace(model="kt-f", block_size=BS)
    tokens = prompt(6, 2)
    with Client(node.unix_address) as client:
        client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        keys = save(client, ns, tokens)
        assert settles(redis, tokens, {POD: 100}) == {POD: 100}
        filler = Namespace(model="kt-filler", block_size=BS)
        for i in range(16):  # 8 MiB through a 4 MiB arena: the oldest blocks are evicted
            client.put(filler.keys([bytes([i]) * 32]), [b"\0" * (512 << 10)])
        assert client.lookup(keys) == 0
        assert settles(redis, tokens, {}) == {}


def test_a_node_that_starts_empty_takes_back_its_entries(
    start_node: NodeFactory, redis: RedisPeer
) -> None:
    node = kthena_node(start_node, redis, name="kt-fresh")
    ns = Namespace(model="kt-g", block_size=BS)
    tokens = prompt(7, 2)
    with Client(node.unix_address) as client:
        client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        save(client, ns, tokens)
    assert settles(redis, tokens, {POD: 100}) == {POD: 100}
    node.stop()
    kthena_node(start_node, redis, name="kt-fresh", extra=["--fresh"])
    assert settles(redis, tokens, {}) == {}


def test_a_tenant_cannot_name_an_engine(
    start_node: NodeFactory, redis: RedisPeer, run_dir: Path
) -> None:
    """A tenant could name any pod and steer Kthena with its own blocks: refused."""
    tenants = TenantsFile(run_dir / "tenants.toml")
    (credential,) = tenants.add("t")
    tenants.write()
    node = kthena_node(start_node, redis, name="kt-tenant", extra=["--tenants", str(tenants.path)])
    ns = Namespace(model="kt-h", block_size=BS)
    with tenant_client(node.unix_address, credential) as client:
        with pytest.raises(KVPoolError, match="cannot name an engine"):
            client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        client.describe(ns)  # a label is still the tenant's to give
        save(client, ns, prompt(8, 2))
    assert score(redis, prompt(8, 2)) == {}


def test_engines_are_forgotten_unless_renewed() -> None:
    now = [0.0]
    table = EngineTable(clock=lambda: now[0])
    ns = b"n" * 16
    assert table.attach(ns, EngineRef(pod=POD, model=MODEL))
    assert table.engines(ns) == [(POD, MODEL)]
    now[0] = ENGINE_TTL_S - 1
    assert table.attach(ns, EngineRef(pod=POD, model=MODEL))  # renewed
    now[0] = ENGINE_TTL_S + 1
    assert table.engines(ns) == [(POD, MODEL)]
    now[0] = 2 * ENGINE_TTL_S
    assert table.engines(ns) == [] and not table.by_namespace
    for i in range(64):
        assert table.attach(ns, EngineRef(pod=f"p{i}.x", model=MODEL))
    assert not table.attach(ns, EngineRef(pod="one-too-many.x", model=MODEL))


def _refs(redis: RedisPeer, tokens: list[int]) -> list[dict[bytes, bytes]]:
    """kvpool's counts of each Kthena block of ``tokens``: pod -> how many pool blocks."""
    return [
        redis.client.hgetall(f"kvpool:kthena:refs:{MODEL}@{h}") for h in kthena.block_hashes(tokens)
    ]


def test_a_slow_redis_changes_each_count_once(start_node: NodeFactory, redis: RedisPeer) -> None:
    """The fault's side: Redis answers later than the sink waits (2.5 s against 2 s: a
    proxy delays its replies) while blocks are stored, so the sink retries batches Redis has
    applied.  Each count is still 1 (before the fix: one per try), and once the blocks are
    deleted Kthena's entries no longer name the pod (before: a count of 1 was left, and the
    router would send requests there for blocks nobody holds)."""
    from tests.proxy import GateProxy

    with GateProxy(redis.port) as proxy:
        extra = ["--kthena-redis", f"redis://127.0.0.1:{proxy.port}/0"]
        node = start_node(name="kt-slow", extra=extra)
        ns = Namespace(model="kt-slow", block_size=BS)
        tokens = prompt(11, 3)
        with Client(node.unix_address) as client:
            client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
            warm = prompt(15, 1)  # the sink's connection open and its script loaded
            save(client, ns, warm)
            assert settles(redis, warm, {POD: 100}) == {POD: 100}
            # Redis's integer replies (the scripts' results) come late: what they answer
            # has been applied.
            proxy.delayed_replies, proxy.reply_delay_s = b":", 2.5
            keys = save(client, ns, tokens)
            time.sleep(5.5)  # two tries time out, each after Redis applied it
            proxy.reply_delay_s = 0.0
            assert settles(redis, tokens, {POD: 100}) == {POD: 100}
            counts = _refs(redis, tokens)
            assert counts == [{POD.encode(): b"1"}] * 6, counts
            client.delete(keys)
            assert settles(redis, tokens, {}) == {}
            assert all(not c for c in _refs(redis, tokens)), _refs(redis, tokens)
            stats = client.stats()
            assert stats.kthena_dropped == 0 and stats.kthena_written >= 12


def test_drops_are_logged_and_exported(start_node: NodeFactory, redis: RedisPeer) -> None:
    """Redis gone past the sink's retries: the changes it could not write are counted
    (``kvpool_kthena_dropped_total``) and logged."""
    from tests.proxy import GateProxy

    proxy = GateProxy(redis.port)
    extra = ["--kthena-redis", f"redis://127.0.0.1:{proxy.port}/0"]
    node = start_node(name="kt-gone", extra=extra)
    ns = Namespace(model="kt-gone", block_size=BS)
    with Client(node.unix_address) as client:
        client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        proxy.close()  # Redis unreachable from here on
        save(client, ns, prompt(12, 2))
        assert wait_until(lambda: client.stats().kthena_dropped >= 4, 30)
    import urllib.request

    with urllib.request.urlopen(node.info["admin"] + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    dropped = [line for line in metrics.splitlines() if line.startswith("kvpool_kthena_dropped")]
    assert dropped and float(dropped[0].split()[-1]) >= 4, dropped
    said = "".join(node.output)
    assert "kthena: " in said and "dropped" in said, said[-2000:]


def test_a_removal_takes_back_what_its_store_added(
    start_node: NodeFactory, redis: RedisPeer
) -> None:
    """An engine that names itself after a block was stored is not its owner: the block's
    removal takes back exactly the owners its store gave.  Two prompts share their second
    block's tokens (one Kthena block, two pool blocks); the first is stored when only POD
    loads the namespace, the second once OTHER_POD does too; deleting the first leaves the
    second's entries whole (before the fix, the removal took back the owners of the
    namespace at removal: OTHER_POD lost its entry for a block it still holds)."""
    node = kthena_node(start_node, redis, name="kt-owners")
    ns = Namespace(model="kt-owners", block_size=BS)
    shared = prompt(14, 1)
    first, second = prompt(13, 1) + shared, prompt(16, 1) + shared
    with Client(node.unix_address) as client:
        client.describe(ns, engine=EngineRef(pod=POD, model=MODEL))
        first_keys = save(client, ns, first)
        assert settles(redis, first, {POD: 100}) == {POD: 100}
        client.describe(ns, engine=EngineRef(pod=OTHER_POD, model=MODEL))
        save(client, ns, second)
        both = {POD: 100, OTHER_POD: 100}
        assert settles(redis, second, both) == both
        client.delete(first_keys)
        assert settles(redis, first, {}) == {}
        assert kthena_node_flushed(client, redis, second) == both
