"""Clusters of real node daemons on simulated hosts (network namespaces), with static peers
and with a real etcd: placement, cross-node hits, membership changes and failures."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import pytest

from kvpool import Client, Status
from kvpool.cluster.membership import Member
from kvpool.cluster.placement import homes
from kvpool.errors import KVPoolError
from tests.cluster.fabric import Etcd, Fabric
from tests.helpers import content, key, size_of

pytestmark = pytest.mark.cluster


@pytest.fixture
def fabric():
    f = Fabric()
    yield f
    f.close()


@pytest.fixture
def etcd(fabric):
    e = Etcd(fabric.gateway)
    yield e
    e.close()


def wait_for(predicate, timeout=15.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# -- placement --------------------------------------------------------------------------


def test_rendezvous_is_stable_balanced_and_moves_little():
    members = [Member(node_id=f"n{i}", tcp_address=f"10.0.0.{i}:1") for i in range(4)]
    keys = [key(i) for i in range(4000)]
    owners = [homes(k, members)[0].node_id for k in keys]
    assert owners == [homes(k, list(reversed(members)))[0].node_id for k in keys]  # order-free
    counts = Counter(owners)
    assert all(800 < c < 1200 for c in counts.values()), counts
    grown = [*members, Member(node_id="n4", tcp_address="10.0.0.4:1")]
    moved = sum(homes(k, grown)[0].node_id != o for k, o in zip(keys, owners, strict=True))
    assert 600 < moved < 1000  # about 1/5 of the keys move, all of them to the new node
    assert all(
        homes(k, grown)[0].node_id == "n4"
        for k, o in zip(keys, owners, strict=True)
        if homes(k, grown)[0].node_id != o
    )
    two = homes(keys[0], members, replicas=2)
    assert len({m.node_id for m in two}) == 2


# -- static peers -----------------------------------------------------------------------


def test_static_cluster_shares_blocks_across_hosts(fabric):
    hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts:
        host.start_node(peers=list(peers))
    writer = Client(**hosts[0].client_options(peers=peers))
    reader = Client(**hosts[1].client_options(peers=peers))
    local_only = Client(**hosts[1].client_options(peers=peers, read_local_only=True))
    try:
        assert writer.uses_shm and reader.uses_shm  # each on its own node's arena
        keys = [key(f"s{i}") for i in range(60)]
        values = [content(k, size_of(k, 1000, 200_000)) for k in keys]
        assert writer.put(keys, values).all_stored
        # Written through to every key's home: any node finds the whole prefix.
        assert wait_for(lambda: reader.lookup(keys) == 60)
        got = reader.get(keys)
        assert [bytes(v) for v in got.values] == [v.tobytes() for v in values]
        # A read lease (what the vLLM connector loads with) pins the local blocks and fills
        # the gaps from their homes.
        with reader.acquire(keys) as lease:
            assert lease.num_prefix == 60
            assert [bytes(v) for v in lease.views] == [v.tobytes() for v in values]
        stats = dict(writer.cluster_stats())
        assert (
            stats[hosts[0].tcp_address].num_blocks == 60
        )  # local affinity: all on the writer's node
        homed = Counter(homes(k, writer.cluster.members())[0].tcp_address for k in keys)
        assert stats[hosts[2].tcp_address].num_blocks == homed[hosts[2].tcp_address]
        # read_local_only stops at the local node: only what it holds itself counts.
        fresh = [key(f"t{i}") for i in range(30)]
        writer.put(fresh, [b"x"] * 30)
        wait_for(lambda: reader.lookup(fresh) == 30)
        # Until the write-through has reached the reader's node, what it holds changes.
        homed_here = [
            homes(k, writer.cluster.members())[0].tcp_address == hosts[1].tcp_address for k in fresh
        ]
        assert wait_for(
            lambda: all(
                held or not home
                for held, home in zip(reader.local.exists(fresh), homed_here, strict=True)
            )
        )
        local_present = reader.local.exists(fresh)
        assert local_only.exists(fresh) == local_present and not all(local_present)
        # A block another host is still writing is pending here too (a consumer waits for
        # a producer on another host), and found once it is committed.
        later = [key(f"p{i}") for i in range(4)]
        lease = writer.reserve(later, [4096] * 4)
        state = reader.lookup_state(later)
        assert state.num_prefix == 0 and state.is_next_pending
        for view in lease.views:
            view[:] = b"p" * 4096
        assert lease.commit().all_stored
        state = reader.lookup_state(later)
        assert state.num_prefix == 4 and not state.is_next_pending
    finally:
        for c in (writer, reader, local_only):
            c.close()


def test_prefetch_copies_blocks_from_other_nodes(fabric):
    """A node asked to prefetch blocks it does not hold reads them from their homes, and
    holds the copies in its DRAM for the request to come."""
    hosts = [fabric.add_host(n) for n in ("a", "b")]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts:
        host.start_node(peers=list(peers))
    writer = Client(**hosts[0].client_options(peers=peers))
    reader = Client(**hosts[1].client_options(peers=peers))
    try:
        members = writer.cluster.members()
        # Keys whose home is the writer's node: the reader's node holds none of them.
        keys = [k for k in (key(f"r{i}") for i in range(80))]
        keys = [k for k in keys if homes(k, members)[0].tcp_address == hosts[0].tcp_address][:12]
        values = [content(k, 50_000) for k in keys]
        assert writer.put(keys, values).all_stored
        assert not any(reader.local.exists(keys))
        answer = reader.prefetch(keys, hold=60)
        assert answer.num_started == len(keys)
        assert wait_for(lambda: all(reader.local.exists(keys)))
        got = reader.local.get(keys, None)
        assert [bytes(v) for v in got.values] == [v.tobytes() for v in values]
        stats = reader.local.stats().prefetch
        assert stats.completed == len(keys) and stats.useful == len(keys)
    finally:
        writer.close()
        reader.close()


def test_a_client_without_a_local_node_writes_to_homes(fabric):
    hosts = [fabric.add_host(n) for n in ("a", "b")]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts:
        host.start_node(peers=list(peers))
    with Client(address="", peers=peers, access_key=hosts[0].env()["KVPOOL_ACCESS_KEY"]) as router:
        keys = [key(f"r{i}") for i in range(20)]
        assert router.put(keys, [content(k, 5000) for k in keys]).all_stored
        assert router.lookup(keys) == 20
        with router.reserve(keys[:2], [10, 10]) as lease:
            for view in lease.views:
                view[:] = b"0123456789"
            lease.commit()
        per_node = [s.num_blocks for _, s in router.cluster_stats()]
        assert sum(per_node) == 20 and all(n > 0 for n in per_node)  # each key on its home only


def static_cluster(fabric, names):
    """A node on each named host, every one a peer of the others: the hosts and peers."""
    hosts = [fabric.add_host(n) for n in names]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts:
        host.start_node(peers=list(peers))
    return hosts, peers


def test_an_off_host_write_transaction_is_routed_through_the_cluster(fabric):
    """A transaction off its local node's host fills private buffers, and its commit goes
    where a put goes: the local node first, and when that fails, the keys' homes."""
    hosts, peers = static_cluster(fabric, ("a", "b", "c"))
    options = hosts[0].client_options(peers=peers, address=hosts[0].tcp_address)
    off_host = Client(**{**options, "host_id": "host-elsewhere"}, timeout=5)
    survivor = Client(**hosts[1].client_options(peers=peers), timeout=5)
    try:
        keys = [key(f"off{i}") for i in range(30)]
        values = [content(k, 5000) for k in keys]
        with off_host.begin_write(keys, [5000] * len(keys)) as write:
            assert not write.is_shm  # private buffers: the client is not on a's host
            for view, value in zip(write.views, values, strict=True):
                view[:] = value
            hosts[0].nodes[-1].kill()  # the local node goes before the commit
            result = write.commit()
        members = off_host.cluster.members()
        homed_away = [i for i, k in enumerate(keys) if homes(k, members)[0].tcp_address != peers[0]]
        assert homed_away  # rendezvous spreads 30 keys over three nodes
        for i in homed_away:  # not lost with the local node: written to their homes
            assert result.statuses[i] is Status.OK
        got = survivor.get([keys[i] for i in homed_away])
        assert [bytes(v) for v in got.values] == [values[i].tobytes() for i in homed_away]
        # With the local node gone at the start, the transaction is private buffers too.
        later = key("off-later")
        with off_host.begin_write([later], [5000]) as write:
            assert not write.is_shm
            write.views[0][:] = content(later, 5000)
            stored = write.commit().statuses == [Status.OK]
        assert stored == (homes(later, members)[0].tcp_address != peers[0])
    finally:
        off_host.close()
        survivor.close()


