"""Zero-copy leases: fill in place and commit; pin, read in place and release."""

import numpy as np
import pytest

from kvpool import Status, UsageError
from tests.helpers import content, key


@pytest.fixture(params=["shm", "tcp"])
def any_client(request, client, tcp_client):
    return client if request.param == "shm" else tcp_client


def test_write_lease_fills_in_place_and_commits(any_client):
    keys = [key(f"wl-{i}") for i in range(4)]
    any_client.put([keys[1]], [content(keys[1], 8192)])  # one exists already
    with any_client.reserve(keys, [8192] * 4) as lease:
        assert lease.is_shm == any_client.uses_shm
        for k, view in zip(keys, lease.views, strict=True):
            if view is not None:
                np.frombuffer(view, np.uint8)[:] = content(k, 8192)
        if any_client.uses_shm:
            assert lease.statuses[1] is Status.EXISTS and lease.views[1] is None
            state = any_client.lookup_state(keys)
            assert (state.num_prefix, state.is_next_pending) == (0, True)  # pending until commit
        result = lease.commit()
    assert result.all_stored
    got = any_client.get(keys)
    assert [bytes(v) for v in got.values] == [content(k, 8192).tobytes() for k in keys]
    with pytest.raises(UsageError):
        lease.commit()


def test_contiguous_extent_of_a_batch(client):
    keys = [key(f"ext-{i}") for i in range(8)]
    with client.reserve(keys, [16384] * 8) as lease:
        extent = lease.extent()
        assert extent is not None and len(extent) == 8 * 16384
        np.frombuffer(extent, np.uint8)[:] = np.concatenate([content(k, 16384) for k in keys])
        assert lease.commit().all_stored
    with client.acquire(keys) as reading:
        assert reading.num_prefix == 8
        extent = reading.extent()
        assert extent is not None
        assert bytes(extent) == b"".join(content(k, 16384).tobytes() for k in keys)


def test_aborted_write_lease_publishes_nothing(client):
    keys = [key("abort-me")]
    with client.reserve(keys, [4096]) as lease:
        lease.views[0][:4] = b"half"
    assert client.lookup(keys) == 0
    assert client.stats().reserved_bytes == 0
    assert client.put(keys, [b"whole"]).statuses == [Status.OK]


def test_read_lease_verifies_and_pins(any_client):
    keys = [key(f"rl-{i}") for i in range(5)]
    any_client.put(keys[:3], [content(k, 10_000) for k in keys[:3]])
    with any_client.acquire(keys) as lease:
        assert lease.num_prefix == 3
        assert lease.statuses[3:] == [Status.NOT_FOUND] * 2
        assert bytes(lease.views[2]) == content(keys[2], 10_000).tobytes()
        if any_client.uses_shm:
            assert any_client.stats().num_pinned == 3
    assert any_client.stats().num_pinned == 0


def test_corrupted_arena_bytes_are_never_handed_out(node, client):
    keys = [key(f"bad-{i}") for i in range(3)]
    client.put(keys, [content(k, 50_000) for k in keys])
    with client.acquire(keys) as lease:
        offset = lease.offsets[1]
    with open(node.info["arena"], "r+b") as arena:  # flip one byte of block 1 in the arena
        arena.seek(offset + 1234)
        byte = arena.read(1)
        arena.seek(offset + 1234)
        arena.write(bytes([byte[0] ^ 0xFF]))
    with client.acquire(keys) as lease:
        assert lease.statuses == [Status.OK, Status.CHECKSUM_MISMATCH, Status.OK]
        assert lease.num_prefix == 1
    assert client.lookup(keys) == 1  # the corrupt block was dropped: it will be rewritten
    got = client.get(keys)
    assert got.statuses[1] is Status.NOT_FOUND
