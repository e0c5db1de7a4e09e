"""A daemon restart: clients recover on their own, and find the blocks again."""

import socket
import threading
import time
from collections import Counter

import pytest

from kvpool import Client, NodeUnavailable, PoolTimeout, TransportError
from tests.helpers import content, key


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_clients_recover_after_a_restart(start_node, path):
    port = free_port()
    first = start_node(name="restart", extra=["--port", str(port)])
    address = first.unix_address if path == "shm" else first.tcp_address
    with Client(address, use_shm=path == "shm", timeout=3) as c:
        keys = [key(f"r{i}") for i in range(4)]
        c.put(keys, [content(k, 300_000) for k in keys])
        assert c.lookup(keys) == 4
        first.stop()
        with pytest.raises(TransportError):
            c.lookup(keys)  # the node is down: a typed error, promptly
        second = start_node(name="restart", extra=["--port", str(port)])
        assert second.info["arena"] == first.info["arena"]
        # Same client object, no reconnect call: the pooled connections are stale, the
        # client notices, reconnects, maps the arena again and finds what it had stored.
        assert c.lookup(keys) == 4
        more = [key(f"r{i}") for i in range(4, 8)]
        assert c.put(more, [content(k, 300_000) for k in more]).all_stored
        keys += more
        got = c.get(keys)
        assert [bytes(v) for v in got.values] == [content(k, 300_000).tobytes() for k in keys]
        assert c.uses_shm == (path == "shm")


def test_calls_respect_their_deadline_when_the_node_is_frozen(node):
    with Client(node.unix_address, timeout=0.5) as c:
        c.put([key(1)], [b"x"])
        node.signal(19)  # SIGSTOP
        try:
            start = time.monotonic()
            with pytest.raises((PoolTimeout, NodeUnavailable)):
                c.lookup([key(1)])
            assert time.monotonic() - start < 1.5
        finally:
            node.signal(18)  # SIGCONT
        assert c.lookup([key(1)]) == 1


def test_many_threads_through_a_restart(start_node):
    first = start_node(name="busy")
    errors, done = [], threading.Event()
    # By (thread, "ok" or "down"); every key there before the threads start, so that a copy
    # taken while they count sees no key added.
    rounds = Counter({(n, outcome): 0 for n in range(4) for outcome in ("ok", "down")})
    with Client(first.unix_address, timeout=2) as c:

        def loop(n: int) -> None:
            while not done.is_set():
                try:
                    c.put([key("t")], [b"v"])
                    c.lookup([key("t")])
                    rounds[n, "ok"] += 1
                except TransportError:
                    rounds[n, "down"] += 1
                except BaseException as exc:
                    errors.append(exc)

        def wait_each(outcome: str) -> None:
            """Until each thread has had a round with ``outcome`` from now on."""
            since = Counter(rounds)
            deadline = time.monotonic() + 30
            while any(rounds[n, outcome] <= since[n, outcome] for n in range(4)):
                assert time.monotonic() < deadline and not errors, (outcome, rounds, errors[:3])
                time.sleep(0.01)

        threads = [threading.Thread(target=loop, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        try:
            wait_each("ok")
            first.stop()
            wait_each("down")
            start_node(name="busy")
            wait_each("ok")  # each thread recovered on its own ...
            wait_each("ok")  # ... and goes on
        finally:
            done.set()
            for t in threads:
                t.join(10)
        assert not errors, errors[:3]
        assert c.lookup([key("t")]) == 1
