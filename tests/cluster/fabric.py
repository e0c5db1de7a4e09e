"""Simulated hosts for cluster tests.

Each host gets its own network namespace (``ip netns``) on a private bridge, its own host
identity (so the shared-memory path is used only where it would be on real hosts) and its
own node directory.  Where network namespaces cannot be made (not root), hosts share
loopback and differ by port and host identity only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.harness.process import NodeProcess

ACCESS_KEY = "cluster-test-key"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def netns_available() -> bool:
    name = f"kvp{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError):
        return False
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", name)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Host:
    name: str
    ip: str
    netns: str | None
    run_dir: Path
    port: int
    admin_port: int
    nodes: list[NodeProcess] = field(default_factory=list)

    @property
    def host_id(self) -> str:
        return f"host-{self.name}"

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    @property
    def tcp_address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def unix_address(self) -> str:
        return f"unix:{self.run_dir}/{self.name}/kvpool.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "KVPOOL_HOST_ID": self.host_id, "KVPOOL_ACCESS_KEY": ACCESS_KEY}

    def start_node(
        self,
        *,
        peers: list[str] | None = None,
        etcd: str = "",
        memory: str = "64MiB",
        extra: list[str] | None = None,
        keyed: bool = True,
    ) -> NodeProcess:
        """``keyed``: the fabric's one access key (else the node's ``extra`` name its
        identities, e.g. a tenants file)."""
        args = [
            "--name",
            self.name,
            "--run-dir",
            str(self.run_dir),
            "--memory",
            memory,
            "--host",
            self.ip,
            "--port",
            str(self.port),
            "--admin-host",
            self.ip,
            "--admin-port",
            str(self.admin_port),
            "--host-id",
            self.host_id,
            "--insecure",  # plaintext on the test fabric's private network (TLS: tests/security)
            "--log-level",
            "warning",
        ]
        if peers:
            args += ["--peers", ",".join(peers)]
        if etcd:
            args += ["--etcd", etcd]
        env = self.env()
        if not keyed:
            del env["KVPOOL_ACCESS_KEY"]
        node = NodeProcess([*args, *(extra or [])], env=env, command_prefix=self.prefix)
        self.nodes.append(node)
        return node.start()

    def client_options(self, **options: object) -> dict[str, object]:
        """Options of a client running on this host."""
        return {
            "address": self.unix_address,
            "host_id": self.host_id,
            "access_key": ACCESS_KEY,
            **options,
        }


# Fabrics of processes that run at once (two pytest workers, two developers) take their
# subnets under this lock, each one no bridge of the machine has yet.
SUBNET_LOCK = Path("/dev/shm/kvpool-fabric-subnets.lock")


def _free_subnet() -> str:
    """A /24 of 10.77.0.0 .. 10.92.249.0 that no interface of this machine is on."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    while True:
        subnet = f"10.{77 + secrets.randbelow(16)}.{secrets.randbelow(250)}"
        if f" {subnet}." not in used:
            return subnet


class Fabric:
    def __init__(self) -> None:
        self.use_netns = netns_available()
        self.tag = secrets.token_hex(2)
        self.bridge = f"kvbr{self.tag}"
        self.hosts: list[Host] = []
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"kvpool-fabric-{self.tag}-", dir="/dev/shm"))
        self.subnet = ""
        self.gateway = "127.0.0.1"
        if self.use_netns:
            with open(SUBNET_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = _free_subnet()
                self.gateway = f"{self.subnet}.1"
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 2
        if self.use_netns:
            ns = f"kv{self.tag}{name}"
            outside, inside = f"kvh{self.tag}{index}", f"kvn{self.tag}{index}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            ip = f"{self.subnet}.{index}"
            for args in (
                ["addr", "add", f"{ip}/24", "dev", inside],
                ["link", "set", inside, "up"],
                ["link", "set", "lo", "up"],
            ):
                _ip("netns", "exec", ns, "ip", *args)
            host = Host(name, ip, ns, self.run_dir, 9400, 9401)
        else:
            host = Host(name, "127.0.0.1", None, self.run_dir, free_port(), free_port())
        self.hosts.append(host)
        return host

    def close(self) -> None:
        nodes = [node for host in self.hosts for node in host.nodes]
        for node in nodes:  # all told at once (each takes a moment to stop), then waited for
            node.signal(signal.SIGCONT)
            node.signal(signal.SIGTERM)
        for node in nodes:
            node.stop()
        for host in self.hosts:
            if host.netns:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", host.netns)
        if self.use_netns:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", self.bridge)
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Etcd:
    """A real etcd (Debian's etcd-server) on a temporary data directory."""

    def __init__(self, host: str) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError(
                "etcd is not installed: apt-get install etcd-server (make test does)"
            )
        self.data = tempfile.mkdtemp(prefix="kvpool-etcd-")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"http://{host}:{self.port}"
        urls = f"http://{host}:{self.port}" + (
            "" if host == "127.0.0.1" else f",http://127.0.0.1:{self.port}"
        )
        self.proc = subprocess.Popen(
            [
                binary,
                "--data-dir",
                self.data,
                "--listen-client-urls",
                urls,
                "--advertise-client-urls",
                self.endpoint,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--name",
                "default",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.5),
            ):
                return
            time.sleep(0.02)
        self.close()
        raise RuntimeError("etcd did not start")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.data, ignore_errors=True)
