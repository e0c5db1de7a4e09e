"""KV events under attack (issue 28, item 3), from the subscriber's side, against real
daemons: what a stranger, or another tenant, can read from the node's event sockets.

- Token ids (the prompt's text) are published only where the operator opts in.
- Off loopback, or with tenants, the sockets need CURVE (or ``--insecure``): the node
  refuses to start otherwise.
- With CURVE, a key the clients file does not list reads nothing; a tenant's key reads its
  own stream only (its blocks, never another tenant's), and the replay socket answers it
  with its own batches only; the operator's key reads every block.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvpool.keys import BlockOrigin, Namespace, chained_hashes
from tests.commands import said, serve
from tests.conftest import NodeFactory
from tests.security.tenants import TenantsFile, client

BS = 16
NS = Namespace(model="events-attack", block_size=BS)
END = (-1).to_bytes(8, "big", signed=True)


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[dict]
    data_parallel_rank: int | None = None


def decode(payload: bytes) -> list[dict]:
    return msgspec.msgpack.decode(payload, type=Batch).events


def blocks(seed: int, num_blocks: int = 3):
    tokens = [seed * 1000 + i for i in range(num_blocks * BS)]
    hashes = chained_hashes(tokens, BS)
    origins = [
        BlockOrigin(token_ids=tokens[i * BS : (i + 1) * BS], parent=hashes[i - 1] if i else b"")
        for i in range(num_blocks)
    ]
    return NS.keys(hashes), origins, {int.from_bytes(h[-8:], "big") for h in hashes}


def stored_hashes(events: list[dict]) -> set[int]:
    return {h for e in events if e.get("type") == "BlockStored" for h in e["block_hashes"]}


# A socket's handshake with the node, as its monitor reports it: admitted or refused.
HANDSHAKES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: True,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: False,  # a CURVE key the node's ZAP handler refused
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: False,  # no CURVE, to a CURVE socket
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: False,
}


def is_admitted(monitor: zmq.Socket, timeout: float = 20.0) -> bool:
    """Whether the node admitted the socket ``monitor`` watches (made before it connected),
    from the socket's own handshake event."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and monitor.poll(int(left * 1000)), "no handshake with the node"
        event = recv_monitor_message(monitor)["event"]
        if event in HANDSHAKES:
            return HANDSHAKES[event]


def replay(endpoint: str, keys: tuple[bytes, bytes, bytes] | None = None) -> list[bytes]:
    """Every payload the replay socket gives this client (none where the node refuses its
    handshake: it can never be answered)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads: list[bytes] = []
    try:
        if not is_admitted(monitor):
            return payloads
        while sock.poll(3000):
            _, _, seq, payload = sock.recv_multipart()
            if seq == END:
                return payloads
            payloads.append(payload)
        return payloads
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def test_token_ids_are_not_published_unless_the_operator_opts_in(start_node):
    node = start_node(
        name="no-tokens",
        extra=["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"],
    )
    keys, origins, hashes = blocks(1)
    with client(node.unix_address, ("kvpool", "")) as pool:
        assert pool.put(keys, [b"x" * 64] * 3, origins=origins).all_stored
    deadline = time.monotonic() + 20
    events: list[dict] = []
    while not hashes <= stored_hashes(events) and time.monotonic() < deadline:
        events = [e for p in replay(node.info["kv_events_replay"]) for e in decode(p)]
    stored = [
        e for e in events if e.get("type") == "BlockStored" and e["block_hashes"][0] in hashes
    ]
    assert len(stored) == 3
    assert all(e["token_ids"] == [] for e in stored), "a subscriber read the prompt's tokens"
    assert {e["block_size"] for e in stored} == {BS}


def test_events_off_loopback_without_curve_are_refused(run_dir):
    done = serve(run_dir, "--kv-events", "tcp://0.0.0.0:0")
    assert done.returncode != 0 and "refusing to publish KV events on tcp://0.0.0.0:0" in said(done)
    done = serve(run_dir, "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://*:0")
    assert done.returncode != 0 and "refusing to publish KV events on tcp://*:0" in said(done)


def test_with_tenants_events_without_curve_are_refused(run_dir, tmp_path):
    tenants = TenantsFile(tmp_path / "tenants.toml")
    tenants.add("alpha")
    tenants.write()
    done = serve(run_dir, "--tenants", str(tenants.path), "--kv-events", "tcp://127.0.0.1:0")
    assert done.returncode != 0 and "with --tenants, KV events need CURVE" in said(done)


@pytest.fixture
def curve(tmp_path: Path):
    """The server's certificate, and key pairs for the operator, alpha, beta and a stranger."""
    certs = tmp_path / "certs"
    certs.mkdir()
    _, secret_file = zmq.auth.create_certificates(certs, "server")
    server_public, _ = zmq.auth.load_certificate(secret_file)
    pairs = {name: zmq.curve_keypair() for name in ("operator", "alpha", "beta", "stranger")}
    return Path(secret_file), server_public, pairs


