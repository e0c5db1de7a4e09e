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


def _handoff(host, targets, rate=256 << 20, deadline=30.0):
    with Client(host.tcp_address, use_shm=False, access_key=ACCESS_KEY, timeout=10) as client:
        node = client._require_local()
        node_id = node.welcome.node_id
        return node.call(lambda _: ops.handoff(node_id, targets, rate, deadline), deadline + 20)


def _holders(peers, keys) -> list[set[bytes]]:
    held = []
    for peer in peers:
        with Client(peer, use_shm=False, access_key=ACCESS_KEY, timeout=10) as client:
            held.append(
                {k for k, present in zip(keys, client.exists(keys), strict=True) if present}
            )
    return held


def test_a_drained_node_hands_its_blocks_to_their_homes_among_the_rest(cluster) -> None:
    """Rules 2 and 5 of the handoff, and decommission end to end: the blocks homed on c are
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
    """Rule 5: a client that has not proved the key is refused at the handshake; the node's
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
