"""Fair under attack (issue 43): no tenant, and no stranger, takes the node's or the router's
CPU, memory, connections or budgets from the others.

One test per attack of the issue, each run as the attacker runs it, against a real
``kvpool serve`` (or ``kvpool router``) over real sockets, scaled down with the node's
options where the mechanism is the same at a small size:

1. a stranger's bodies parsed by the router before its credential is checked;
2. parked lookups rescanned on every change of the store;
3. label changes growing the journal;
4. connection buffers grown by one large frame and kept;
5. strangers holding the node's connection slots;
6. a label shown as console markup by ``kvpool status``;
7. directories another local user can rename;
8. one tenant taking the node's whole prefetch-hold budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvpool import BadRequest, Client, Namespace
from kvpool.client.connection import Connection
from kvpool.harness.process import NodeProcess
from kvpool.protocol.frames import HEADER, MAGIC, encode_frame
from kvpool.protocol.messages import (
    PROTOCOL_VERSION,
    DescribeRequest,
    LookupRequest,
    LookupResponse,
    Op,
)
from kvpool.stats import TIER_DISK, AccountStats
from tests.commands import run_kvpool, said, serve
from tests.conftest import NodeFactory
from tests.helpers import rss_anon_kib
from tests.router.servers import FakeEngine, RouterProc
from tests.security.tenants import CLUSTER, TenantsFile, raw_connection
from tests.tiered import wait_written

NS = Namespace(model="fair")
CLUSTER_ENV = {"KVPOOL_ACCESS_ID": CLUSTER[0], "KVPOOL_ACCESS_KEY": CLUSTER[1]}


def keyed(node: NodeProcess, credential: tuple[str, str], **options: object) -> Client:
    return Client(
        node.tcp_address,
        access_id=credential[0],
        access_key=credential[1],
        use_shm=False,
        timeout=10,
        **options,
    )


def account(client: Client) -> AccountStats:
    """The tenant's own account, as its status shows it."""
    [row] = client.stats().accounts
    return row


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system): what it spent, whatever else runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def until(predicate, timeout: float = 20.0, what: str = "") -> None:
    """Wait for ``predicate`` (polled), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def send_frame(conn: Connection, op: Op, message: msgspec.Struct, request_id: int = 1) -> None:
    conn.channel.send([encode_frame(op, message, request_id=request_id)])


def read_reply(conn: Connection, timeout: float = 10.0) -> tuple[int, bytes]:
    """A reply's status and metadata, read as they come."""
    conn.channel.deadline = time.monotonic() + timeout
    header = conn.channel.recv_header()
    return header.status, bytes(conn.channel.recv_meta(header.meta_len))


@pytest.fixture
def tenants(tmp_path: Path) -> TenantsFile:
    return TenantsFile(tmp_path / "tenants.toml")


# -- 1. the router reads nothing before the credential ------------------------------------


