"""The node's handshake, listeners, prefetch and secrets, tried from the attacker's side
against real daemons (issue 28: items 11, 12, 2 and the low items).

Each test is what an attacker does: relay a victim's handshake, rewrite a Welcome in the
middle of a plaintext link, stop a keyless node over its loopback port, flood the log with
refused handshakes, fill the daemon's heap with block origins, fan a tenant's PREFETCH out
to other nodes, or read a key from the process list or a readable tenants file.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvpool import AuthenticationError, BadRequest, Client, ConfigError, Forbidden, Namespace
from kvpool.client.connection import Connection
from kvpool.cluster.membership import Member
from kvpool.cluster.placement import homes
from kvpool.config import Address, client_config_from
from kvpool.harness.process import NodeProcess
from kvpool.integrations.vllm.config import connector_config
from kvpool.keys import MAX_TOKENS_PER_BLOCK, BlockOrigin
from kvpool.protocol.frames import HEADER, HEADER_BYTES, MAGIC, encode_frame, parse_header
from kvpool.protocol.messages import (
    PROTOCOL_VERSION,
    Empty,
    Hello,
    LookupRequest,
    NodeStats,
    Op,
    PutRequest,
    ShutdownRequest,
    Welcome,
)
from tests.conftest import NodeFactory
from tests.helpers import rss_anon_kib
from tests.security.tenants import TenantsFile, send
from tests.wire import read_frame, read_raw_frame

KEY = "a-key-of-sixteen-chars-or-more"
NS = Namespace(model="attack")


class Relay:
    """A local attacker's listener: it takes a victim's connection, opens its own to the
    node, and forwards the handshake (CHALLENGE, HELLO, the Welcome or the refusal) frame
    by frame, rewriting the Welcome with ``rewrite`` if given.  Afterwards it keeps the
    connection to the node for itself: ``node_side``."""

    def __init__(
        self,
        listener: socket.socket,
        connect: Callable[[], socket.socket],
        rewrite: Callable[[Welcome], Welcome] | None = None,
    ):
        self.listener = listener
        self.connect = connect
        self.rewrite = rewrite
        self.node_side: socket.socket | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            victim, _ = self.listener.accept()
            victim.settimeout(10)
            node = self.connect()
            node.settimeout(10)
            self.node_side = node
            raw, meta = read_raw_frame(node)  # CHALLENGE
            victim.sendall(raw + meta)
            raw, meta = read_raw_frame(victim)  # HELLO, with the victim's proof
            node.sendall(raw + meta)
            raw, meta = read_raw_frame(node)  # the Welcome (or the refusal)
            header = parse_header(raw)
            if self.rewrite is not None and header.status == 0:
                welcome = self.rewrite(msgspec.msgpack.decode(meta, type=Welcome))
                victim.sendall(
                    encode_frame(
                        header.op,
                        welcome,
                        request_id=header.request_id,
                        flags=header.flags,
                    )
                )
            else:
                victim.sendall(raw + meta)
            victim.close()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def join(self) -> None:
        self.thread.join(20)
        assert not self.thread.is_alive()

    def close(self) -> None:
        if self.node_side is not None:
            self.node_side.close()
        self.listener.close()


def _stats_on(sock: socket.socket) -> NodeStats | None:
    """What the attacker gets asking the node for STATS on the relayed connection (None:
    the node closed it or refused)."""
    try:
        sock.sendall(encode_frame(Op.STATS, Empty(), request_id=7))
        reply, meta = read_frame(sock)
    except OSError:
        return None
    if reply.status != 0:
        return None
    return msgspec.msgpack.decode(meta, type=NodeStats)


@pytest.mark.parametrize("target", ["unix", "tcp"])
def test_a_relayed_unix_handshake_authenticates_nobody(
    start_node: NodeFactory, tmp_path: Path, target: str
) -> None:
    """The attacker makes a victim connect to a Unix socket of its own (e.g. one it
    planted where the victim looks for the node's) and relays the victim's handshake to the
    node's Unix socket or loopback TCP port: the victim's proof covers the socket it
    really connected to, so the node refuses it, and the attacker holds nothing."""
    node = start_node("relayed", extra=["--access-key", KEY])
    trap = tmp_path / "kvpool.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(trap))
    listener.listen(1)

    def connect() -> socket.socket:
        if target == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(node.info["unix"])
            return sock
        address = Address.parse(node.tcp_address)
        return socket.create_connection((address.host, address.port))

    relay = Relay(listener, connect)
    with pytest.raises(AuthenticationError), Client(f"unix:{trap}", access_key=KEY) as victim:
        victim.stats()
    relay.join()
    assert relay.error is None and relay.node_side is not None
    assert _stats_on(relay.node_side) is None  # the relayed connection serves nothing
    relay.close()
    # The real socket still authenticates the real client.
    with Client(node.unix_address, access_key=KEY, timeout=10) as client:
        assert client.stats().node_id == "relayed"


def test_a_rewritten_welcome_is_refused_by_the_client(
    start_node: NodeFactory, tmp_path: Path
) -> None:
    """A man in the middle of a plaintext TCP link passes the handshake through but points
    the client at an arena file of its own: the node's proof covers its Welcome, so the
    client refuses the connection instead of mapping the attacker's file."""
    node = start_node("rewritten", extra=["--access-key", KEY])
    planted = tmp_path / "arena"
    planted.write_bytes(b"\0" * 4096)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    address = Address.parse(node.tcp_address)

    def rewrite(welcome: Welcome) -> Welcome:
        stat = planted.stat()
        return msgspec.structs.replace(
            welcome,
            arena_path=str(planted),
            arena_bytes=4096,
            arena_dev=stat.st_dev,
            arena_ino=stat.st_ino,
            host_id="rewritten-host",
        )

    relay = Relay(listener, lambda: socket.create_connection((address.host, address.port)), rewrite)
    config = client_config_from(
        {"address": f"127.0.0.1:{port}", "access_key": KEY, "host_id": "rewritten-host"}
    )
    with pytest.raises(AuthenticationError, match="could not prove"):
        Connection(Address.parse(config.address), config, time.monotonic() + 10)
    relay.join()
    assert relay.error is None
    relay.close()


def test_a_keyless_nodes_loopback_port_cannot_stop_it(start_node: NodeFactory) -> None:
    """With no key, any local user reaches the loopback TCP port: it may use the pool, but
    not stop or drain the node (the Unix socket, in the node's own run directory, may)."""
    node = start_node("keyless")
    config = client_config_from({"address": node.tcp_address, "use_shm": False})
    connection = Connection(Address.parse(node.tcp_address), config, time.monotonic() + 10)
    try:
        with pytest.raises(Forbidden, match="Unix socket or an access key"):
            send(
                connection,
                Op.SHUTDOWN,
                ShutdownRequest(node_id="keyless", drain=True),
                Empty,
            )
    finally:
        connection.close()
    time.sleep(0.5)
    assert node.proc is not None and node.proc.poll() is None
    with Client(node.tcp_address, use_shm=False, timeout=10) as client:
        assert client.stats().node_id == "keyless"


def test_refused_handshakes_cannot_flood_the_log(start_node: NodeFactory) -> None:
    """Every refused handshake came before authentication: 200 wrong access ids and 200
    broken or oversized HELLOs from one attacker leave a line or two in the node's log
    (at its most verbose), with their count, not 400."""
    node = start_node("flooded", extra=["--access-key", KEY, "--log-level", "info"])
    started = len(node.output)  # the node's own start-up lines (all in by its ready line)
    for i in range(200):
        guess = Client(node.tcp_address, access_id=f"guess-{i}", access_key=KEY, use_shm=False)
        with pytest.raises(AuthenticationError), guess:
            guess.stats()
    address = Address.parse(node.tcp_address)
    for i in range(200):
        with socket.create_connection((address.host, address.port)) as sock:
            sock.settimeout(10)
            read_frame(sock)  # CHALLENGE
            if i % 2:
                sock.sendall(b"XX" + b"\0" * (HEADER_BYTES - 2))  # not a frame
            else:  # a HELLO announcing 1 MiB of metadata
                sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Op.HELLO, 0, 0, 1, 1 << 20, 0))
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass
    deadline = time.monotonic() + 10  # the node logged as it refused: until its lines are in
    while not any("kvpool." in line for line in node.output[started:]):
        assert time.monotonic() < deadline, "the node logged no refused handshake"
        time.sleep(0.02)
    logged = [line for line in node.output[started:] if "kvpool." in line]
    assert 1 <= len(logged) <= 3, logged[:10]
    assert all("handshake(s) refused" in line for line in logged), logged[:10]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_tenants_prefetch_cannot_fan_out_to_other_nodes(
    start_node: NodeFactory, tmp_path: Path
) -> None:
    """A tenant sends PREFETCHes of blocks nobody holds, on a node whose other member is
    slow (it accepts and never answers): each request sends at most 64 keys to other
    nodes, and the tenant has at most 256 out at once; the rest are refused at once."""
    tenants = TenantsFile(tmp_path / "tenants.toml")
    beta = tenants.add("beta")[0]
    tenants.write()
    slow = socket.create_server(("127.0.0.1", 0), backlog=256)
    port = _free_port()
    peers = f"127.0.0.1:{port},127.0.0.1:{slow.getsockname()[1]}"
    node = start_node(
        "fanned", extra=["--port", str(port), "--peers", peers, "--tenants", str(tenants.path)]
    )
    namespace = Namespace(model="attack")
    started = refused = 0
    with Client(node.tcp_address, access_id=beta[0], access_key=beta[1], use_shm=False) as b:
        for request in range(16):
            wanted = [namespace.key(f"{request}-{i}".encode()) for i in range(1024)]
            answer = b.prefetch(wanted, hold=5)
            assert answer.num_started <= 64
            started += answer.num_started
            refused += answer.num_refused
    assert started <= 256 and refused >= 16 * 1024 - 256
    slow.close()