def test_with_tenants_each_reads_its_own_blocks_only(start_node: NodeFactory, tmp_path, curve):
    secret_file, server_public, pairs = curve
    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha, beta = tenants.add("alpha")[0], tenants.add("beta")[0]
    tenants.write()
    clients = tmp_path / "events-clients.toml"
    public = {name: pair[0].decode() for name, pair in pairs.items()}
    clients.write_text(
        f'operator = ["{public["operator"]}"]\n'
        f'[tenants.alpha]\nendpoint = "tcp://127.0.0.1:0"\nkeys = ["{public["alpha"]}"]\n'
        f'[tenants.beta]\nendpoint = "tcp://127.0.0.1:0"\nkeys = ["{public["beta"]}"]\n'
    )
    node = start_node(
        name="ev-tenants",
        extra=[
            "--tenants", str(tenants.path),
            "--kv-events", "tcp://127.0.0.1:0",
            "--kv-events-replay", "tcp://127.0.0.1:0",
            "--kv-events-curve-key", str(secret_file),
            "--kv-events-clients", str(clients),
            "--kv-events-token-ids",
        ],
    )  # fmt: skip
    info = node.info
    streams = info["kv_events_tenants"]

    def keys_of(name: str) -> tuple[bytes, bytes, bytes]:
        public, secret = pairs[name]
        return public, secret, server_public

    monitors: dict[str, zmq.Socket] = {}

    def subscribe(endpoint: str, name: str, label: str) -> zmq.Socket:
        sock = ctx.socket(zmq.SUB)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys_of(name)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: a prefix is no boundary
        monitors[label] = sock.get_monitor_socket()
        sock.connect(endpoint)
        return sock

    ctx = zmq.Context()
    subs = {
        label: subscribe(endpoint, name, label)
        for label, endpoint, name in (
            ("operator", info["kv_events"], "operator"),
            ("alpha", streams["alpha"], "alpha"),
            ("beta on alpha's stream", streams["alpha"], "beta"),
            ("beta on the operator's", info["kv_events"], "beta"),
            ("stranger", info["kv_events"], "stranger"),
        )
    }
    events: dict[str, list[dict]] = {label: [] for label in subs}

    def receive(label: str, wait_ms: int) -> None:
        while subs[label].poll(wait_ms):
            events[label] += decode(subs[label].recv_multipart()[2])
            wait_ms = 0

    def probe(pool, seeds: range, each_s: float) -> None:
        """Alpha stores probe blocks, one a seed, ``each_s`` apart, until the operator's
        and alpha's subscribers have each received one: a socket delivers in order, so
        what was published before that probe has reached them too."""
        waiting, sent = {"operator", "alpha"}, set()
        for seed in seeds:
            keys, origins, hashes = blocks(seed, 1)
            assert pool.put(keys, [b"p" * 64], origins=origins).all_stored
            sent |= hashes
            deadline = time.monotonic() + each_s
            while waiting and time.monotonic() < deadline:
                for label in list(waiting):
                    receive(label, 20)
                    if sent & stored_hashes(events[label]):
                        waiting.remove(label)
            if not waiting:
                return
        raise AssertionError(f"{sorted(waiting)} never received a probe")

    try:
        # CURVE handshakes: the node's ZAP handler admits the listed keys, each on its own
        # socket, and refuses the others (they can never read a thing).
        admitted = {label: is_admitted(monitor) for label, monitor in monitors.items()}
        assert admitted == {
            "operator": True,
            "alpha": True,
            "beta on alpha's stream": False,
            "beta on the operator's": False,
            "stranger": False,
        }, admitted
        alpha_keys, alpha_origins, alpha_hashes = blocks(2)
        beta_keys, beta_origins, beta_hashes = blocks(3)
        with client(node.tcp_address, alpha) as pool:
            probe(pool, range(100, 130), 1.0)  # until the subscriptions reached the node
            assert pool.put(alpha_keys, [b"a" * 64] * 3, origins=alpha_origins).all_stored
        with client(node.tcp_address, beta) as pool:
            assert pool.put(beta_keys, [b"b" * 64] * 3, origins=beta_origins).all_stored
        with client(node.tcp_address, alpha) as pool:
            probe(pool, range(200, 201), 30.0)  # what was published before it has arrived
        for label in subs:
            receive(label, 0)
        read = {label: stored_hashes(events[label]) for label in subs}
        assert read["operator"] >= alpha_hashes | beta_hashes  # the operator's router
        assert read["alpha"] >= alpha_hashes and not read["alpha"] & beta_hashes
        assert not read["beta on alpha's stream"], "beta read alpha's stream"
        assert not read["beta on the operator's"], "a tenant read the operator's stream"
        assert not read["stranger"], "an unlisted key read the events"
        # The replay socket: each key its own batches only; a stranger nothing.
        replayed = {
            name: stored_hashes(
                [e for p in replay(info["kv_events_replay"], keys_of(name)) for e in decode(p)]
            )
            for name in ("operator", "alpha", "beta", "stranger")
        }
        assert replayed["operator"] >= alpha_hashes | beta_hashes
        assert replayed["alpha"] >= alpha_hashes and not replayed["alpha"] & beta_hashes
        assert replayed["beta"] >= beta_hashes and not replayed["beta"] & alpha_hashes
        assert not replayed["stranger"]
        assert not stored_hashes(
            [e for p in replay(info["kv_events_replay"]) for e in decode(p)]
        ), "a client without CURVE was answered"
    finally:
        for sock in subs.values():
            sock.disable_monitor()
            sock.close(linger=0)
        for monitor in monitors.values():
            monitor.close(linger=0)
        ctx.term()
