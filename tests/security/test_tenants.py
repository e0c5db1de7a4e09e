"""Tenants, tried as a hostile tenant would: a real daemon, a tenants file, real sockets.

Tenant ``beta`` holds valid credentials of its own and tries every path to ``alpha``'s
blocks (lookups, reads, deletes, prefetch, statistics, the shared-memory path, the admin
HTTP, the lower tiers); it sees only misses or refusals, and alpha loses nothing.
"""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpool import AuthenticationError, Forbidden, Namespace, NodeUnavailable, Status
from kvpool.client import ops
from kvpool.protocol.frames import HEADER_BYTES, encode_frame
from kvpool.protocol.messages import (
    GetRequest,
    LookupRequest,
    Op,
    PinRequest,
    PinResponse,
    PutRequest,
    ReserveRequest,
    ReserveResponse,
    ShutdownRequest,
    StatusResponse,
)
from tests.conftest import NodeFactory
from tests.security.tenants import CLUSTER, TenantsFile, client, raw_connection, send

NS = Namespace(model="tiny", dtype="float32")
BLOCK = 256 << 10


def keys(n: int, start: int = 0) -> list[bytes]:
    return [NS.key(f"block-{i}".encode()) for i in range(start, start + n)]


def values(n: int, fill: int) -> list[bytes]:
    return [bytes([fill]) * BLOCK for _ in range(n)]


@pytest.fixture
def tenants(tmp_path: Path) -> TenantsFile:
    return TenantsFile(tmp_path / "tenants.toml")


@pytest.fixture
def credentials(tenants: TenantsFile) -> dict[str, list[tuple[str, str]]]:
    made = {
        "alpha": tenants.add("alpha", quota="8MiB", keys=2),
        "beta": tenants.add("beta", quota="8MiB", max_connections=4),
    }
    tenants.write()
    return made


@pytest.fixture
def pool(start_node: NodeFactory, tenants: TenantsFile, credentials, tmp_path: Path):
    return start_node(
        "tenants",
        "12MiB",  # less than the quotas together: eviction must respect them
        extra=[
            "--tenants",
            str(tenants.path),
            "--disk",
            str(tmp_path / "disk"),
            "--disk-size",
            "32MiB",
        ],
        env={"KVPOOL_RESERVE_LEASE": "3", "KVPOOL_PIN_LEASE": "3"},
    )