def test_a_writer_in_a_cluster_goes_on_through_the_homes(fabric):
    """A writer whose local node fails puts through the cluster's routing, as put does."""
    hosts, peers = static_cluster(fabric, ("a", "b"))
    with Client(**hosts[0].client_options(peers=peers), timeout=5) as client:
        keys = [key(f"w{i}") for i in range(20)]
        with client.writer() as writer:
            assert writer.put(keys[:10], [content(k, 4096) for k in keys[:10]]).result().all_stored
            hosts[0].nodes[-1].kill()
            later = writer.put(keys[10:], [content(k, 4096) for k in keys[10:]]).result()
        members = client.cluster.members()
        for k, status in zip(keys[10:], later.statuses, strict=True):
            on_b = homes(k, members)[0].tcp_address == peers[1]
            assert status is (Status.OK if on_b else Status.UNAVAILABLE)


# -- etcd membership --------------------------------------------------------------------


def test_etcd_membership_join_leave_and_rejoin(fabric, etcd):
    hosts = [fabric.add_host(n) for n in ("a", "b", "c", "d")]
    etcd_url = etcd.endpoint
    ttl = ["--etcd-ttl", "3"]  # the membership lease (5 s by default): how long a dead node stays
    for host in hosts[:3]:
        host.start_node(etcd=etcd_url, extra=ttl)
    with Client(**hosts[0].client_options(etcd=etcd_url)) as client:
        members = lambda: {m.tcp_address for m in client.cluster.members()}  # noqa: E731
        assert wait_for(lambda: len(members()) == 3)
        # A node that dies stops heartbeating: it leaves within its lease TTL (3 s).
        killed = hosts[2].nodes[-1]
        killed.kill()
        started = time.monotonic()
        assert wait_for(lambda: hosts[2].tcp_address not in members(), timeout=12)
        assert time.monotonic() - started < 3 + 4
        # A joining node is used without restarting anyone.
        hosts[3].start_node(etcd=etcd_url, extra=ttl)
        assert wait_for(lambda: hosts[3].tcp_address in members())
        # The writer's node writes through by its own view of the membership, which may hear
        # of the new node after this client did: a batch of new keys a round, until one
        # batch's blocks whose home is the new node are all on it (bounded).
        deadline, landed, batch = time.monotonic() + 20, False, 0
        with Client(**hosts[3].client_options()) as on_new:
            while not landed:
                assert time.monotonic() < deadline, "the joined node never got its blocks"
                keys = [key(f"j{batch}-{i}") for i in range(40)]
                client.put(keys, [b"v" * 100] * 40)
                new_home = [
                    k
                    for k in keys
                    if homes(k, client.cluster.members())[0].tcp_address == hosts[3].tcp_address
                ]
                assert new_home
                landed = wait_for(lambda ks=new_home: all(on_new.local.exists(ks)), timeout=3)
                batch += 1
        # A restarted node rejoins; a cleanly stopped one leaves at once.
        hosts[2].start_node(etcd=etcd_url, extra=ttl)
        assert wait_for(lambda: hosts[2].tcp_address in members())
        hosts[1].nodes[-1].stop()
        assert wait_for(lambda: hosts[1].tcp_address not in members(), timeout=3)
        rows = client.cluster_stats()
        assert {addr for addr, stats in rows if stats is not None} == members()