def test_block_origins_cannot_fill_the_daemons_heap(
    start_node: NodeFactory, tmp_path: Path
) -> None:
    """A tenant with a 4 MiB quota stores 1,024 empty blocks (a page each, its whole
    quota), each with the longest origin the wire allows (4,096 token ids): the daemon's
    heap grows by what the quota pays for, not by the origins (about 160 MiB before)."""
    tenants = TenantsFile(tmp_path / "tenants.toml")
    beta = tenants.add("beta", quota="4MiB")[0]
    tenants.write()
    node = start_node("origins", extra=["--tenants", str(tenants.path)])
    assert node.proc is not None
    namespace = Namespace(model="attack")
    origin = BlockOrigin(token_ids=list(range(1 << 20, (1 << 20) + MAX_TOKENS_PER_BLOCK)))
    with Client(node.tcp_address, access_id=beta[0], access_key=beta[1], use_shm=False) as b:
        b.put([namespace.key(b"warm")], [b""])
        before = rss_anon_kib(node.proc.pid)
        for batch in range(32):
            keys = [namespace.key(f"{batch}-{i}".encode()) for i in range(32)]
            assert b.put(keys, [b""] * 32, origins=[origin] * 32).all_stored
        assert b.stats().num_blocks >= 1000
        grown_kib = rss_anon_kib(node.proc.pid) - before
    assert grown_kib < 40 << 10, f"the daemon's heap grew by {grown_kib >> 10} MiB"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_tenants_file_others_may_read_or_write_is_refused(
    start_node: NodeFactory, tmp_path: Path, mode: int
) -> None:
    """Every tenant's key is in the tenants file: a node will not start on one that
    another local user may read (and steal the keys) or write (and add their own)."""
    tenants = TenantsFile(tmp_path / "tenants.toml")
    tenants.add("beta")
    tenants.write()
    tenants.path.chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        start_node("exposed", extra=["--tenants", str(tenants.path)])


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_access_key_stays_out_of_the_process_list(
    start_node: NodeFactory, tmp_path: Path
) -> None:
    """Any local user reads every process's command line: a key given in a file (the
    node's --access-key-file, a client's or connector's access_key_file) is not in it,
    and a key given as a flag gets a warning in the node's log."""
    key_file = tmp_path / "access-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    node = start_node("filed", extra=["--access-key-file", str(key_file)])
    assert node.proc is not None and KEY.encode() not in _cmdline(node.proc.pid)
    with Client(node.unix_address, access_key_file=str(key_file), timeout=10) as client:
        assert client.stats().node_id == "filed"
    with pytest.raises(AuthenticationError), Client(node.unix_address) as keyless:
        keyless.stats()
    connector = connector_config({"access_key_file": str(key_file), "address": node.unix_address})
    assert connector.client.access_key == KEY and KEY not in connector.describe()

    flagged = start_node("flagged", extra=["--access-key", KEY])
    assert any("process list" in line for line in flagged.output)

    key_file.chmod(0o644)  # another user could read it: refused, by node and client
    with pytest.raises(ConfigError, match="chmod 600"):
        start_node("exposed-key", extra=["--access-key-file", str(key_file)])
    with pytest.raises(ConfigError, match="chmod 600"):
        Client(node.unix_address, access_key_file=str(key_file))


