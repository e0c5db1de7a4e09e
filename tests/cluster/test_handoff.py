"""A node leaving the cluster hands its blocks to the nodes that stay (``kvpool drain --to``):
one test per rule of kvpool.node.handoff, with real nodes on simulated hosts."""

from __future__ import annotations

import time

import pytest

from kvpool import Client, Status
from kvpool.client import ops
from kvpool.cluster.membership import Member
from kvpool.cluster.placement import homes
from kvpool.errors import BadRequest, Forbidden
from tests.cluster.fabric import ACCESS_KEY, Fabric
from tests.commands import run_kvpool
from tests.helpers import content, key

pytestmark = pytest.mark.cluster

BLOCK = 64 << 10


@pytest.fixture
def cluster():
    """Three nodes, every one a peer of the others; the hosts and the peers."""
    fabric = Fabric()
    hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts:
        host.start_node(peers=list(peers))
    yield hosts, peers
    fabric.close()


def _router(peers) -> Client:
    """A client on no node's host (an engine elsewhere): it writes to the keys' homes."""
    return Client(address="", peers=peers, access_key=ACCESS_KEY, timeout=10)


def _on_c_only(hosts) -> Client:
    """A client on c's host whose blocks stay on c (no write-through to their homes)."""
    return Client(**hosts[2].client_options(write_rcache=False), timeout=10)


def _handoff(host, targets, rate=256 << 20, deadline=30.0, seal=False):
    with Client(host.tcp_address, use_shm=False, access_key=ACCESS_KEY, timeout=10) as client:
        node = client._require_local()
        node_id = node.welcome.node_id
        return node.call(
            lambda _: ops.handoff(node_id, targets, rate, deadline, seal), deadline + 20
        )


def _holders(peers, keys) -> list[set[bytes]]:
    held = []
    for peer in peers:
        with Client(peer, use_shm=False, access_key=ACCESS_KEY, timeout=10) as client:
            held.append(
                {k for k, present in zip(keys, client.exists(keys), strict=True) if present}
            )
    return held


def test_a_drained_node_hands_its_blocks_to_their_homes_among_the_rest(cluster) -> None:
    """Rules 2 and 6 of the handoff, and decommission end to end: the blocks homed on c are
    on a and b after ``kvpool drain --to``, each at its home among them, and every block is
    found with c gone."""
    hosts, peers = cluster
    keys = [key(f"h{i}") for i in range(120)]
    with _router(peers) as router:
        assert router.put(keys, [content(k, BLOCK) for k in keys]).all_stored
        members = router.cluster.members()
    on_c = [k for k in keys if homes(k, members)[0].tcp_address == peers[2]]
    assert on_c and not (set(on_c) & set().union(*_holders(peers[:2], keys)))

    env = {"KVPOOL_ACCESS_KEY": ACCESS_KEY}
    drained = run_kvpool("drain", "--address", peers[2], "--to", ",".join(peers[:2]), env=env)
    assert drained.returncode == 0, drained.stderr
    assert f"handed {len(on_c)} blocks" in drained.stderr, drained.stderr
    assert hosts[2].nodes[-1].proc.wait(30) == 0  # then it stopped, emptied

    remaining = [Member(node_id=p, tcp_address=p) for p in peers[:2]]
    held_a, held_b = _holders(peers[:2], on_c)
    for k in on_c:  # each at its home among the nodes that stay
        home = homes(k, remaining)[0].tcp_address
        assert k in (held_a if home == peers[0] else held_b)
    with _router(peers) as router:  # c is gone: every block is found on a and b
        got = router.get(keys)
        assert all(s is Status.OK for s in got.statuses)
        for k, value in zip(keys, got.values, strict=True):
            assert bytes(value) == content(k, BLOCK).tobytes()


def test_the_hottest_blocks_go_first_and_the_rate_bounds_it(cluster) -> None:
    """Rules 1 and 3: at 1 MiB/s, a 1 s deadline hands one batch, of the blocks used last;
    the rest is left, and the handoff does not outlast its deadline."""
    hosts, peers = cluster
    with _on_c_only(hosts) as local:
        keys = [key(f"hot{i}") for i in range(600)]
        for start in range(0, len(keys), 100):
            assert local.put(
                keys[start : start + 100], [content(k, 4096) for k in keys[start : start + 100]]
            ).all_stored
        hot = keys[100:150]
        assert all(s is Status.OK for s in local.get(hot).statuses)  # used last
    started = time.monotonic()
    result = _handoff(hosts[2], list(peers[:2]), rate=1 << 20, deadline=1.0)
    assert time.monotonic() - started < 1.0 + 5.0  # its deadline, and one batch's send
    assert result.num_left > 0 and 0 < result.num_blocks <= 256
    held = set().union(*_holders(peers[:2], keys))
    assert set(hot) <= held