def test_replicas_keep_extra_home_copies(fabric, etcd):
    hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
    for host in hosts:
        host.start_node(etcd=etcd.endpoint, extra=["--replicas", "2"])
    with Client(**hosts[0].client_options(etcd=etcd.endpoint, replicas=2)) as client:
        assert wait_for(lambda: len(client.cluster.members()) == 3)
        keys = [key(f"rep{i}") for i in range(30)]
        client.put(keys, [b"r" * 64] * 30)
        members = client.cluster.members()
        for host in hosts[1:]:
            with Client(**host.client_options()) as on_host:
                expected = [
                    k
                    for k in keys
                    if host.tcp_address in {m.tcp_address for m in homes(k, members, 2)}
                ]
                assert wait_for(
                    lambda on_host=on_host, expected=expected: all(on_host.local.exists(expected))
                )
        # Losing one home still leaves a copy: every key stays readable from host b.
        hosts[2].nodes[-1].kill()
        with Client(
            **hosts[1].client_options(etcd=etcd.endpoint, replicas=2, timeout=1.0)
        ) as reader:
            found = reader.exists(keys)
            assert all(found), f"{found.count(False)} keys lost with one home"  # a and b hold them


# -- failures under load ----------------------------------------------------------------


def test_chaos_never_wrong_bytes_never_past_deadlines(fabric, etcd):
    hosts = [fabric.add_host(n) for n in ("a", "b", "c", "d")]
    for host in hosts[:3]:
        host.start_node(etcd=etcd.endpoint, memory="32MiB")
    deadline_s, margin_s = 1.0, 0.75
    errors: list[BaseException] = []
    slow: list[float] = []
    counts = Counter()
    # By worker: calls finished, and ("timed out", worker).  Every key is there before the
    # workers start: a copy taken while they count sees no key added.
    calls = Counter(dict.fromkeys([*range(6), *(("timed out", n) for n in range(6))], 0))
    stop = threading.Event()

    def worker(n: int) -> None:
        rng = random.Random(n)
        host = hosts[n % 2]  # clients live on hosts a and b
        try:
            with Client(**host.client_options(etcd=etcd.endpoint, timeout=deadline_s)) as c:
                while not stop.is_set():
                    batch = [key(f"chaos-{rng.randrange(300)}") for _ in range(4)]
                    op = rng.choice(("put", "get", "lookup"))
                    started = time.monotonic()
                    try:
                        if op == "put":
                            c.put(batch, [content(k, size_of(k, 100, 50_000)) for k in batch])
                        elif op == "get" and rng.random() < 0.5:
                            got = c.get(batch)
                            for k, status, value in zip(
                                batch, got.statuses, got.values, strict=True
                            ):
                                if status is Status.OK:
                                    assert (
                                        bytes(value)
                                        == content(k, size_of(k, 100, 50_000)).tobytes()
                                    )
                                    counts["hits"] += 1
                        elif op == "get":  # into the caller's own buffers
                            buffers = [bytearray(50_100) for _ in batch]
                            got = c.get(batch, buffers)
                            for k, status, buf in zip(batch, got.statuses, buffers, strict=True):
                                want = content(k, size_of(k, 100, 50_000)).tobytes()
                                if status is Status.OK:
                                    assert bytes(buf[: len(want)]) == want
                                    counts["hits"] += 1
                            time.sleep(0.05)  # nothing may write into them after the call
                            for status, buf in zip(got.statuses, buffers, strict=True):
                                if status is not Status.OK:
                                    assert not any(buf), "a buffer written after a miss"
                        else:
                            c.lookup(batch)
                        counts[op] += 1
                    except (AssertionError, TypeError):
                        raise
                    except KVPoolError as exc:  # a typed pool error is allowed; record it
                        counts[type(exc).__name__] += 1
                    elapsed = time.monotonic() - started
                    if elapsed > deadline_s + margin_s:
                        slow.append(elapsed)
                    if elapsed >= 0.9 * deadline_s:
                        calls["timed out", n] += 1
                    calls[n] += 1
        except BaseException as exc:
            errors.append(exc)

    def until(what: str, done) -> None:
        """Until ``done(calls since now)`` holds, the workers running on (bounded)."""
        since = Counter(calls)
        deadline = time.monotonic() + 60
        while not done(calls - since):
            assert not errors, errors[:3]
            assert time.monotonic() < deadline, f"{what}: {calls - since}"
            time.sleep(0.01)

    def each(num_calls: int):
        """Every worker has finished ``num_calls`` more calls."""
        return lambda new: all(new[n] >= num_calls for n in range(6))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    try:
        # Each phase lasts until every worker has made calls in it (a count, not a time).
        until("warming up", each(20))
        hosts[2].nodes[-1].kill()  # kill
        until("with c killed", each(20))
        frozen = hosts[1].nodes[-1]
        frozen.signal(signal.SIGSTOP)  # freeze (a client's own local node, even)
        # Until each worker on host b has had a call run into the frozen node's deadline.
        until("with b frozen", lambda new: all(new["timed out", n] for n in (1, 3, 5)))
        frozen.signal(signal.SIGCONT)
        until("with b thawed", each(20))
        hosts[2].start_node(etcd=etcd.endpoint, memory="32MiB")  # restart
        hosts[3].start_node(etcd=etcd.endpoint, memory="32MiB")  # add
        with Client(**hosts[0].client_options(etcd=etcd.endpoint)) as observer:
            assert wait_for(lambda: len(observer.cluster.members()) == 4)
        until("with c back and d added", each(20))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert not slow, f"{len(slow)} calls past deadline + margin, worst {max(slow):.2f} s"
    assert counts["put"] > 20 and counts["get"] > 20 and counts["hits"] > 20, counts


