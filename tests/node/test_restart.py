"""A node that keeps what it holds: kill -9 and SIGTERM under load, --fresh, drain."""

import os
import random
import threading
import time
from collections import Counter

import pytest

from kvpool import Client, KVPoolError, Status
from tests.commands import run_kvpool
from tests.helpers import content, key, size_of


def _load(
    address: str, tag: str, stop: threading.Event, acked: set, errors: list, calls: Counter
) -> None:
    """Put and get deterministic blocks until stopped: a block's bytes derive from its key,
    so any reader can tell a right block from a wrong or torn one.  ``calls`` counts, by
    ``(tag, outcome)``, the put rounds that were acknowledged ("ok") and those that failed."""
    rng = random.Random(tag)
    with Client(address, timeout=2) as client:
        i = 0
        while not stop.is_set():
            keys = [key(f"{tag}-{i + j}") for j in range(4)]
            i += 4
            try:
                result = client.put(keys, [content(k, size_of(k, 1000, 200_000)) for k in keys])
                acked.update(
                    k
                    for k, s in zip(keys, result.statuses, strict=True)
                    if s in (Status.OK, Status.EXISTS)
                )
                sample = rng.sample(sorted(acked), min(8, len(acked))) if acked else []
                got = client.get(sample)
                for k, value in zip(sample, got.values, strict=True):
                    if value is not None and bytes(value) != content(k, len(value)).tobytes():
                        errors.append(f"wrong bytes for {k.hex()}")
                calls[tag, "ok"] += 1
            except KVPoolError:
                calls[tag, "failed"] += 1
                time.sleep(0.05)  # the node is down: keep trying, as an engine would


def _restart_under_load(start_node, stop_node) -> None:
    node = start_node(name="warm", memory="48MiB")
    tags = [f"w{t}" for t in range(3)]
    # Every key is there before the writers start: a copy taken while they count sees no
    # key added.
    calls = Counter({(tag, outcome): 0 for tag in tags for outcome in ("ok", "failed")})
    stop, acked, errors = threading.Event(), set(), []
    threads = [
        threading.Thread(target=_load, args=(node.unix_address, tag, stop, acked, errors, calls))
        for tag in tags
    ]
    for t in threads:
        t.start()

    def wait_each(outcome: str, since: Counter, what: str) -> None:
        """Until every writer has had a call with ``outcome`` after ``since``."""
        deadline = time.monotonic() + 30
        while any(calls[tag, outcome] <= since[tag, outcome] for tag in tags):
            assert time.monotonic() < deadline, f"{what}: {calls}"
            time.sleep(0.01)

    try:
        deadline = time.monotonic() + 30
        while len(acked) < 150 and time.monotonic() < deadline:
            time.sleep(0.02)
        before = set(acked)
        stop_node(node)  # mid-run: puts and gets in flight
        wait_each("failed", Counter(calls), "a writer never saw the node go")
        acknowledged = set(acked)  # everything a writer was told is stored, up to the end
        restarted = start_node(name="warm", memory="48MiB")
        assert restarted.info["adopted_blocks"] > 0
        wait_each("ok", Counter(calls), "a writer did not reconnect on its own and go on")
        wait_each("ok", Counter(calls), "a writer did not go on")  # and one more round each
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(before) >= 150 and not errors, errors[:3]
    with Client(restarted.unix_address, timeout=10) as client:
        stats = client.stats()
        evicted = stats.evictions  # after the restart: adopted blocks evicted by new puts
        keys = sorted(acknowledged)
        found = client.get(keys)
        wrong = [
            k
            for k, v in zip(keys, found.values, strict=True)
            if v is not None and bytes(v) != content(k, len(v)).tobytes()
        ]
        assert not wrong, f"{len(wrong)} wrong blocks served"
        missing = [k for k, s in zip(keys, found.statuses, strict=True) if s is not Status.OK]
        # Every acknowledged block is there, but those evicted since to make room.
        assert len(missing) <= evicted, (len(missing), evicted, len(keys))
        assert client.stats().corrupt_reports == 0  # nothing torn was ever handed out
        assert stats.reserved_bytes == 0 or stats.reserved_bytes < 48 << 20


