"""Write and read transactions (reserve / acquire by their older names): fill in place and
commit; pin, read in place and end."""

import time

import numpy as np
import pytest

from kvpool import Client, Status, UsageError
from kvpool import checksum as ck
from kvpool.client import writes
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


def _flip_a_byte(arena_path, offset):
    with open(arena_path, "r+b") as arena:
        arena.seek(offset)
        byte = arena.read(1)
        arena.seek(offset)
        arena.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_arena_bytes_are_never_handed_out_to_a_verifying_reader(node):
    """A reader that asks to verify every block (``verify_reads``) finds damage done in
    place to a sealed block at once, and the node drops it."""
    with Client(node.unix_address, timeout=10, verify_reads=True) as client:
        keys = [key(f"bad-{i}") for i in range(3)]
        client.put(keys, [content(k, 50_000) for k in keys])
        with client.acquire(keys) as lease:
            offset = lease.offsets[1]
        _flip_a_byte(node.info["arena"], offset + 1234)
        with client.acquire(keys) as lease:
            assert lease.statuses == [Status.OK, Status.CHECKSUM_MISMATCH, Status.OK]
            assert lease.num_prefix == 1
        assert client.lookup(keys) == 1  # the corrupt block was dropped: it will be rewritten
        got = client.get(keys)
        assert got.statuses[1] is Status.NOT_FOUND


def test_the_scrubber_drops_a_block_damaged_in_place(start_node):
    """Sealed blocks are read on their host without hashing them again; a byte flipped in
    the arena under the node is found by its scrubber, and the block dropped and counted."""
    node = start_node(name="scrub", extra=["--scrub-rate", "1GiB"])
    with Client(node.unix_address, timeout=10) as client:
        keys = [key(f"scrub-{i}") for i in range(4)]
        client.put(keys, [content(k, 200_000) for k in keys])
        with client.acquire(keys) as lease:
            offset = lease.offsets[2]
        _flip_a_byte(node.info["arena"], offset + 99)
        deadline = time.monotonic() + 30
        while client.stats().scrub_dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
        assert stats.scrub_dropped == 1 and stats.corrupt_reports == 1
        assert stats.scrubbed_bytes >= 4 * 200_000
        got = client.get(keys)
        assert got.statuses == [Status.OK, Status.OK, Status.NOT_FOUND, Status.OK]
        assert got.values[3] == content(keys[3], 200_000).tobytes()


def fill_and_commit(client: Client, keys: list[bytes], values: list[np.ndarray]) -> bool:
    """A zero-copy write lease: its bytes are not the client's copies, so the node seals them."""
    with client.reserve(keys, [len(v) for v in values]) as lease:
        for view, value in zip(lease.views, values, strict=True):
            np.frombuffer(view, np.uint8)[:] = value
        return lease.commit().all_stored


@pytest.mark.parametrize("write", ["put", "lease"])
def test_a_write_is_seen_at_once_by_another_client_and_survives_a_crash(start_node, write):
    """The node acknowledges a same-host commit before it publishes it (a put, with the
    checksums its writer computed) or hashes (seals) it (a zero-copy lease): reads on
    other connections wait for it, and a daemon killed meanwhile adopts the blocks."""
    node = start_node(name="seal", memory="256MiB")
    keys = [key(f"seal-{i}") for i in range(16)]
    values = [content(k, 4 << 20) for k in keys]  # 64 MiB: hashed off the event loop

    def stored(client: Client, keys: list[bytes]) -> bool:
        if write == "put":
            return client.put(keys, values).all_stored
        return fill_and_commit(client, keys, values)

    with Client(node.unix_address, timeout=10) as writer:
        with Client(node.unix_address, timeout=10) as reader:
            assert stored(writer, keys)
            assert reader.lookup(keys) == len(keys)  # no wait asked for: seen already
            got = reader.get(keys)
            assert [bytes(v) for v in got.values] == [v.tobytes() for v in values]
        more = [key(f"seal-more-{i}") for i in range(16)]
        assert stored(writer, more)
    node.kill()  # at once: the seal of `more` may still have been running
    again = start_node(name="seal", memory="256MiB")
    with Client(again.unix_address, timeout=10) as client:
        assert client.lookup(keys + more) == 32
        got = client.get(more)
        assert [bytes(v) for v in got.values] == [v.tobytes() for v in values]