def admin(url: str, credential: tuple[str, str] | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if credential is not None:
        token = base64.b64encode(f"{credential[0]}:{credential[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_another_tenant_sees_only_misses_and_refusals(pool, credentials) -> None:
    alpha, beta = credentials["alpha"][0], credentials["beta"][0]
    mine = keys(4)
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        assert a.put(mine, values(4, 0xA1)).all_stored
        a.describe(NS)
    with client(pool.unix_address, beta) as b:  # same host, asking for the arena too
        assert b.lookup(mine) == 0
        assert b.lookup_state(mine, prefetch=5).num_prefix == 0
        assert b.exists(mine) == [False] * 4
        assert b.get(mine).statuses == [Status.NOT_FOUND] * 4
        assert b.delete(mine) == [Status.NOT_FOUND] * 4
        answer = b.prefetch(mine, hold=5)
        assert (answer.num_in_dram, answer.num_started, answer.num_absent) == (0, 0, 4)
        stats = b.stats()
        assert (stats.num_blocks, stats.used_bytes, stats.namespaces) == (0, 0, [])
        assert stats.capacity_bytes == 8 << 20 and stats.tiers == []

    # The shared-memory path is not a tenant's: no arena in the welcome, and the requests
    # that hand out arena offsets are refused, as is a shutdown.
    with raw_connection(pool.unix_address, beta) as raw:
        assert raw.welcome.arena_path == "" and raw.welcome.arena_bytes == 0
        for op, message, response in (
            (Op.RESERVE, ReserveRequest(keys=mine, sizes=[BLOCK] * 4), ReserveResponse),
            (Op.PIN, PinRequest(keys=mine), PinResponse),
            (Op.SHUTDOWN, ShutdownRequest(node_id="tenants"), StatusResponse),
        ):
            with pytest.raises(Forbidden, match="not open to tenants"):
                send(raw, op, message, response)
    with raw_connection(pool.unix_address, CLUSTER) as raw:  # the cluster's identity has it
        assert raw.welcome.arena_bytes > 0

    # The same prompt in two tenants: two different keys, two different blocks.
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.put(mine, values(4, 0xB2)).all_stored
        b.describe(NS)
        assert [bytes(v) for v in b.get(mine).values] == values(4, 0xB2)
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        assert [bytes(v) for v in a.get(mine).values] == values(4, 0xA1)
    with client(pool.tcp_address, CLUSTER, use_shm=False) as operator:
        rows = operator.stats().namespaces
        ids = {row.namespace_id for row in rows if row.num_blocks}
        assert len(ids) == 2 and NS.id.hex() not in ids
        assert operator.lookup(mine) == 0  # the client's key names nobody's block

    # The admin HTTP: credentials needed; a tenant sees only its own status, not the
    # node's metrics; the cluster's identity sees everything.
    assert admin(pool.admin_url + "/v1/status", None)[0] == 401
    assert admin(pool.admin_url + "/v1/status", ("beta-1", "wrong" * 4))[0] == 401
    assert admin(pool.admin_url + "/healthz", None)[0] == 200
    status, body = admin(pool.admin_url + "/v1/status", beta)
    seen = json.loads(body)
    assert status == 200 and seen["num_blocks"] == 4 and len(seen["namespaces"]) == 1
    assert admin(pool.admin_url + "/metrics", beta)[0] == 403
    status, body = admin(pool.admin_url + "/v1/status", CLUSTER)
    assert status == 200 and len(json.loads(body)["namespaces"]) == 2
    assert admin(pool.admin_url + "/metrics", CLUSTER)[0] == 200


def test_quota_evicts_the_writers_own_blocks_never_anothers(pool, credentials) -> None:
    alpha, beta = credentials["alpha"][0], credentials["beta"][0]
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.put(keys(24, 1000), values(24, 0xB0)).all_stored  # 6 MiB of its 8
        before = b.stats()
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        for batch in range(12):  # 12 MiB through a quota of 8, where 6 are free
            assert a.put(keys(4, batch * 4), values(4, batch)).all_stored
            assert a.stats().used_bytes <= 8 << 20
        # Its oldest blocks left DRAM for the disk; its newest are in DRAM.
        state = a.lookup_state(keys(4, 44))
        assert state.num_prefix == 4 and state.num_in(0) == 4
        assert a.lookup_state(keys(4, 0)).num_in(0) == 0
    with client(pool.tcp_address, beta, use_shm=False) as b:
        after = b.stats()
        assert (after.num_blocks, after.used_bytes) == (before.num_blocks, before.used_bytes)
        state = b.lookup_state(keys(24, 1000))
        assert state.num_prefix == 24 and state.num_in(0) == 24  # all still in DRAM
        assert [bytes(v) for v in b.get(keys(24, 1000)).values] == values(24, 0xB0)


def test_a_tenants_account_shows_its_arena_and_disk_bytes_with_their_limits(
    pool, credentials
) -> None:
    """Status reads every tenant's budgets from its account alone: the arena's bytes (its
    quota) and the disk's (its share of the disk: half, as its quota is half of all)."""
    beta = credentials["beta"][0]
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.put(keys(6, 500), values(6, 0xB2)).all_stored
        [account] = b.stats().accounts
    assert account.tenant == "beta"
    assert account.used["arena_bytes"] == 6 * BLOCK and account.limits["arena_bytes"] == 8 << 20
    assert account.used["disk_bytes"] == 0 and account.limits["disk_bytes"] == 16 << 20
    with client(pool.tcp_address, CLUSTER, use_shm=False) as operator:
        rows = {row.tenant: row for row in operator.stats().accounts}
    assert rows["beta"].used["arena_bytes"] == 6 * BLOCK
    assert rows["alpha"].used["arena_bytes"] == 0 and rows["alpha"].limits["arena_bytes"] == 8 << 20


def test_a_tenant_that_reserves_its_quota_and_stalls(pool, credentials) -> None:
    alpha, other_alpha = credentials["alpha"]
    beta = credentials["beta"][0]
    # A PUT that declares alpha's whole quota and never sends the bytes: the node reserves
    # it, and cuts the connection once the reservation's lease (3 s here) runs out.
    with raw_connection(pool.tcp_address, alpha) as raw:
        request = PutRequest(keys=keys(32, 500), sizes=[BLOCK] * 32)

        def stall() -> ops.Op_[None]:
            yield ops.Request(Op.PUT, request, payload_len=32 * (BLOCK + 8))
            yield ops.Send([b"\0" * 8])  # a checksum, then nothing

        raw.run(stall(), time.monotonic() + 5)
        with client(pool.tcp_address, other_alpha, use_shm=False) as a:
            deadline = time.monotonic() + 5
            while (status := a.put(keys(1, 900), values(1, 9)).statuses) != [Status.OVER_QUOTA]:
                assert status == [Status.OK] and time.monotonic() < deadline
                a.delete(keys(1, 900))  # (before the node saw the stalled PUT)
                time.sleep(0.05)
        with client(pool.tcp_address, beta, use_shm=False) as b:  # others are served
            assert b.put(keys(8, 600), values(8, 0xBB)).all_stored
        # Past the lease, the stalled connection is cut and the quota is alpha's again.
        with client(pool.tcp_address, other_alpha, use_shm=False) as a:
            deadline = time.monotonic() + 20
            while a.put(keys(1, 900), values(1, 9)).statuses != [Status.OK]:
                assert time.monotonic() < deadline, "the stalled reservation was never cut"
                time.sleep(0.05)
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert [bytes(v) for v in b.get(keys(8, 600)).values] == values(8, 0xBB)


def test_a_slow_reader_is_cut_off_and_its_pins_dropped(pool, credentials) -> None:
    beta = credentials["beta"][0]
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.put(keys(24, 0), values(24, 3)).all_stored
    with raw_connection(pool.tcp_address, beta) as raw:

        def ask() -> ops.Op_[None]:
            yield ops.Request(Op.GET, GetRequest(keys=keys(24, 0)))

        raw.run(ask(), time.monotonic() + 5)
        # It never reads its 6 MiB: past the pin lease (3 s here) the node gives up.
        with client(pool.tcp_address, CLUSTER, use_shm=False) as operator:
            deadline = time.monotonic() + 15
            while operator.stats().num_pinned:
                assert time.monotonic() < deadline, "a slow reader kept its pins"
                time.sleep(0.05)
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.lookup(keys(24, 0)) == 24


def test_revoked_and_rotated_keys_need_no_restart(pool, tenants, credentials) -> None:
    first, second = credentials["alpha"]
    with (
        client(pool.tcp_address, first, use_shm=False) as a1,
        client(pool.tcp_address, second, use_shm=False) as a2,
    ):
        assert a2.put(keys(2), values(2, 7)).all_stored
        assert a1.lookup(keys(2)) == 2  # one tenant, two keys
        # The operator revokes the second key and adds a third.
        del tenants.tenants["alpha"]["keys"][second[0]]
        third = ("alpha-3", "a-new-key-" + "3" * 16)
        tenants.tenants["alpha"]["keys"][third[0]] = third[1]
        tenants.write()
        deadline = time.monotonic() + 10
        while True:  # the open connection is closed; reconnecting is refused
            try:
                a2.lookup(keys(2))
            except AuthenticationError:
                break
            except NodeUnavailable:
                pass
            assert time.monotonic() < deadline, "a revoked key kept working"
            time.sleep(0.05)
        assert a1.lookup(keys(2)) == 2  # the other key's connection was left alone
    with client(pool.tcp_address, third, use_shm=False) as a3:
        assert [bytes(v) for v in a3.get(keys(2)).values] == values(2, 7)
    with (
        client(pool.tcp_address, second, use_shm=False) as again,
        pytest.raises(AuthenticationError),
    ):
        again.lookup(keys(2))
    assert pool.is_running


def test_connection_caps_and_thousands_of_idle_connections(pool, credentials) -> None:
    alpha, beta = credentials["alpha"][0], credentials["beta"][0]
    host, port = pool.tcp_address.rsplit(":", 1)
    # Two thousand sockets that never authenticate: each is closed after the handshake
    # timeout, and nobody else waits meanwhile.
    idle = [socket.create_connection((host, int(port))) for _ in range(2000)]
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        started = time.monotonic()
        assert a.put(keys(4), values(4, 1)).all_stored and a.lookup(keys(4)) == 4
        assert time.monotonic() - started < 5
    # An authenticated slow writer: a request's header, and its metadata never.
    slow = raw_connection(pool.tcp_address, alpha)
    stalled = slow.__enter__()
    frame = encode_frame(Op.LOOKUP, LookupRequest(keys=keys(4)), request_id=7)
    stalled.channel.send([frame[:HEADER_BYTES]])
    # Beta may hold 4 connections at once: the fifth is refused, clearly.
    opened = []
    for _ in range(4):
        opened.append(raw_connection(pool.tcp_address, beta))
        opened[-1].__enter__()
    with (
        pytest.raises(NodeUnavailable, match="4 connections open"),
        raw_connection(pool.tcp_address, beta),
    ):
        pass
    with client(pool.tcp_address, alpha, use_shm=False) as a:  # alpha is not beta
        assert a.lookup(keys(4)) == 4
    opened.pop().__exit__(None, None, None)
    deadline = time.monotonic() + 10
    while True:  # once the node has seen that one close, another may open
        try:
            with raw_connection(pool.tcp_address, beta) as fifth:
                assert fifth.welcome.node_id == "tenants"
            break
        except NodeUnavailable as exc:
            assert "4 connections open" in str(exc) and time.monotonic() < deadline
            time.sleep(0.02)
    for connection in opened:
        connection.__exit__(None, None, None)
    # The idle sockets got the node's challenge, then, past the handshake timeout (10 s
    # from their start), EOF: read until it comes, within the 16 s they had before.
    deadline = time.monotonic() + 16
    closed = 0
    for sock in idle[:50]:
        data = b"x"
        while data:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            data = sock.recv(65536)
        closed += 1
    assert closed == 50
    stalled.channel.sock.settimeout(max(deadline - time.monotonic(), 0.01))
    assert stalled.channel.sock.recv(1) == b""  # cut off, past 10 s without its metadata
    slow.__exit__(None, None, None)
    for sock in idle:
        sock.close()
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        assert a.lookup(keys(4)) == 4


def test_empty_blocks_cost_their_tenant_the_pages_they_take(start_node, tenants) -> None:
    """From the attacker's side: a tenant with a 16 KiB quota stores thousands of empty
    blocks.  Each takes an arena page whatever its size, so each counts a page against
    its quota: the tenant keeps at most 4, and another tenant's 1 MiB still fits."""
    small = tenants.add("small", quota="16KiB")[0]
    other = tenants.add("other", quota="4MiB")[0]
    tenants.write()
    node = start_node("pages", "4MiB", extra=["--tenants", str(tenants.path)])
    with client(node.tcp_address, small, use_shm=False) as attacker:
        for batch in range(8):
            attacker.put(keys(256, batch * 256), [b""] * 256)
        held = attacker.stats()
        assert held.num_blocks <= 4 and held.used_bytes <= 16 << 10, held
    with client(node.tcp_address, other, use_shm=False) as victim:
        assert victim.put(keys(1, 9000), [b"v" * (1 << 20)]).all_stored
    with client(node.tcp_address, CLUSTER, use_shm=False) as cluster:
        assert cluster.stats().used_bytes <= (16 << 10) + (1 << 20) + (64 << 10)


def test_one_tenants_namespaces_cannot_crowd_out_anothers(pool, credentials) -> None:
    """From the attacker's side: alpha DESCRIBEs 2,000 namespaces (more than the node's
    table holds); beta's own namespace still gets its row, label and statistics."""
    alpha, beta = credentials["alpha"][0], credentials["beta"][0]
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        for i in range(2000):
            a.describe(Namespace(model=f"flood-{i}"))
    mine = Namespace(model="beta-model")
    with client(pool.tcp_address, beta, use_shm=False) as b:
        b.describe(mine)
        assert b.put([mine.key(b"k" * 32)], [b"b" * BLOCK]).all_stored
        rows = {row.label: row for row in b.stats().namespaces}
    assert "beta-model" in rows and rows["beta-model"].num_blocks == 1, sorted(rows)[:5]


def test_a_tenants_retention_hints_stop_at_its_account_and_never_reach_anothers(
    pool, credentials
) -> None:
    """Beta asks to keep everything it has at the highest priority, for ever, and to keep
    alpha's blocks too: its hints past its account (a quarter of its 8 MiB quota: 8 blocks
    of 256 KiB) are refused and counted, and alpha's keys are not even names it can reach."""
    alpha, beta = credentials["alpha"][0], credentials["beta"][0]
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        assert a.put(keys(4, 3000), values(4, 0xA1)).all_stored
    with client(pool.tcp_address, beta, use_shm=False) as b:
        assert b.put(keys(16, 2000), values(16, 0xB1)).all_stored
        retained = b.retain(keys(16, 2000), 100)
        assert (retained.num_retained, retained.num_refused) == (8, 8)
        assert b.retain(keys(4, 3000), 100).num_missing == 4  # alpha's: not beta's to name
        [account] = b.stats().accounts
        assert account.used["retained_bytes"] == 8 * BLOCK
        assert account.limits["retained_bytes"] == 2 << 20
        assert account.refused["retained_bytes"] == 8
    status, body = admin(pool.admin_url + "/metrics", CLUSTER)  # what the operator sees
    assert status == 200 and b"kvpool_retention_refused_total" in body
    [line] = [x for x in body.decode().splitlines() if x.startswith("kvpool_retention_refused")]
    assert float(line.split()[-1]) == 8
    with client(pool.tcp_address, alpha, use_shm=False) as a:
        assert a.retain(keys(4, 3000), 90, 60).num_retained == 4  # its own account is whole


def test_a_tenant_naming_an_engine_to_routers_is_forbidden(
    start_node: NodeFactory, tenants: TenantsFile, credentials
) -> None:
    """From the attacker's side: tenant beta, on a node that tells Kthena's routers which
    engine loads a namespace, sends a raw DESCRIBE naming a pod of its choosing (it could
    steer the routers with its own blocks).  The refusal is who-may-do-what, decided before
    any handler runs: FORBIDDEN on the wire (not a bad request), the connection kept; the
    same DESCRIBE without the engine is still the tenant's to send."""
    from kvpool.cli.bench_peers import RedisPeer
    from kvpool.keys import EngineRef
    from kvpool.protocol.messages import DescribeRequest, Empty

    (beta,) = credentials["beta"]
    redis = RedisPeer()
    try:
        node = start_node(
            "tenants-kthena",
            "12MiB",
            extra=[
                "--tenants",
                str(tenants.path),
                "--kthena-redis",
                f"redis://127.0.0.1:{redis.port}/0",
            ],
        )
        engine = EngineRef(pod="someone-elses-pod", model="tiny")
        with raw_connection(node.tcp_address, beta) as raw:
            named = DescribeRequest(namespace_id=NS.id, label="tiny", engine=engine)
            with pytest.raises(Forbidden, match="cannot name an engine"):
                send(raw, Op.DESCRIBE, named, Empty)
            plain = DescribeRequest(namespace_id=NS.id, label="tiny")
            assert isinstance(send(raw, Op.DESCRIBE, plain, Empty), Empty)
        node.stop()
    finally:
        redis.close()
