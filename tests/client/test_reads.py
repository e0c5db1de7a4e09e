"""Reads against a real daemon: through the node's shared directory (no round trip for
sealed blocks, and a copy that raced a removal is never delivered), and through pins."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import pytest

from kvpool import Client, Status, directory
from kvpool.client import ops, reads
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
        time.sleep(0.02)
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
        op = reads.get_blocks([victim], [memoryview(out)], conn.arena, conn.directory, prefix=False)
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