# -- what backs a transaction: decided in one place per direction ----------------------


def _value(op):
    """The value of an op that finishes without an effect (no I/O)."""
    with pytest.raises(StopIteration) as stop:
        next(op)
    return stop.value.value


def test_off_the_nodes_host_a_copied_write_streams_and_a_filled_one_buffers():
    keys = [key("st-0"), key("st-1")]
    streamed = _value(writes.stage_write(keys, [10, 20], None, None, copied=True))
    assert streamed.backing is writes.Backing.STREAM and streamed.views == [None, None]
    buffered = _value(writes.stage_write(keys, [10, 20], None, None, copied=False))
    assert buffered.backing is writes.Backing.BUFFER
    assert [len(v) for v in buffered.views] == [10, 20] and buffered.offsets == [0, 10]
    assert buffered.buffer is not None and len(buffered.buffer) == 30  # side by side


def test_a_write_filled_in_place_gets_reserved_slots_and_the_given_checksums(client):
    keys = [key(f"bw-{i}") for i in range(3)]
    values = [content(k, 8192) for k in keys]
    with client.begin_write(keys, [8192] * 3) as write:
        assert write.backing is writes.Backing.RESERVATION and write.is_shm
        for view, value in zip(write.views, values, strict=True):
            view[:] = value
        result = write.commit(checksums=[ck.checksum(v) for v in values])
    assert result.all_stored
    assert [bytes(v) for v in client.get(keys).values] == [v.tobytes() for v in values]
    # Nothing left to reserve: every key is stored, and a commit says so without a slot.
    with client.begin_write(keys, [8192] * 3) as again:
        assert again.views == [None] * 3
        assert again.commit().statuses == [Status.EXISTS] * 3


def test_a_write_off_the_nodes_host_fills_private_buffers(tcp_client):
    keys = [key(f"pw-{i}") for i in range(3)]
    with tcp_client.begin_write(keys, [4096] * 3) as write:
        assert write.backing is writes.Backing.BUFFER and not write.is_shm
        extent = write.extent()
        assert extent is not None and len(extent) == 3 * 4096  # one copy fills them all
        extent[:] = b"".join(content(k, 4096).tobytes() for k in keys)
        assert write.commit(origins=[None] * 3).all_stored
    assert tcp_client.lookup(keys) == 3
    with pytest.raises(UsageError):
        tcp_client.begin_write(keys, [4096])


def test_a_read_listed_by_the_directory_holds_nothing(client):
    keys = [key(f"dr-{i}") for i in range(3)]
    values = [content(k, 8192) for k in keys]
    assert client.put(keys, values).all_stored
    read = client.begin_read(keys)
    assert read.still_held and read.num_prefix == 3
    assert [bytes(v) for v in read.views] == [v.tobytes() for v in values]
    assert client.stats().num_pinned == 0  # listed: read with no pin
    read.end()
    read.end()  # a second end does nothing


def test_a_pinned_read_holds_its_blocks_until_it_ends(node):
    keys = [key(f"pr-{i}") for i in range(3)]
    values = [content(k, 8192) for k in keys]
    with Client(node.unix_address, verify_reads=True) as verifying:  # no directory: pins
        assert verifying.put(keys, values).all_stored
        with verifying.begin_read(keys) as read:
            assert read.still_held and read.num_prefix == 3
            assert verifying.stats().num_pinned == 3
            assert [bytes(v) for v in read.views] == [v.tobytes() for v in values]
        assert verifying.stats().num_pinned == 0


def test_a_read_off_the_nodes_host_receives_the_blocks(tcp_client):
    keys = [key(f"rr-{i}") for i in range(3)]
    values = [content(k, 4096) for k in keys]
    assert tcp_client.put(keys[:2], values[:2]).all_stored
    with tcp_client.begin_read(keys, prefix=False) as read:
        assert read.statuses == [Status.OK, Status.OK, Status.NOT_FOUND]
        assert [bytes(v) for v in read.views[:2]] == [v.tobytes() for v in values[:2]]
        assert read.views[2] is None and read.extent() is None and read.still_held
