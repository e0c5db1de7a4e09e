"""Round trips through a real daemon, same-node (shared memory) and over TCP."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import AsyncClient, Client, Status, UsageError
from kvpool.client import ops
from kvpool.client.connection import Connection
from kvpool.config import Address
from tests.helpers import content, key

SIZES = st.integers(min_value=0, max_value=3 << 20)


@pytest.fixture(params=["shm", "tcp"])
def any_client(request, client, tcp_client):
    chosen = client if request.param == "shm" else tcp_client
    assert chosen.uses_shm == (request.param == "shm")
    return chosen


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(SIZES, min_size=1, max_size=6), tag=st.integers(0, 1 << 30))
def test_round_trip_at_many_sizes(any_client, sizes, tag):
    keys = [key(f"rt-{tag}-{i}-{s}") for i, s in enumerate(sizes)]
    values = [content(k, s) for k, s in zip(keys, sizes, strict=True)]
    assert any_client.put(keys, values).num_stored == len(keys)
    got = any_client.get(keys)
    assert got.statuses == [Status.OK] * len(keys)
    for value, expected in zip(got.values, values, strict=True):
        assert bytes(value) == expected.tobytes()
    buffers = [np.zeros(s + 7, dtype=np.uint8) for s in sizes]  # larger buffers are fine
    got = any_client.get(keys, buffers)
    assert got.sizes == sizes
    for buffer, expected, size in zip(buffers, values, sizes, strict=True):
        assert (buffer[:size] == expected).all()
    any_client.delete(keys)


def test_lookup_is_the_longest_present_prefix(any_client):
    keys = [key(f"prefix-{i}") for i in range(10)]
    any_client.put([keys[i] for i in (0, 1, 2, 4, 5)], [b"v"] * 5)
    assert any_client.lookup(keys) == 3
    assert any_client.lookup(keys[:2]) == 2
    assert any_client.lookup(keys[3:]) == 0
    assert any_client.lookup([]) == 0
    assert any_client.exists(keys[:6]) == [True, True, True, False, True, True]
    got = any_client.get(keys[:6], prefix=True)
    assert got.num_prefix == 3 and got.statuses[3:] == [Status.NOT_FOUND] * 3


def test_put_reports_existing_keys(any_client):
    k = [key("dup")]
    assert any_client.put(k, [b"a"]).statuses == [Status.OK]
    assert any_client.put(k, [b"a"]).statuses == [Status.EXISTS]
    assert any_client.put(k, [b"a"]).all_stored


def test_small_destination_buffers_are_refused_per_key(any_client):
    k = [key("big"), key("small")]
    any_client.put(k, [b"x" * 1000, b"y" * 10])
    got = any_client.get(k, [bytearray(10), bytearray(10)])
    assert got.statuses == [Status.REFUSED, Status.OK]
    assert any_client.get(k).statuses == [Status.OK, Status.OK]  # the connection is still fine


def test_torch_tensors_of_any_dtype(any_client):
    k = [key("tensor")]
    value = torch.randn(2, 4, 32, 128, dtype=torch.float32).to(torch.bfloat16)
    any_client.put(k, [value])
    out = torch.zeros_like(value)
    assert any_client.get(k, [out]).found == [True]
    assert torch.equal(out, value)
    with pytest.raises(UsageError):
        any_client.put(k, [value.t() if value.dim() == 2 else value.transpose(0, 1)])


def test_usage_errors(any_client):
    with pytest.raises(UsageError):
        any_client.put([key(1)], [b"a", b"b"])
    with pytest.raises(UsageError):
        any_client.get([key(1)], [b"read-only"])


def test_futures_for_asynchronous_save_and_load(any_client):
    keys = [key(f"fut-{i}") for i in range(8)]
    values = [content(k, 200_000) for k in keys]
    saving = any_client.put_async(keys, values)
    assert saving.result(10).all_stored and saving.ready()
    buffers = [np.empty(200_000, np.uint8) for _ in keys]
    loading = any_client.get_async(keys, buffers)
    assert loading.result(10).num_found == 8
    assert all((b == v).all() for b, v in zip(buffers, values, strict=True))


def test_lookup_waits_for_keys_being_written(node, client):
    k = [key("slow-1"), key("slow-2")]
    # A writer reserves the keys (they are now pending) and commits a moment later, on the
    # same connection: a reservation belongs to the connection that made it.
    writer = Connection(Address.parse(node.unix_address), client.config, time.monotonic() + 5)
    reserved = writer.run(_reserve_only(k), time.monotonic() + 5)
    timer = threading.Timer(0.3, lambda: writer.run(_commit(reserved), time.monotonic() + 5))
    timer.start()
    start = time.monotonic()
    assert client.lookup(k) == 0  # no wait: not there yet
    assert client.lookup(k, wait=5.0) == 2
    assert 0.2 < time.monotonic() - start < 3.0
    timer.join()
    writer.close()
    # Keys nobody writes are waited for only with wait_absent, and only up to the bound.
    start = time.monotonic()
    assert client.lookup([key("never")], wait=0.3) == 0
    assert time.monotonic() - start < 0.2
    assert client.lookup([key("never")], wait=0.3, wait_absent=True) == 0
    assert 0.25 < time.monotonic() - start < 2.0


def _reserve_only(keys):
    from kvpool.protocol.messages import Op, ReserveRequest, ReserveResponse

    yield ops.Request(Op.RESERVE, ReserveRequest(keys=keys, sizes=[10] * len(keys)))
    response, _ = yield ops.Recv(Op.RESERVE, ReserveResponse)
    return response


def _commit(reserved):
    from kvpool.protocol.messages import CommitRequest, CommitResponse, Op

    yield ops.Request(Op.COMMIT, CommitRequest(reservation_id=reserved.reservation_id))
    yield ops.Recv(Op.COMMIT, CommitResponse)


def test_async_client(node):
    async def main():
        for address, shm in ((node.unix_address, True), (node.tcp_address, False)):
            async with AsyncClient(address, use_shm=shm) as ac:
                keys = [key(f"async-{shm}-{i}") for i in range(20)]
                values = [content(k, 3 << 20 if i == 0 else 5000) for i, k in enumerate(keys)]
                results = await asyncio.gather(
                    ac.put(keys[:10], values[:10]), ac.put(keys[10:], values[10:])
                )
                assert all(r.all_stored for r in results)
                assert await ac.lookup(keys) == 20
                got = await ac.get(keys)
                assert [bytes(v) for v in got.values] == [v.tobytes() for v in values]
                assert (await ac.stats()).num_blocks >= 20
                assert (await ac.health()).ok

    asyncio.run(main())


def test_default_client_reads_environment(node, monkeypatch):
    monkeypatch.setenv("KVPOOL_ADDRESS", node.tcp_address)
    monkeypatch.setenv("KVPOOL_USE_SHM", "0")
    with Client() as c:
        assert c.config.address == node.tcp_address and not c.uses_shm
        assert c.health().ok


def test_a_large_arena_is_mapped_at_once_and_populated_behind(start_node):
    """Past 2 GiB the client maps the arena without populating it, and a thread faults its
    page tables in; blocks written meanwhile round-trip, and the thread ends."""
    import gc

    from kvpool import mapping

    node = start_node(name="large", memory="3GiB")
    values = [bytes([i]) * (1 << 20) for i in range(8)]
    keys = [key(f"large-{i}") for i in range(8)]
    with Client(node.unix_address, timeout=30) as client:
        assert client.uses_shm
        threads = [t for t in threading.enumerate() if t.name == "kvpool-arena-populate"]
        assert threads  # populating behind the caller
        assert client.put(keys, values).all_stored
        got = client.get(keys)
        assert [bytes(v) for v in got.values] == values
    del client, got
    gc.collect()
    for thread in threads:
        thread.join(30)  # done, or stopped once nobody maps the arena
        assert not thread.is_alive()
    assert mapping.SYNC_POPULATE_MAX_BYTES < 3 << 30