def test_a_target_that_is_down_fails_its_share_only(cluster) -> None:
    """Rule 4: the blocks of a target that does not answer fail; the others are handed."""
    hosts, peers = cluster
    with _on_c_only(hosts) as local:
        keys = [key(f"down{i}") for i in range(60)]
        assert local.put(keys, [content(k, 4096) for k in keys]).all_stored
    hosts[1].nodes[-1].kill()
    result = _handoff(hosts[2], list(peers[:2]), deadline=10.0)
    remaining = [Member(node_id=p, tcp_address=p) for p in peers[:2]]
    to_a = [k for k in keys if homes(k, remaining)[0].tcp_address == peers[0]]
    assert result.num_blocks >= len(to_a) and result.num_failed == len(keys) - len(to_a)


def test_only_operators_hand_a_node_off(cluster) -> None:
    """Rule 6: a client that has not proved the key is refused at the handshake; the node's
    id must be the node's own; a target must be another node's TCP address."""
    hosts, peers = cluster
    with Client(hosts[2].tcp_address, use_shm=False, access_key=ACCESS_KEY, timeout=5) as client:
        node = client._require_local()
        with pytest.raises(BadRequest):
            node.call(lambda _: ops.handoff("someone-else", [peers[0]], 1 << 20, 1.0), 10)
        node_id = node.welcome.node_id
        for target in ("unix:/tmp/x.sock", peers[2], "nonsense"):
            with pytest.raises(BadRequest):
                node.call(lambda _, t=target: ops.handoff(node_id, [t], 1 << 20, 1.0), 10)


def test_a_keyless_node_refuses_a_handoff_over_tcp(start_node) -> None:
    """Any local user reaches a keyless node's loopback port: a handoff (like a shutdown)
    needs its Unix socket."""
    node = start_node(name="keyless")
    with Client(node.tcp_address, use_shm=False, timeout=5) as client:
        local = client._require_local()
        node_id = local.welcome.node_id
        with pytest.raises(Forbidden):
            local.call(lambda _: ops.handoff(node_id, ["127.0.0.1:1"], 1 << 20, 1.0), 10)


@pytest.fixture
def tiered(tmp_path):
    """Three nodes, c with an 8 MiB arena over a disk tier (a and b as in ``cluster``)."""
    fabric = Fabric()
    hosts = [fabric.add_host(n) for n in ("a", "b", "c")]
    peers = tuple(h.tcp_address for h in hosts)
    for host in hosts[:2]:
        host.start_node(peers=list(peers))
    disk = ["--disk", str(tmp_path / "disk-c"), "--disk-size", "64MiB", "--scrub-rate", "0"]
    hosts[2].start_node(peers=list(peers), memory="8MiB", extra=disk)
    yield hosts, peers
    fabric.close()


def _fill_c(hosts, tag: str, n: int, size: int = 512 << 10) -> list[bytes]:
    """``n`` blocks on c alone, a few a put, so that DRAM's evictions reach the disk."""
    keys = [key(f"{tag}{i}") for i in range(n)]
    with _on_c_only(hosts) as local:
        for start in range(0, n, 2):
            batch = keys[start : start + 2]
            assert local.put(batch, [content(k, size) for k in batch]).all_stored
            time.sleep(0.02)
        deadline = time.monotonic() + 20
        while not all(local.exists(keys)):  # on its way to disk: there in a moment
            assert time.monotonic() < deadline, "blocks evicted before the disk took them"
            time.sleep(0.05)
        tiers = {t.name: t.num_blocks for t in local.stats().tiers}
    assert tiers["disk"] > n // 2 and tiers["dram"] > 0, tiers  # most of them on disk
    return keys