# -- management -------------------------------------------------------------------------


def test_status_shows_the_whole_cluster(fabric, etcd):
    import json
    import os
    import subprocess
    import sys

    hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
    for host in hosts:
        host.start_node(etcd=etcd.endpoint)
    peers = ",".join(h.tcp_address for h in hosts)
    env = {**os.environ, "KVPOOL_ACCESS_KEY": hosts[0].env()["KVPOOL_ACCESS_KEY"]}
    with Client(**hosts[0].client_options(etcd=etcd.endpoint)) as client:
        assert wait_for(lambda: len(client.cluster.members()) == 3)
        client.put([key(f"st{i}") for i in range(9)], [b"s" * 4096] * 9)
        client.lookup([key(f"st{i}") for i in range(12)])

    def status(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool", "status", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    nodes = json.loads(status("--etcd", etcd.endpoint, "--json"))["nodes"]
    assert {n["address"] for n in nodes} == {h.tcp_address for h in hosts}
    assert all(n["state"] == "up" and n["capacity_bytes"] == 64 << 20 for n in nodes)
    assert sum(n["hits"] for n in nodes) >= 9 and max(n["num_blocks"] for n in nodes) == 9
    table = status("--etcd", etcd.endpoint)
    assert all(h.tcp_address in table for h in hosts) and "hit rate" in table
    hosts[2].nodes[-1].kill()
    nodes = json.loads(status("--peers", peers, "--json"))["nodes"]
    states = {n["address"]: n["state"] for n in nodes}
    assert states == {
        hosts[0].tcp_address: "up",
        hosts[1].tcp_address: "up",
        hosts[2].tcp_address: "down",
    }
