"""The daemon as a real process: files, permissions, stale state, refusals, clean exit."""

import os
import signal
import stat

import pytest

from kvpool.client.client import Client
from kvpool.harness.process import NodeProcess
from tests.commands import serve
from tests.helpers import content, key


def test_arena_and_socket_are_private_to_user_and_group(node):
    arena = os.stat(node.info["arena"])
    sock = os.stat(node.info["unix"])
    assert stat.S_IMODE(arena.st_mode) == 0o660
    assert stat.S_IMODE(sock.st_mode) == 0o660
    assert stat.S_ISSOCK(sock.st_mode)
    assert node.info["arena_bytes"] == 64 << 20
    assert arena.st_size == node.info["arena_bytes"] + 4096  # and its header page, at the end


def test_clean_exit_removes_the_socket_and_keeps_the_arena(node):
    arena, sock = node.info["arena"], node.info["unix"]
    assert node.stop() == 0
    assert os.path.exists(arena) and not os.path.exists(sock)  # for the next start


def test_a_crashed_daemons_arena_is_adopted_unless_fresh(start_node):
    first = start_node(name="crash")
    with Client(first.unix_address) as c:
        c.put([key(1)], [content(key(1), 1000)])
    first.kill()  # SIGKILL: no cleanup
    assert os.path.exists(first.info["arena"])
    second = start_node(name="crash")
    assert second.info["arena"] == first.info["arena"] and second.info["adopted_blocks"] == 1
    with Client(second.unix_address) as c:
        assert c.get([key(1)]).values[0] == content(key(1), 1000).tobytes()
    second.kill()
    third = start_node(name="crash", extra=["--fresh"])
    assert third.info["adopted_blocks"] == 0
    with Client(third.unix_address) as c:
        assert c.lookup([key(1)]) == 0  # --fresh: an empty arena
        assert c.put([key(2)], [b"x" * 10]).all_stored


def test_second_daemon_in_the_same_directory_is_refused(node, run_dir):
    proc = serve(run_dir, "--name", "node")
    assert proc.returncode == 2
    assert "another kvpool daemon is running" in proc.stderr
    with Client(node.unix_address) as c:  # the first one is untouched
        assert c.health().ok


def test_a_size_it_cannot_get_is_refused_with_a_clear_message(run_dir):
    free = os.statvfs("/dev/shm")
    too_much = free.f_bavail * free.f_frsize + (1 << 30)
    proc = serve(run_dir, "--name", "big", "--memory", str(too_much))
    assert proc.returncode == 2
    assert "cannot get a" in proc.stderr and "Lower --memory" in proc.stderr
    assert not (run_dir / "big" / "arena").exists()


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--host", "0.0.0.0"], {}),
        # An empty host binds every interface too: it must not pass for loopback.
        (["--host", ""], {}),
        (["--admin-host", ""], {}),
        ([], {"KVPOOL_HOST": ""}),
        ([], {"KVPOOL_ADMIN_HOST": ""}),
    ],
)
def test_listening_publicly_without_a_key_is_refused(run_dir, args, env):
    proc = serve(run_dir, *args, env=env)
    assert proc.returncode == 2 and "without an access key" in proc.stderr, proc.stderr


def test_sigint_also_stops_cleanly(start_node):
    node = start_node(name="int")
    node.signal(signal.SIGINT)
    assert node.proc.wait(20) == 0
    assert not os.path.exists(node.info["unix"]) and os.path.exists(node.info["arena"])


@pytest.mark.parametrize("memory", ["1MiB", "3MiB"])
def test_small_arenas_work(start_node, memory):
    node: NodeProcess = start_node(name=f"small-{memory}", memory=memory)
    with Client(node.unix_address) as c:
        assert c.put([key(1)], [b"a" * 4096]).all_stored


@pytest.mark.parametrize("taken", ["node directory", "run directory"])
def test_a_directory_another_user_created_first_is_refused(tmp_path, taken):
    """From the attacker's side: another local user creates the node's directory (or the
    run directory above it) before the daemon starts, to swap its Unix socket or read its
    arena.  The daemon refuses to start there rather than use it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a directory to another user")  # CI runs as root
    run_dir = tmp_path / "run"
    node_dir = run_dir / "taken"
    node_dir.mkdir(parents=True)
    os.chown(node_dir if taken == "node directory" else run_dir, 12345, 12345)
    proc = serve(run_dir, "--name", "taken")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "belongs to uid 12345" in message, proc.stderr
    assert not (node_dir / "arena").exists()