def test_a_drain_hands_the_disk_tier_too_and_empties_only_then(tiered) -> None:
    """Rule 1, from an operator's side: a node holding 40 blocks, most of them on its disk
    (before the fix: "handed 7, 0 failed, 0 left" and the 33 on disk destroyed).  Every
    block is handed, the disk's among them, ``kvpool drain`` exits 0 and empties the node,
    and every block is found on the nodes that stay."""
    hosts, peers = tiered
    keys = _fill_c(hosts, "disk", 40)
    env = {"KVPOOL_ACCESS_KEY": ACCESS_KEY}
    drained = run_kvpool("drain", "--address", peers[2], "--to", ",".join(peers[:2]), env=env)
    said = " ".join(drained.stderr.split())
    assert drained.returncode == 0, said
    assert "handed 40 blocks" in said and "0 failed, 0 left" in said, said
    assert hosts[2].nodes[-1].proc.wait(30) == 0  # stopped, emptied
    assert set().union(*_holders(peers[:2], keys)) == set(keys)
    with _router(peers[:2]) as router:
        got = router.get(keys)
        for k, value in zip(keys, got.values, strict=True):
            assert value is not None and bytes(value) == content(k, 512 << 10).tobytes()


def test_a_drain_that_cannot_place_everything_keeps_the_node(tiered) -> None:
    """Rules 1 and 5, the fault's side: both targets down.  ``kvpool drain`` says what failed,
    exits 1 and keeps the node, serving, with every block (before the fix: "0 handed, 10
    failed", exit 0, the node emptied); writes are taken again.  Only --discard-unplaced
    empties it, and the exit status still says not everything was placed."""
    hosts, peers = tiered
    keys = _fill_c(hosts, "kept", 40)
    for host in hosts[:2]:
        host.nodes[-1].kill()
    env = {"KVPOOL_ACCESS_KEY": ACCESS_KEY}
    args = ["drain", "--address", peers[2], "--to", ",".join(peers[:2]), "--deadline", "10"]
    drained = run_kvpool(*args, env=env)
    said = " ".join(drained.stderr.split())
    assert drained.returncode == 1, said
    assert "40 failed" in said and "the node is kept" in said, said
    node = hosts[2].nodes[-1]
    assert node.is_running
    with _on_c_only(hosts) as local:
        assert all(local.exists(keys))
        assert local.put([key("after")], [b"x" * 4096]).all_stored  # not sealed
    discarded = run_kvpool(*args, "--discard-unplaced", env=env)
    assert discarded.returncode == 1, discarded.stderr
    assert node.proc.wait(30) == 0  # told to: emptied


def test_blocks_written_during_a_handoff_are_handed_and_a_sealed_node_takes_no_more(
    cluster,
) -> None:
    """Rules 1 and 5: a writer keeps putting blocks on c while a slow handoff (1 MiB/s)
    runs; every block c accepted is on a or b afterwards (the passes after the first took
    those written meanwhile), nothing is left, and once sealed c refuses new blocks (a
    value: not stored here), so nothing lands between the report and the drain."""
    import threading

    hosts, peers = cluster
    size = 4096  # 600 of them: three batches at 1 MiB/s, about 2.3 s
    first = [key(f"w0-{i}") for i in range(600)]
    with _on_c_only(hosts) as local:
        for start in range(0, len(first), 100):
            batch = first[start : start + 100]
            assert local.put(batch, [content(k, size) for k in batch]).all_stored
    stored: list[bytes] = []
    stop = threading.Event()

    def write() -> None:
        with _on_c_only(hosts) as writer:
            i = 0
            while not stop.is_set() and i < 200:
                batch = [key(f"w1-{i}"), key(f"w1-{i + 1}")]
                result = writer.put(batch, [content(k, size) for k in batch])
                stored.extend(k for k, s in zip(batch, result.statuses, strict=True) if s == 0)
                i += 2
                time.sleep(0.05)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    time.sleep(0.5)
    result = _handoff(hosts[2], list(peers[:2]), rate=1 << 20, deadline=60.0, seal=True)
    stop.set()
    thread.join(10)
    assert stored and result.num_written > 0, result
    assert result.num_failed == 0 and result.num_left == 0 and result.is_sealed, result
    assert set(first + stored) <= set().union(*_holders(peers[:2], first + stored))
    with _on_c_only(hosts) as local:
        refused = local.put([key("sealed")], [content(key("sealed"), size)])
        assert refused.statuses == [Status.REFUSED]
