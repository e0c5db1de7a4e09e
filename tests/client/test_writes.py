"""Writes against a real daemon: puts through the connection's write area (one round trip),
through reserved slots where no area is free, and the checksums their COMMITs carry."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpool import Client, Status
from kvpool import checksum as ck
from kvpool.client import ops, writes
from tests.client.test_reads import SIZE, op_count
from tests.helpers import content, key


def test_puts_go_into_the_write_area_with_one_round_trip(node):
    """A connection's puts are copied to the front of its write area, with one COMMIT each
    and no RESERVE; their statuses are exact, and what they stored reads back."""
    batches = [[key(f"area-{b}-{i}") for i in range(4)] for b in range(5)]
    with Client(node.unix_address, timeout=10) as c:
        reserves, commits = op_count(node, "reserve"), op_count(node, "commit")
        for keys in batches:
            assert c.put(keys, [content(k, SIZE) for k in keys]).statuses == [Status.OK] * 4
        assert op_count(node, "area") == 1  # 20 blocks of 256 KiB fit one area
        assert op_count(node, "reserve") == reserves
        assert op_count(node, "commit") == commits + 5
        again = [batches[0][0], key("area-new")]
        assert c.put(again, [content(k, SIZE) for k in again]).statuses == [
            Status.EXISTS,
            Status.OK,
        ]
        for keys in [*batches, again]:
            got = c.get(keys)
            assert [bytes(v) for v in got.values] == [content(k, SIZE).tobytes() for k in keys]
        assert op_count(node, "area") == 1


def test_a_write_area_is_written_only_with_half_its_lease_left(start_node):
    node = start_node(name="short", env={"KVPOOL_RESERVE_LEASE": "1"})
    first, second = key("lease-1"), key("lease-2")
    with Client(node.unix_address, timeout=10) as c:
        assert c.put([first], [content(first, SIZE)]).all_stored
        assert op_count(node, "area") == 1
        time.sleep(0.6)  # past half the area's one-second lease: it is not written again
        assert c.put([second], [content(second, SIZE)]).all_stored
        assert op_count(node, "area") == 2
        assert [bytes(v) for v in c.get([first, second]).values] == [
            content(k, SIZE).tobytes() for k in (first, second)
        ]


def test_with_no_free_area_a_put_reserves_its_slots(start_node):
    """A node that has no free extent as large as an area says so; the put reserves (which
    may evict), and the client does not ask again at once."""
    node = start_node(name="full", memory="4MiB")
    held = [key(f"held-{i}") for i in range(15)]
    wanted = [key("wanted-1"), key("wanted-2")]
    with Client(node.unix_address, timeout=10) as c, Client(node.unix_address) as other:
        with other.reserve(held, [SIZE] * len(held)) as hog:  # all but one 256 KiB extent
            assert hog.statuses == [Status.OK] * len(held)
            reserves = op_count(node, "reserve")
            assert c.put(wanted[:1], [content(wanted[0], SIZE)]).all_stored
            assert (op_count(node, "area"), op_count(node, "reserve")) == (1, reserves + 1)
            hog.abort()
        assert c.put(wanted[1:], [content(wanted[1], SIZE)]).all_stored
        assert (op_count(node, "area"), op_count(node, "reserve")) == (1, reserves + 2)
        got = c.get(wanted[1:])  # (the first filled the arena: it was evicted since)
        assert bytes(got.values[0]) == content(wanted[1], SIZE).tobytes()


def test_a_puts_commit_carries_the_checksums_of_the_bytes_that_landed(node):
    """The writer hashes each block as it copies it in, and its COMMIT says so: the node
    does not hash the blocks again."""
    keys = [key(f"hashed-{i}") for i in range(3)]
    values = [content(k, 3 * SIZE + i) for i, k in enumerate(keys)]
    commits: list[Any] = []

    def recording(make: Callable[..., Any]) -> Callable[..., Any]:
        def op(arena: memoryview, conn: Any) -> Any:
            inner = make(arena, conn)
            effect = next(inner)
            while True:
                if isinstance(effect, ops.Request) and effect.op == ops.Op.COMMIT:
                    commits.append(effect.message)
                try:
                    effect = inner.send((yield effect))
                except StopIteration as stop:
                    return stop.value

        return op

    with Client(node.unix_address, timeout=10) as c:
        local = c._require_local()
        put = recording(lambda arena, conn: writes.put_blocks(keys, values, arena, conn.area, True))
        result = local.call(lambda conn: put(conn.arena, conn), 10)
        assert result.statuses == [Status.OK] * 3
        assert [m.checksums for m in commits] == [[ck.checksum(v) for v in values]]
        assert [bytes(v) for v in c.get(keys).values] == [v.tobytes() for v in values]


def test_the_node_publishes_a_writers_checksums_as_they_are(node):
    """A block committed with its writer's checksum is served with that checksum: a reader
    on another host gets the bytes of a right one, and a mismatch, never the bytes, for a
    wrong one."""
    right, wrong = key("writer-sum-right"), key("writer-sum-wrong")
    data = content(right, SIZE)
    with Client(node.unix_address, timeout=10) as c:
        local = c._require_local()

        def put(k: bytes, checksum: int) -> Any:
            def op(conn: Any) -> Any:
                slots = yield from writes.reserve_slots([k], [SIZE], conn.arena)
                slots.views[0][:] = data.data
                return (yield from writes.commit_slots(slots, False, None, [checksum]))

            return local.call(op, 10)

        assert put(right, ck.checksum(data)).statuses == [Status.OK]
        assert put(wrong, ck.checksum(data) ^ 1).statuses == [Status.OK]
    with Client(node.tcp_address, use_shm=False, timeout=10) as remote:
        assert bytes(remote.get([right]).values[0]) == data.tobytes()
        got = remote.get([wrong])
        assert got.statuses == [Status.CHECKSUM_MISMATCH] and got.num_found == 0