def test_kill_9_under_load_keeps_every_acknowledged_block(start_node):
    _restart_under_load(start_node, lambda node: node.kill())


def test_sigterm_under_load_keeps_every_acknowledged_block(start_node):
    _restart_under_load(start_node, lambda node: node.stop())


def test_a_block_being_written_when_the_daemon_died_is_never_adopted(start_node):
    from kvpool.client.connection import Connection
    from kvpool.config import Address
    from tests.helpers import reserve_op

    node = start_node(name="torn", memory="16MiB")
    with Client(node.unix_address) as client:
        client.put([key("whole")], [content(key("whole"), 50_000)])
        writer = Connection(Address.parse(node.unix_address), client.config, time.monotonic() + 5)
        reserved = writer.run(reserve_op([key("half")], [50_000]), time.monotonic() + 5)
        assert reserved.statuses == [Status.OK]
        with open(node.info["arena"], "r+b") as arena:  # half of it written
            arena.seek(reserved.offsets[0])
            arena.write(content(key("half"), 50_000).tobytes()[:25_000])
    node.kill()
    writer.close()
    again = start_node(name="torn", memory="16MiB")
    with Client(again.unix_address) as client:
        assert client.lookup([key("whole")]) == 1 and client.lookup([key("half")]) == 0
        assert client.put([key("half")], [content(key("half"), 50_000)]).all_stored


def test_adopted_blocks_are_verified_before_they_are_served(start_node):
    node = start_node(name="verify", memory="16MiB")
    keys = [key(f"v{i}") for i in range(4)]
    with Client(node.unix_address) as client:
        client.put(keys, [content(k, 30_000) for k in keys])
        with client.acquire(keys) as lease:
            offset = lease.offsets[2]
    node.kill()
    with open(node.info["arena"], "r+b") as arena:  # garbled while no daemon ran
        arena.seek(offset + 7)
        arena.write(b"\x00\xff\x00")
    again = start_node(name="verify", memory="16MiB")
    with Client(again.unix_address) as client, Client(again.tcp_address, use_shm=False) as remote:
        for reader in (client, remote):
            got = reader.get(keys)
            assert got.statuses[2] in (Status.CHECKSUM_MISMATCH, Status.NOT_FOUND)
            assert got.values[0] == content(keys[0], 30_000).tobytes()
        assert client.stats().corrupt_reports >= 1  # dropped, never served


def test_a_new_size_or_fresh_starts_empty_and_drain_empties(start_node, run_dir):
    node = start_node(name="sizes", memory="16MiB")
    with Client(node.unix_address) as client:
        client.put([key("s")], [b"s" * 1000])
    node.stop()
    bigger = start_node(name="sizes", memory="32MiB")  # another size: another arena
    assert bigger.info["adopted_blocks"] == 0 and bigger.info["arena_bytes"] == 32 << 20
    with Client(bigger.unix_address) as client:
        client.put([key("s")], [b"s" * 1000])
    arena = bigger.info["arena"]
    from kvpool.client import ops
    from kvpool.errors import BadRequest

    with Client(bigger.unix_address) as client, pytest.raises(BadRequest, match="sent to"):
        client.local.call(lambda _: ops.shutdown("another-node", True), 5)  # nothing by chance
    assert bigger.is_running and os.path.exists(arena)
    drained = run_kvpool("drain", "--address", bigger.unix_address)
    assert drained.returncode == 0, drained.stderr
    assert bigger.proc.wait(30) == 0
    assert not os.path.exists(arena) and not os.path.exists(os.path.dirname(arena) + "/index")
    after = start_node(name="sizes", memory="32MiB")
    assert after.info["adopted_blocks"] == 0


@pytest.mark.parametrize("memory", ["1GiB"])
def test_a_warm_start_is_quick(start_node, memory):
    node = start_node(name="quick", memory=memory)
    block = b"q" * (1 << 20)
    with Client(node.unix_address) as client:
        for batch in range(8):
            keys = [key(f"q{batch}-{i}") for i in range(64)]
            client.put(keys, [block] * 64)
    node.kill()
    again = start_node(name="quick", memory=memory)
    assert again.info["adopted_blocks"] == 512
    # How long it took is a benchmark (docs/benchmarks.md); here: it said.
    assert again.info["started_in_s"] > 0