def _num_connections(node: NodeProcess) -> int:
    with Client(node.unix_address, timeout=10) as observer:
        return observer.stats().num_connections - 1  # not counting the observer


def test_a_peer_that_stalls_a_refused_payload_or_never_reads_is_cut(
    start_node: NodeFactory,
) -> None:
    """Two connections an attacker holds open for nothing: one sends a PUT the node refuses
    (its lists disagree) announcing 16 MiB of payload and never sends it; the other sends
    lookups and never reads the answers.  Each is cut within a deadline, so neither holds
    its session, and what the node buffered for it, for ever."""
    node = start_node("stalled")
    address = Address.parse(node.tcp_address)

    def connect() -> socket.socket:
        sock = socket.create_connection((address.host, address.port))
        sock.settimeout(10)
        read_frame(sock)  # CHALLENGE
        hello = Hello(version=PROTOCOL_VERSION, access_id="kvpool", nonce=b"n" * 32)
        sock.sendall(encode_frame(Op.HELLO, hello, request_id=1))
        welcome, _ = read_frame(sock)
        assert welcome.status == 0
        return sock

    stalled = connect()
    bad_put = PutRequest(keys=[NS.key(b"a"), NS.key(b"b")], sizes=[1 << 20])
    # (The node skips a refused payload for 10 s plus 1 s per 16 MiB announced.)
    stalled.sendall(encode_frame(Op.PUT, bad_put, payload_len=16 << 20, request_id=2))
    deaf = connect()
    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lookup = LookupRequest(keys=[NS.key(b"%d" % i) for i in range(16384)], mask=True)
    frame = encode_frame(Op.LOOKUP, lookup, request_id=3)
    deaf.settimeout(0.5)
    with contextlib.suppress(TimeoutError):
        for _ in range(1000):  # until the node, whose replies nobody reads, stops reading too
            deaf.sendall(frame)
    assert _num_connections(node) == 2
    deadline = time.monotonic() + 40
    while _num_connections(node):
        assert time.monotonic() < deadline, "the stalled connections were never cut"
        time.sleep(0.05)
    stalled.close()
    deaf.close()


