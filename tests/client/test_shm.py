"""The same-host path against a real daemon: reads through the node's shared directory (no
round trip for sealed blocks, and a copy that raced a removal is never delivered), and
puts through the connection's write area."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import pytest

from kvpool import Client, Status, directory
from kvpool import checksum as ck
from kvpool.client import ops, shm
from tests.helpers import content, key

pytestmark = pytest.mark.skipif(
    not directory.SUPPORTED, reason="readers use the directory on x86-64 only"
)

SIZE = 256 << 10


def op_count(node: Any, op: str) -> float:
    with urllib.request.urlopen(node.admin_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = f'kvpool_op_latency_seconds_count{{op="{op}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def wait_for_count(node: Any, op: str, want: float) -> float:
    deadline = time.monotonic() + 10
    while (got := op_count(node, op)) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def intercepted(op: Generator[Any, Any, Any], before_copy: Callable[[], None]) -> Any:
    """Run ``before_copy`` just before the operation's first copy (its first Compute)."""
    effect = next(op)
    hook: Callable[[], None] | None = before_copy
    while True:
        if hook is not None and isinstance(effect, ops.Compute):
            hook()
            hook = None
        result = yield effect
        try:
            effect = op.send(result)
        except StopIteration as stop:
            return stop.value


def test_sealed_blocks_are_read_without_a_round_trip(node):
    keys = [key(f"d{i}") for i in range(4)]
    blocks = [content(k, SIZE) for k in keys]
    with Client(node.unix_address, timeout=10) as c:
        assert c.put(keys, blocks).all_stored
        assert c.lookup(keys) == 4  # waits for the seals: the blocks are listed
        pins = op_count(node, "pin")
        out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
        for _ in range(3):
            result = c.get(keys, out)
            assert result.statuses == [Status.OK] * 4
            assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        assert op_count(node, "touch") == 0  # told with the connection's next request
        # That one (stats) carries the reads to the node first: one notice, no reply awaited.
        dram = next(t for t in c.stats().tiers if t.name == "dram")
        assert dram.reads == 12  # counted as reads, and kept recently used
        assert wait_for_count(node, "touch", 1) == 1
        assert op_count(node, "pin") == pins  # and nothing was pinned
        # A key the directory does not list goes the pinned way, as one batch.
        result = c.get([*keys, key("absent")], [*out, np.zeros(SIZE, dtype=np.uint8)])
        assert result.statuses == [Status.OK] * 4 + [Status.NOT_FOUND]
        assert op_count(node, "pin") == pins + 1


def test_a_copy_that_races_a_removal_is_never_delivered(start_node):
    node = start_node(memory="4MiB")
    victim, newcomer = key("victim"), key("newcomer")
    with Client(node.unix_address, timeout=10) as c, Client(node.unix_address) as other:
        assert c.put([victim], [content(victim, SIZE)]).all_stored
        assert c.lookup([victim]) == 1
        local = c.local
        assert local is not None
        conn = local.hold()
        assert conn.directory is not None and conn.arena is not None
        where = conn.directory.find(victim)
        assert where is not None

        def remove_and_reuse() -> None:
            # While the reader is about to copy: the block goes, and its memory is handed
            # to another block with other bytes.
            assert other.delete([victim]) == [Status.OK]
            with other.reserve([newcomer], [SIZE]) as lease:  # reserved: the freed memory
                np.copyto(np.frombuffer(lease.views[0], dtype=np.uint8), content(newcomer, SIZE))
                assert lease.commit().all_stored
            assert other.lookup([newcomer]) == 1
            again = conn.directory.find(newcomer) if conn.directory is not None else None
            assert again is not None and again[2] == where[2]  # the very same memory

        out = np.zeros(SIZE, dtype=np.uint8)
        op = shm.get_blocks([victim], [memoryview(out)], conn.arena, conn.directory, prefix=False)
        try:
            result = conn.run(intercepted(op, remove_and_reuse), time.monotonic() + 10)
        finally:
            local.release(conn)
        # The copy took the newcomer's bytes; the generation said so, and the read asked
        # the node, which no longer has the victim.
        assert result.statuses == [Status.NOT_FOUND]


def test_a_lease_read_in_place_knows_when_its_block_went(start_node):
    node = start_node(memory="4MiB")
    victim, newcomer = key("held"), key("after")
    with Client(node.unix_address, timeout=10) as c:
        assert c.put([victim], [content(victim, SIZE)]).all_stored
        assert c.lookup([victim]) == 1
        pins = op_count(node, "pin")
        lease = c.acquire([victim])
        assert lease.num_prefix == 1 and lease.still_held
        assert bytes(lease.views[0]) == content(victim, SIZE).tobytes()
        assert op_count(node, "pin") == pins  # read in place, without a pin
        c.delete([victim])
        c.put([newcomer], [content(newcomer, SIZE)])
        assert not lease.still_held  # what was read from the views must not be used
        lease.release()


def test_verify_reads_hashes_every_block_through_a_pin(node):
    k = key("verified")
    with Client(node.unix_address, timeout=10, verify_reads=True) as c:
        c.put([k], [content(k, SIZE)])
        pins = op_count(node, "pin")
        assert c.get([k]).statuses == [Status.OK]
        assert op_count(node, "pin") == pins + 1


def test_a_restarted_node_retires_the_directory_its_readers_hold(start_node):
    first = start_node(name="again")
    keys = [key(f"w{i}") for i in range(3)]
    with Client(first.unix_address, timeout=5) as c:
        assert c.put(keys, [content(k, SIZE) for k in keys]).all_stored
        assert c.lookup(keys) == 3
        local = c.local
        assert local is not None
        conn = local.hold()
        reader = conn.directory
        local.release(conn)
        assert reader is not None and reader.find_all(keys) is not None
        first.stop()
        assert reader.is_retired  # a daemon that stops retires its directory
        second = start_node(name="again")
        assert second.info["arena"] == first.info["arena"]
        # The blocks were adopted (read verified, through a pin, until scrubbed); the
        # client reconnects on its own and maps the new directory.
        got = c.get(keys)
        assert [bytes(v) for v in got.values] == [content(k, SIZE).tobytes() for k in keys]
        conn = local.hold()
        assert conn.directory is not None and conn.directory is not reader
        local.release(conn)


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
        put = recording(lambda arena, conn: shm.put_blocks(keys, values, arena, conn.area, True))
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
                slots = yield from shm.reserve_slots([k], [SIZE], conn.arena)
                slots.views[0][:] = data.data
                return (yield from shm.commit_slots(slots, False, None, [checksum]))

            return local.call(op, 10)

        assert put(right, ck.checksum(data)).statuses == [Status.OK]
        assert put(wrong, ck.checksum(data) ^ 1).statuses == [Status.OK]
    with Client(node.tcp_address, use_shm=False, timeout=10) as remote:
        assert bytes(remote.get([right]).values[0]) == data.tobytes()
        got = remote.get([wrong])
        assert got.statuses == [Status.CHECKSUM_MISMATCH] and got.num_found == 0
