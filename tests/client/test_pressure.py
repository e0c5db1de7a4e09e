"""Many clients, memory pressure and leases against a real daemon: never a wrong or torn
block, and nothing a dead or stalled client holds stays held."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvpool import Client, LeaseExpired, Status
from kvpool.client import ops
from kvpool.client.connection import Connection
from kvpool.config import Address
from kvpool.protocol.frames import encode_frame
from kvpool.protocol.messages import (
    CHECKSUM_BYTES,
    Op,
    PinRequest,
    PinResponse,
    PutRequest,
    ReserveRequest,
    ReserveResponse,
)
from tests.helpers import commit_op, content, key, reserve_op, size_of


def _check(values, keys, got):
    for k, status, value in zip(keys, got.statuses, got.values, strict=True):
        assert status in (Status.OK, Status.NOT_FOUND), f"{status!r}: torn or corrupt memory"
        if status is Status.OK:
            assert bytes(value) == content(k, len(value)).tobytes(), "wrong bytes served"
            assert len(value) == size_of(k), "wrong size served"


def test_32_clients_hammering_the_same_keys(node):
    keys = [key(f"hot-{i}") for i in range(40)]
    errors: list[BaseException] = []
    counts = {"put": 0, "hits": 0}
    lock = threading.Lock()

    def worker(n: int) -> None:
        rng = random.Random(n)
        address = node.unix_address if n % 2 else node.tcp_address
        try:
            with Client(address, use_shm=bool(n % 2), timeout=20) as c:
                for _ in range(25):
                    batch = rng.sample(keys, 6)
                    if rng.random() < 0.5:
                        result = c.put(batch, [content(k, size_of(k)) for k in batch])
                        assert all(
                            s in (Status.OK, Status.EXISTS, Status.PENDING) for s in result.statuses
                        )
                        with lock:
                            counts["put"] += 1
                    else:
                        got = c.get(batch)
                        _check(None, batch, got)
                        with lock:
                            counts["hits"] += got.num_found
                    c.lookup(batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert counts["put"] > 0 and counts["hits"] > 0
    with Client(node.unix_address) as c:
        got = c.get(keys)
        _check(None, keys, got)
        assert c.stats().num_connections >= 1
        assert c.stats().corrupt_reports == 0


def test_eviction_under_pressure_never_serves_wrong_or_torn_blocks(start_node):
    node = start_node(name="tight", memory="8MiB")
    errors: list[BaseException] = []
    # A count of writes, not a time: 600 puts of 4 blocks (about 240 MiB through 8 MiB, some
    # 2,000 evictions), read all along; what 8 s gave on an idle machine was 2,000 puts.
    writes_done = threading.Event()

    def writer(n: int) -> None:
        rng = random.Random(n)
        try:
            with Client(
                node.unix_address if n % 2 else node.tcp_address, use_shm=bool(n % 2), timeout=20
            ) as c:
                for _ in range(150):
                    batch = [key(f"ev-{rng.randrange(400)}") for _ in range(4)]
                    c.put(batch, [content(k, size_of(k, 1000, 400_000)) for k in batch])
        except BaseException as exc:
            errors.append(exc)

    def reader(n: int) -> None:
        rng = random.Random(1000 + n)
        try:
            with Client(
                node.unix_address if n % 2 else node.tcp_address, use_shm=bool(n % 2), timeout=20
            ) as c:
                while not writes_done.is_set():
                    batch = [key(f"ev-{rng.randrange(400)}") for _ in range(6)]
                    got = c.get(batch)
                    for k, status, value in zip(batch, got.statuses, got.values, strict=True):
                        assert status in (Status.OK, Status.NOT_FOUND), status
                        if status is Status.OK:
                            assert bytes(value) == content(k, size_of(k, 1000, 400_000)).tobytes()
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    readers = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(120)
    writes_done.set()
    for t in readers:
        t.join(60)
    assert not errors, errors[:3]
    with Client(node.unix_address) as c:
        assert c.stats().corrupt_reports == 0  # no reader ever met a torn or reused block
    with Client(node.unix_address) as c:
        stats = c.stats()
    assert stats.evictions > 50, stats.evictions
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.reserved_bytes == 0 and stats.num_pinned == 0


def _raw(node, client):
    return Connection(Address.parse(node.unix_address), client.config, time.monotonic() + 5)


def _pin(keys, lease_ms):
    yield ops.Request(Op.PIN, PinRequest(keys=keys, lease_ms=lease_ms))
    response, _ = yield ops.Recv(Op.PIN, PinResponse)
    return response


def _fill(client, tag, num_bytes, block=256 << 10):
    for i in range(num_bytes // block):
        client.put([key(f"{tag}-{i}")], [np.zeros(block, np.uint8)])


def test_pins_protect_blocks_until_their_lease_expires(start_node):
    node = start_node(name="lease", memory="4MiB")
    with Client(node.unix_address) as c:
        c.put([key("precious")], [content(key("precious"), 100_000)])
        holder = _raw(node, c)
        block, pin_id = 256 << 10, 0
        for i in range((12 << 20) // block):  # 3x the arena of writes
            # Before each write the holder takes a new pin of 1.5 s and lets the one it held
            # go: a loaded machine's flood may outlast one lease, a single write never does.
            pinned = holder.run(_pin([key("precious")], lease_ms=1500), time.monotonic() + 5)
            pinned_at = time.monotonic()
            assert pinned.statuses == [Status.OK]
            if pin_id:
                holder.run(ops.unpin(pin_id), time.monotonic() + 5)
            pin_id = pinned.pin_id
            c.put([key(f"flood-1-{i}")], [np.zeros(block, np.uint8)])
        assert c.lookup([key("precious")]) == 1  # pinned: survived 3x the arena of writes
        # (Asked on the holder's connection: after its last UNPIN, which has no reply.)
        assert holder.run(ops.stats(), time.monotonic() + 5).num_pinned == 1
        deadline = pinned_at + 10  # the holder never unpins: its last lease (1.5 s) expires
        while c.stats().num_pinned and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats().num_pinned == 0 and time.monotonic() - pinned_at >= 1.0
        _fill(c, "flood-2", 12 << 20)
        assert c.lookup([key("precious")]) == 0
        holder.close()


def test_the_node_clamps_every_lease_to_its_bound(start_node):
    # A client asking for 600 s gets what KVPOOL_PIN_LEASE / KVPOOL_RESERVE_LEASE allow.
    bounds = {"KVPOOL_PIN_LEASE": "1", "KVPOOL_RESERVE_LEASE": "1.5"}
    node = start_node(name="clamp", memory="4MiB", env=bounds)
    with Client(node.unix_address) as c:
        c.put([key("pinned")], [b"p" * 10_000])
        holder = _raw(node, c)
        pinned = holder.run(_pin([key("pinned")], lease_ms=600_000), time.monotonic() + 5)
        assert pinned.statuses == [Status.OK] and pinned.lease_ms == 1000
        reserved = holder.run(reserve_op([key("half")], [50_000], 600_000), time.monotonic() + 5)
        assert reserved.statuses == [Status.OK] and reserved.lease_ms == 1500
        assert c.stats().num_pinned == 1 and c.stats().reserved_bytes == 50_000
        deadline = time.monotonic() + 10  # both expire though the holder stays connected
        while time.monotonic() < deadline and (c.stats().num_pinned or c.stats().reserved_bytes):
            time.sleep(0.05)
        assert c.stats().num_pinned == 0 and c.stats().reserved_bytes == 0
        with pytest.raises(LeaseExpired):
            holder.run(commit_op(reserved.reservation_id), time.monotonic() + 5)
        assert c.lookup([key("half")]) == 0 and c.put([key("half")], [b"h"]).all_stored
        # The SDK's own leases ask for nothing, and get the bound too.  (A client that
        # hashes every read pins even blocks the node's directory lists.)
        with Client(node.unix_address, verify_reads=True) as v, v.acquire([key("pinned")]) as lease:
            assert lease.num_prefix == 1 and c.stats().num_pinned == 1
            started = time.monotonic()
            while time.monotonic() - started < 10 and c.stats().num_pinned:
                time.sleep(0.05)
            assert c.stats().num_pinned == 0 and time.monotonic() - started >= 0.9
        holder.close()


def test_a_dead_clients_pins_and_reservations_are_released(start_node):
    node = start_node(name="dead", memory="4MiB")
    script = textwrap.dedent(f"""
        import time, sys
        from kvpool import Client
        from kvpool.client import ops
        from kvpool.protocol.messages import (
            Op, PinRequest, PinResponse, ReserveRequest, ReserveResponse)
        from tests.helpers import key
        c = Client({node.unix_address!r})
        def pin_and_reserve():
            yield ops.Request(Op.PIN, PinRequest(keys=[key("held")], lease_ms=600000))
            yield ops.Recv(Op.PIN, PinResponse)
            reserve = ReserveRequest(keys=[key("half")], sizes=[500000], lease_ms=600000)
            yield ops.Request(Op.RESERVE, reserve)
            yield ops.Recv(Op.RESERVE, ReserveResponse)
        c.local.call(lambda arena: pin_and_reserve())
        print("holding", flush=True)
        time.sleep(600)
    """)
    with Client(node.unix_address) as c:
        c.put([key("held")], [b"h" * 100_000])
        proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        )
        assert proc.stdout.readline().strip() == "holding"
        stats = c.stats()
        assert stats.num_pinned == 1 and stats.reserved_bytes == 500000
        assert c.lookup([key("half")]) == 0 and c.exists([key("half")]) == [False]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (c.stats().num_pinned or c.stats().reserved_bytes):
            time.sleep(0.05)
        stats = c.stats()
        assert stats.num_pinned == 0 and stats.reserved_bytes == 0


def test_reservations_that_time_out_are_reclaimed(start_node):
    node = start_node(name="zombie", memory="4MiB")
    with Client(node.unix_address) as c:
        writer = _raw(node, c)

        def reserve():
            yield ops.Request(
                Op.RESERVE, ReserveRequest(keys=[key("zombie")], sizes=[1 << 20], lease_ms=300)
            )
            response, _ = yield ops.Recv(Op.RESERVE, ReserveResponse)
            return response

        assert writer.run(reserve(), time.monotonic() + 5).statuses == [Status.OK]
        assert c.stats().reserved_bytes == 1 << 20
        deadline = time.monotonic() + 0.8  # its lease of 0.3 s, and the node's next sweep
        while c.stats().reserved_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats().reserved_bytes == 0
        assert c.put([key("zombie")], [b"z"]).statuses == [Status.OK]  # the key is free again
        writer.close()


def test_a_stalled_put_keeps_its_memory_until_its_connection_is_dropped(start_node):
    # The reservation of a PUT being received never expires under the session's feet (the
    # memory could go to another key mid-receive); the receive itself is bounded, and a
    # sender that stalls past it loses its connection, which returns the memory.
    node = start_node(name="stall", memory="4MiB", env={"KVPOOL_RESERVE_LEASE": "1"})
    with Client(node.unix_address) as c:
        raw = _raw(node, c)
        request = PutRequest(keys=[key("slow")], sizes=[1 << 20])
        frame = encode_frame(Op.PUT, request, payload_len=(1 << 20) + CHECKSUM_BYTES)
        raw.channel.send([frame, b"\0" * CHECKSUM_BYTES, b"x" * 1000])  # then nothing
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and c.stats().reserved_bytes != 1 << 20:
            time.sleep(0.02)
        assert c.stats().reserved_bytes == 1 << 20
        time.sleep(0.6)
        assert c.stats().reserved_bytes == 1 << 20  # still the stalled session's
        sock = raw.channel.sock
        sock.settimeout(5)
        assert sock.recv(1) == b""  # dropped when the bounded receive ran out
        assert c.stats().reserved_bytes == 0
        assert c.put([key("slow")], [b"s"]).statuses == [Status.OK]
        raw.close()
