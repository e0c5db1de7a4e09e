"""A writer against a real daemon: its COMMITs overlap the next put's copy, every future
gets its exact statuses, and a node that goes away fails the futures instead of hanging."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from kvpool import Client, ConnectError, NodeUnavailable, Status
from kvpool.client import connection, ops
from tests.client.test_reads import op_count
from tests.helpers import content, key

SIZE = 256 << 10  # four blocks a batch: 1 MiB, so a writer's area (4 MiB) holds four


def record_commits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Log each COMMIT sent ("sent") and each COMMIT reply read ("read"), in order."""
    log: list[str] = []
    perform = connection.Connection._perform

    def logged(self: connection.Connection, effect: Any) -> Any:
        result = perform(self, effect)
        if isinstance(effect, ops.Request) and effect.op == ops.Op.COMMIT:
            log.append("sent")
        elif isinstance(effect, ops.Recv) and effect.op == ops.Op.COMMIT:
            log.append("read")
        return result

    monkeypatch.setattr(connection.Connection, "_perform", logged)
    return log


def most_in_flight(log: list[str]) -> int:
    in_flight = most = 0
    for event in log:
        in_flight += 1 if event == "sent" else -1
        most = max(most, in_flight)
    return most


def test_a_writers_commits_overlap_its_next_copy(node, monkeypatch):
    batches = [[key(f"w-{b}-{i}") for i in range(4)] for b in range(10)]
    log = record_commits(monkeypatch)
    with Client(node.unix_address, timeout=10) as c:
        assert c.uses_shm
        commits = op_count(node, "commit")
        with c.writer() as writer:
            futures = []
            for keys in batches:
                futures.append(writer.put(keys, [content(k, SIZE) for k in keys]))
                # Its reply is read after the next put's copy, not before this returns.
                assert not futures[-1].ready()
                if len(futures) > 1:
                    assert futures[-2].ready()
            again = writer.put([batches[0][0]], [content(batches[0][0], SIZE)])
        assert again.result().statuses == [Status.EXISTS]
        assert all(f.result().statuses == [Status.OK] * 4 for f in futures)
        # The next COMMIT went out before the reply to the one before it was read, and
        # one area (swapped for a fresh one in COMMIT replies) took every batch.
        assert most_in_flight(log) == 2
        assert op_count(node, "commit") == commits + 11
        assert op_count(node, "area") == 1
        for keys in batches:
            got = c.get(keys)
            assert [bytes(v) for v in got.values] == [content(k, SIZE).tobytes() for k in keys]
        # The writer gave its connection back with nothing due: plain calls work on it.
        fresh = key("w-after")
        assert c.put([fresh], [content(fresh, SIZE)]).statuses == [Status.OK]


def test_a_plain_put_waits_for_its_reply(node, monkeypatch):
    log = record_commits(monkeypatch)
    with Client(node.unix_address, timeout=10) as c:
        for b in range(4):
            keys = [key(f"plain-{b}-{i}") for i in range(4)]
            assert c.put(keys, [content(k, SIZE) for k in keys]).all_stored
    assert log == ["sent", "read"] * 4


def test_a_flushed_writers_blocks_are_seen_by_other_clients(node):
    keys = [key(f"seen-{i}") for i in range(4)]
    with Client(node.unix_address, timeout=10) as c, Client(node.unix_address) as reader:
        writer = c.writer()
        future = writer.put(keys, [content(k, SIZE) for k in keys])
        writer.flush()
        assert future.ready() and future.result().all_stored
        assert reader.lookup(keys) == 4
        writer.close()
        with pytest.raises(Exception, match="closed"):
            writer.put(keys, [content(k, SIZE) for k in keys])


def test_a_writer_off_the_nodes_host_puts_plainly(node):
    keys = [key(f"tcp-{i}") for i in range(3)]
    with Client(node.tcp_address, use_shm=False, timeout=10) as c, c.writer() as writer:
        future = writer.put(keys, [content(k, SIZE) for k in keys])
        assert future.ready() and future.result().statuses == [Status.OK] * 3
        assert [bytes(v) for v in c.get(keys).values] == [content(k, SIZE).tobytes() for k in keys]


def test_a_node_that_goes_away_fails_the_writers_futures(start_node):
    """A writer does not wait for the node: a put returns with the node frozen, and the
    node's death fails that put's future (and the flush) instead of hanging."""
    node = start_node(name="gone")
    first, second = ([key(f"gone-{b}-{i}") for i in range(4)] for b in range(2))
    with Client(node.unix_address, timeout=5) as c, c.writer(timeout=5) as writer:
        assert writer.put(first, [content(k, SIZE) for k in first]).result().all_stored
        node.signal(signal.SIGSTOP)
        pending = writer.put(second, [content(k, SIZE) for k in second])
        node.kill()
        started = time.monotonic()
        with pytest.raises(NodeUnavailable):
            writer.flush()
        assert isinstance(pending.exception(), NodeUnavailable)
        with pytest.raises(ConnectError):  # no node to open a new connection to
            writer.put(second, [content(k, SIZE) for k in second])
        assert time.monotonic() - started < 5