def _post_head(length: int, authorization: str = "") -> bytes:
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: router",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_the_router_reads_no_body_before_the_credential(tenants: TenantsFile) -> None:
    """A stranger announces a 30 MiB body: the router answers 401 from the headers, before
    a byte of it arrives (it used to read it all and parse it on its event loop first).
    Three such bodies of ``[{},{},...]`` sent whole leave the router's heap as it was; a
    tenant's own body past the cap is refused, and its requests are served."""
    beta = tenants.add("beta")[0]
    tenants.write()
    engine = FakeEngine("beta-engine")
    router = RouterProc(
        [f"{engine.url},tenants=beta"], "--tenants", str(tenants.path), env=CLUSTER_ENV
    )
    try:
        address = ("127.0.0.1", router.port)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(_post_head(30 << 20))  # and no body at all
            assert sock.recv(4096).startswith(b"HTTP/1.1 401")
        before = rss_anon_kib(router.proc.pid)
        body = b"[" + b"{}," * (10 << 20) + b"{}]"  # 30 MiB, 10 million objects
        for _ in range(3):
            # It may hang up before the body ends.
            with socket.create_connection(address, 10) as sock, contextlib.suppress(OSError):
                sock.sendall(_post_head(len(body)) + body)
                sock.recv(4096)
        grown_kib = rss_anon_kib(router.proc.pid) - before
        assert grown_kib < 32 << 10, f"the router's heap grew by {grown_kib >> 10} MiB"
        token = "Basic " + b64encode(f"{beta[0]}:{beta[1]}".encode()).decode()
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(_post_head(8 << 20, token))  # past the 4 MiB cap: refused unread
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")
        request = urllib.request.Request(
            router.url + "/v1/completions",
            json.dumps({"model": "m", "prompt": "beta's prompt", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json", "Authorization": token},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    finally:
        router.stop()
        engine.stop()


# -- 2. parked lookups are woken by their key ---------------------------------------------


def test_parked_lookups_cost_the_node_what_they_find(
    start_node: NodeFactory, tenants: TenantsFile
) -> None:
    """Tenant alpha parks 16 lookups of 4,096 keys (all held but the last) for 30 s, its
    whole budget of parked keys: tenant beta's commits cost the node what they cost
    without them (each used to wake every parked lookup to scan all its keys again).  A
    lookup that waits and names a key twice is refused; one past the budget answers at
    once; the key they wait for wakes them all."""
    alpha = tenants.add("alpha", quota="20MiB")[0]
    beta = tenants.add("beta", quota="8MiB")[0]
    tenants.write()
    # No scrubber: the daemon's CPU time is then its requests' alone.
    node = start_node(
        "parked", "64MiB", extra=["--tenants", str(tenants.path), "--scrub-rate", "0"]
    )
    held = [NS.key(b"held-%d" % i) for i in range(4095)]
    absent = NS.key(b"absent")
    keys = [*held, absent]

    def beta_commits(tag: str) -> float:
        """The daemon's CPU seconds for 300 of beta's puts."""
        started = cpu_seconds(node.pid)
        with keyed(node, beta) as b:
            for i in range(300):
                assert b.put([NS.key(f"{tag}-{i}".encode())], [b"x" * 64]).all_stored
        return cpu_seconds(node.pid) - started

    with keyed(node, alpha) as a:
        for start in range(0, len(held), 1024):
            batch = held[start : start + 1024]
            assert a.put(batch, [b""] * len(batch)).all_stored
        with pytest.raises(BadRequest, match="each key once"):
            a.lookup([held[0], held[0], absent], wait=1.0, wait_absent=True)
        quiet = beta_commits("quiet")
        with contextlib.ExitStack() as stack:
            parked = [
                stack.enter_context(raw_connection(node.tcp_address, alpha)) for _ in range(16)
            ]
            for conn in parked:
                send_frame(
                    conn, Op.LOOKUP, LookupRequest(keys=keys, wait_ms=30_000, wait_absent=True)
                )
            until(lambda: account(a).used["parked_keys"] == 16 * len(keys), what="parking")
            started = time.monotonic()
            assert a.lookup(keys, wait=30.0, wait_absent=True) == len(
                held
            )  # past the budget: answered now
            assert time.monotonic() - started < 5
            busy = beta_commits("busy")
            assert busy < 2 * quiet + 0.1, (
                f"beta's commits: {busy:.2f} s of CPU, {quiet:.2f} s alone"
            )
            assert a.put([absent], [b""]).all_stored  # what they wait for
            for conn in parked:
                status, meta = read_reply(conn)
                assert status == 0
                assert msgspec.msgpack.decode(meta, type=LookupResponse).num_prefix == len(keys)
        until(lambda: account(a).used["parked_keys"] == 0, what="the lookups to answer")


# -- 3. label changes cannot grow the journal ---------------------------------------------


def test_label_changes_cannot_grow_the_journal(
    start_node: NodeFactory, tenants: TenantsFile
) -> None:
    """Tenant alpha pipelines 20,000 DESCRIBEs alternating two 256-character labels over 16
    connections (each change a ~300-byte journal record; 6 MB of journal within two
    seconds before): past a burst its label changes are refused at its rate, each refusal
    answered only once a change would have come back (so each connection gets about one
    answer a second), the journal, compacted by its bytes, stays small, and beta is served
    meanwhile."""
    alpha = tenants.add("alpha")[0]
    beta = tenants.add("beta")[0]
    tenants.write()
    node = start_node("labels", extra=["--tenants", str(tenants.path)])
    labels = ["a" * 256, "b" * 256]
    with contextlib.ExitStack() as stack:
        floods = [stack.enter_context(raw_connection(node.tcp_address, alpha)) for _ in range(16)]

        def flood(conn: Connection, first: int) -> None:
            frames = [
                encode_frame(
                    Op.DESCRIBE,
                    DescribeRequest(namespace_id=NS.id, label=labels[i % 2]),
                    request_id=i + 1,
                )
                for i in range(first, first + 1250)
            ]
            conn.channel.deadline = time.monotonic() + 60
            with contextlib.suppress(OSError, TimeoutError):  # closed when the test ends
                conn.channel.send(frames)

        senders = [
            threading.Thread(target=flood, args=(conn, 1250 * n), daemon=True)
            for n, conn in enumerate(floods)
        ]
        for sender in senders:
            sender.start()
        with keyed(node, alpha, max_connections=1) as a, keyed(node, beta) as b:
            until(
                lambda: account(a).refused.get("label_changes", 0) >= 16,
                what="the burst of label changes to be spent",
            )
            started = time.monotonic()
            assert b.lookup([NS.key(b"beta")]) == 0
            assert time.monotonic() - started < 2
            changes = account(a)
        journal = Path(node.info["arena"]).parent / "index"
        assert journal.stat().st_size < 2 << 20, f"a journal of {journal.stat().st_size} bytes"
        assert changes.used["label_changes"] >= 120  # the burst, spent
        # Each connection is answered about once a second past the burst: far fewer
        # refusals than DESCRIBEs sent.
        assert changes.refused["label_changes"] < 200
        for conn in floods:
            conn.channel.sock.close()


# -- 4. a connection's buffers are its tenant's, and returned ------------------------------


def _undecodable_frame(meta_bytes: int) -> bytes:
    """A LOOKUP announcing ``meta_bytes`` of metadata that no decoder takes (0xc1 is a byte
    msgpack never uses): the node refuses it, its framing intact."""
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.LOOKUP, 0, 0, 9, meta_bytes, 0)
    return head + b"\xc1" * meta_bytes


def test_connection_buffers_are_returned_after_each_frame(
    start_node: NodeFactory, tenants: TenantsFile
) -> None:
    """Tenant alpha sends one undecodable 4 MiB frame on each of 32 connections and keeps
    them open: the daemon's heap does not keep 4 MiB per connection (it did, for ever).
    Eight more send half of such a frame and stall: what they hold stays within alpha's
    16 MiB budget of buffers, beta is served meanwhile, and alpha's idle connections are
    closed after the idle timeout."""
    alpha = tenants.add("alpha", max_connections=64)[0]
    beta = tenants.add("beta")[0]
    tenants.write()
    node = start_node(
        "buffers",
        extra=[
            *("--tenants", str(tenants.path)),
            *("--tenant-buffer-bytes", "16MiB", "--idle-timeout", "3"),
        ],
    )
    before = rss_anon_kib(node.pid)
    with contextlib.ExitStack() as stack:
        for _ in range(32):  # 256 KiB of read-ahead each, and one 4 MiB frame
            conn = stack.enter_context(raw_connection(node.tcp_address, alpha))
            conn.channel.send([_undecodable_frame(4 << 20)])
            status, _ = read_reply(conn)
            assert status != 0  # refused, the connection kept
        grown_kib = rss_anon_kib(node.pid) - before
        assert grown_kib < 24 << 10, f"the daemon's heap grew by {grown_kib >> 10} MiB"
        stalled = [stack.enter_context(raw_connection(node.tcp_address, alpha)) for _ in range(8)]
        for conn in stalled:
            conn.channel.send([_undecodable_frame(4 << 20)[: 2 << 20]])
        with keyed(node, beta) as b, keyed(node, alpha, max_connections=1) as a:
            until(lambda: account(a).used["buffer_bytes"] > 12 << 20, what="the stalled frames")
            assert account(a).used["buffer_bytes"] <= 16 << 20
            started = time.monotonic()
            assert b.lookup([NS.key(b"beta")]) == 0
            assert time.monotonic() - started < 2
            # Idle past 3 s: closed (the stalled ones are cut by the frame deadline).
            until(lambda: account(a).used["connections"] <= 9, what="the idle timeout")


# -- 5. strangers crowd out only each other -----------------------------------------------


def test_strangers_cannot_lock_a_tenant_out(start_node: NodeFactory, tenants: TenantsFile) -> None:
    """A stranger on eight addresses opens 1,500 connections and never says HELLO: they
    share a pool of 64 (8 an address), the oldest closed as new ones come, and tenant
    beta's 30 handshakes meanwhile all succeed (a stranger used to hold a slot of the
    tenants' for 10 s from its accept)."""
    beta = tenants.add("beta")[0]
    tenants.write()
    node = start_node(
        "strangers",
        extra=[
            *("--tenants", str(tenants.path)),
            *("--max-strangers", "64", "--max-strangers-per-address", "8"),
        ],
    )
    host, port = node.tcp_address.rsplit(":", 1)
    held: list[socket.socket] = []
    done = threading.Event()

    def flood() -> None:
        for i in range(1500):
            with contextlib.suppress(OSError):
                source = (f"127.0.0.{2 + i % 8}", 0)
                held.append(socket.create_connection((host, int(port)), 5, source))
        done.set()

    attacker = threading.Thread(target=flood, daemon=True)
    attacker.start()
    try:
        for _ in range(30):
            with keyed(node, beta) as b:
                assert b.health().ok
        assert done.wait(60)
        with keyed(node, CLUSTER) as operator:
            stats = operator.stats()
        assert stats.num_strangers <= 64
        assert stats.strangers_evicted >= 500
    finally:
        attacker.join(60)
        for sock in held:
            sock.close()


# -- 6. labels are text ---------------------------------------------------------------------


def test_a_label_is_text_wherever_it_is_shown(
    start_node: NodeFactory, tenants: TenantsFile
) -> None:
    """A tenant's label with an escape sequence (a clipboard write to the operator's
    terminal) is refused; labels that are console markup are shown by ``kvpool status``
    as the text they are (``[/]`` used to crash it, ``[link=...]`` to plant a link)."""
    alpha = tenants.add("alpha")[0]
    tenants.write()
    node = start_node("labelled", extra=["--tenants", str(tenants.path)])
    markup = ["[/]", "[link=https://evil.example]click[/link]"]
    with raw_connection(node.tcp_address, alpha) as conn:
        send_frame(conn, Op.DESCRIBE, DescribeRequest(NS.id, "\x1b]52;c;aGk=\x07"))
        status, meta = read_reply(conn)
        assert status != 0 and b"printable" in meta
        for i, label in enumerate(markup):
            namespace = Namespace(model=f"markup-{i}")
            send_frame(conn, Op.DESCRIBE, DescribeRequest(namespace.id, label), request_id=2 + i)
            assert read_reply(conn)[0] == 0
    done = run_kvpool("status", "--address", node.unix_address, env=CLUSTER_ENV)
    assert done.returncode == 0, said(done)
    for label in markup:
        assert label in done.stdout
    assert "\x1b]" not in done.stdout


# -- 7. directories nobody else can swap ---------------------------------------------------


@pytest.fixture
def shared_tree() -> Iterator[Path]:
    """A directory every local user may reach (under /dev/shm), for trees an attacker of
    another uid walks into."""
    path = Path("/dev/shm") / f"kvpool-fair-{secrets.token_hex(4)}"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_nobody(command: str) -> None:
    """Run a shell ``command`` as another local user (uid 65534): the attacker."""
    subprocess.run(["sh", "-c", command], user=65534, group=65534, check=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the attack runs as another user")
def test_directories_another_user_can_swap_are_refused(
    start_node: NodeFactory, shared_tree: Path
) -> None:
    """A node or disk directory under one that others may write in (no sticky bit) is
    refused at start, root or not (root's used to be let through, and no directory above
    the parent was looked at); and a disk directory swapped under a running daemon (an
    operator loosened a directory above it) never gets its segments: the daemon writes
    where it opened, by descriptor."""
    loose = shared_tree / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    refused = serve(loose / "run", "--name", "swappable")
    assert refused.returncode != 0 and "without the sticky bit" in said(refused)
    refused = serve(shared_tree / "run", "--disk", str(loose / "disk"), "--disk-size", "64MiB")
    assert refused.returncode != 0 and "without the sticky bit" in said(refused)

    safe = shared_tree / "safe"
    safe.mkdir(mode=0o755)
    node = start_node(
        "swapped", "8MiB", extra=["--disk", str(safe / "disk"), "--disk-size", "64MiB"]
    )
    safe.chmod(0o777)  # later, someone loosens it
    disk, moved = shlex.quote(str(safe / "disk")), shlex.quote(str(safe / "moved"))
    _as_nobody(f"mv {disk} {moved} && mkdir -m 777 {disk}")
    with Client(node.unix_address, timeout=10) as client:
        for i in range(64):  # 16 MiB through an 8 MiB arena: written back to disk
            assert client.put([NS.key(b"swap-%d" % i)], [bytes([i]) * (256 << 10)]).all_stored
        wait_written(client, client.stats().evictions)
        written = next(t for t in client.stats().tiers if t.name == "disk").writes
    assert written > 0
    assert not list((safe / "disk").iterdir()), "segments went to the attacker's directory"
    assert list((safe / "moved").glob("seg-*.kvs"))


# -- 8. prefetch holds within each tenant's share -------------------------------------------


def test_a_tenants_prefetch_holds_stay_within_its_share(
    start_node: NodeFactory, tenants: TenantsFile, tmp_path: Path
) -> None:
    """Tenant alpha (a 4 MiB quota) prefetches 16 MiB of its blocks from disk: it holds at
    most its share of the node's hold budget, within its quota, and a hold whose promotion
    its quota refused is released; tenant beta's prefetch is then served in full (it was
    refused whole while alpha's holds kept the node's budget for 60 s)."""
    alpha = tenants.add("alpha", quota="4MiB")[0]
    beta = tenants.add("beta", quota="4MiB")[0]
    tenants.write()
    node = start_node(
        "holds",
        "16MiB",
        extra=[
            *("--tenants", str(tenants.path)),
            *("--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"),
        ],
    )
    block = 1 << 20

    def on_disk(client: Client, tag: str, count: int) -> list[bytes]:
        keys = [NS.key(f"{tag}-{i}".encode()) for i in range(count)]
        for i in range(0, count, 2):
            assert client.put(keys[i : i + 2], [bytes([i]) * block] * 2).all_stored
        return keys

    with (
        keyed(node, alpha) as a,
        keyed(node, beta) as b,
        Client(
            node.tcp_address, access_id=CLUSTER[0], access_key=CLUSTER[1], use_shm=False
        ) as operator,
    ):
        alpha_keys = on_disk(a, "alpha", 16)
        beta_keys = on_disk(b, "beta", 8)
        wait_written(operator, operator.stats().evictions)
        beta_tiers = b.lookup_state(beta_keys).tiers
        beta_below = [k for k, t in zip(beta_keys, beta_tiers, strict=True) if t == TIER_DISK]
        assert beta_below
        a.prefetch(alpha_keys, hold=60)
        alpha_account = account(a)
        assert alpha_account.used["held_bytes"] <= alpha_account.limits["held_bytes"] <= 4 << 20
        answer = b.prefetch(beta_below, hold=60)
        assert answer.num_refused == 0 and answer.num_started == len(beta_below)