def test_a_tenant_cannot_make_the_node_hash_thousands_of_namespaces_per_request(
    start_node: NodeFactory, tmp_path: Path
) -> None:
    """Scoping a key costs an HMAC per new namespace, on the node's event loop: a tenant's
    lookup of 16,384 keys in 16,384 namespaces is refused (a real request names one, or
    one per KV cache group), and one of 64 namespaces is served."""
    tenants = TenantsFile(tmp_path / "tenants.toml")
    beta = tenants.add("beta")[0]
    tenants.write()
    node = start_node("hashed", extra=["--tenants", str(tenants.path)])
    many = [Namespace(model=f"m{i}").key(b"block") for i in range(16384)]
    with Client(node.tcp_address, access_id=beta[0], access_key=beta[1], use_shm=False) as b:
        with pytest.raises(BadRequest, match="namespaces"):
            b.exists(many)
        assert b.exists(many[:64]) == [False] * 64


def test_a_prefetch_buffers_no_more_of_other_nodes_blocks_than_its_budget(
    start_node: NodeFactory,
) -> None:
    """A client asks node A to prefetch 24 blocks of 4 MiB (96 MiB) that only node B holds:
    A cuts B's answer at the 64 MiB a fetch may buffer, from the sizes B announces before
    sending a byte, so at most 16 come up (all 24 did before, buffered whole first)."""
    port_a, port_b = _free_port(), _free_port()
    peers = f"127.0.0.1:{port_a},127.0.0.1:{port_b}"
    node_a = start_node("a", "160MiB", extra=["--port", str(port_a), "--peers", peers])
    node_b = start_node("b", "160MiB", extra=["--port", str(port_b), "--peers", peers])
    members = [Member(node_id=a, tcp_address=a) for a in peers.split(",")]
    candidates = (NS.key(b"big-%d" % i) for i in range(1000))
    wanted = [k for k in candidates if homes(k, members)[0].tcp_address == node_b.tcp_address]
    wanted = wanted[:24]
    block = b"\x5a" * (4 << 20)
    with Client(node_b.unix_address, write_rcache=False, timeout=30) as writer:
        for i in range(0, 24, 4):
            assert writer.put(wanted[i : i + 4], [block] * 4).all_stored
    with Client(node_a.unix_address, timeout=30) as reader:
        assert reader.prefetch(wanted, hold=60).num_started == 24
        deadline = time.monotonic() + 30
        # One fetch from B brings them (24 keys: one request), counted once it is done.
        while not reader.stats().prefetch.completed:
            assert time.monotonic() < deadline, "the prefetch from B never completed"
            time.sleep(0.02)
        arrived = sum(reader.local.exists(wanted))
    assert 1 <= arrived <= 16, arrived
