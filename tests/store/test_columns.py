"""A request's blocks taken together (columns) leave every structure exactly as the same
blocks taken one at a time do: the index, the shared directory, the LRU lists, the reuse
sampler, the journal's records, and the store's two ways into the index (a placed commit,
and pending blocks published)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvpool.config import PAGE_BYTES
from kvpool.directory import DirectoryReader, DirectoryWriter
from kvpool.errors import Status
from kvpool.keys import MAX_KEY_BYTES, MIN_KEY_BYTES
from kvpool.store.block_store import BlockStore
from kvpool.store.eviction import LRUPolicy
from kvpool.store.index import BlockIndex, KeyColumns
from kvpool.store.journal import COMMIT, Journal, _block_records, _record, read_journal
from kvpool.store.reuse import ReuseSampler


def keys_of(rng: random.Random, n: int, width: int | None = 48) -> list[bytes]:
    return [rng.randbytes(width or rng.randint(MIN_KEY_BYTES, MAX_KEY_BYTES)) for _ in range(n)]


@pytest.mark.parametrize("width", [48, None], ids=["one-length", "mixed-lengths"])
def test_the_index_finds_and_inserts_a_batch_as_one_key_at_a_time(width):
    rng = random.Random(1)
    index = BlockIndex(4096)  # 8,192 buckets, kept up to half full: long probe runs
    model: dict[bytes, int] = {}
    for _ in range(40):
        batch = list(dict.fromkeys(keys_of(rng, rng.randint(1, 200), width)))
        batch = [k for k in batch if k not in model]
        n = len(batch)
        offsets = np.arange(n, dtype=np.int64) * PAGE_BYTES
        slots = index.insert_many(
            KeyColumns(batch), offsets, np.full(n, 100), np.arange(n, dtype=np.uint64), sealed=True
        )
        model.update(zip(batch, slots.tolist(), strict=True))
        for key in rng.sample(sorted(model), min(len(model), 60)):
            slot = model.pop(key)
            index.unlink(slot)
            index.release(slot)
    asked = list(model) + keys_of(rng, 300, width)
    assert index.find_many(KeyColumns(asked)).tolist() == [index.find(k) for k in asked]
    assert all(index.find(k) == s and index.key(s) == k for k, s in model.items())
    assert len(index) == len(model)


def test_a_batch_listed_in_the_directory_is_found_by_readers_as_if_listed_one_by_one(
    tmp_path: Path,
):
    rng = random.Random(2)
    arena = 1 << 30
    writer = DirectoryWriter(tmp_path / "directory", arena, b"a" * 16, num_slots=1 << 12)
    reader = DirectoryReader.open(str(tmp_path / "directory"), b"a" * 16, arena)
    assert reader is not None
    listed: dict[bytes, tuple[int, int]] = {}
    for _ in range(8):  # past the table's room: the last batches are listed in part
        batch = keys_of(rng, 500)
        offsets = np.array([rng.randrange(1 << 18) * PAGE_BYTES for _ in batch], dtype=np.int64)
        sizes = np.array([rng.randrange(1, 1 << 16) for _ in batch], dtype=np.int64)
        was_listed = writer.list_many(batch, offsets, sizes)
        places = zip(batch, offsets.tolist(), sizes.tolist(), was_listed, strict=True)
        for key, offset, size, yes in places:
            if yes:
                listed[key] = (offset, size)
        for key in rng.sample(sorted(listed), 100):
            writer.withdraw(key)
            del listed[key]
    assert len(writer) == len(listed) and writer.num_unlisted > 0
    for key, place in listed.items():
        found = reader.find(key)
        assert found is not None and found[2:] == place and found[1] % 2 == 0
    writer.close()


@pytest.mark.parametrize("grouped", [False, True])
def test_lru_touches_and_removals_of_a_batch_order_blocks_as_one_at_a_time(grouped):
    rng = random.Random(3)
    one, many = LRUPolicy(), LRUPolicy()
    for policy in (one, many):
        policy.bind(600, bytes)
        if grouped:
            policy.regroup(lambda slot: slot % 3)
    for _ in range(300):
        slots = rng.sample(range(600), rng.randint(1, 50))
        if rng.random() < 0.6:
            for slot in slots:
                one.touch(slot)
            many.touch_many(np.array(slots, dtype=np.int64))
        else:
            for slot in slots:
                one.remove(slot)
            many.remove_many(np.array(slots, dtype=np.int64))
        assert len(one) == len(many)
    order = []
    for policy in (one, many):
        victims = []
        for slot in policy.victims():
            victims.append(slot)
            policy.remove(slot)
        order.append(victims)
    assert order[0] == order[1] and len(order[0]) > 100


def test_the_reuse_sampler_counts_a_batch_as_its_accesses_one_at_a_time():
    rng = random.Random(4)
    one, many = (ReuseSampler(max_samples=50, half_life=30, seed=9) for _ in range(2))
    for sampler in (one, many):
        sampler.set_horizon(500)
    for _ in range(300):
        batch = rng.sample(range(400), rng.randint(1, 60))
        if rng.random() < 0.2:
            batch += batch[:3]  # a key named twice in one request
        hit = rng.random() < 0.5
        for key_hash in batch:
            one.access(key_hash, hit)
        many.access_many(batch, hit)
    assert one.num_accesses == many.num_accesses and one.num_followed == many.num_followed
    assert one.hit_rates([10, 100, 1000]) == many.hit_rates([10, 100, 1000])
    assert one.hit_rates([100])[0] is not None and one.observed_hit_rate == many.observed_hit_rate


def test_a_batchs_journal_records_are_the_records_of_its_blocks(tmp_path: Path):
    rng = random.Random(5)
    keys = keys_of(rng, 64)
    offsets = np.array([rng.randrange(1 << 40) for _ in keys], dtype=np.int64)
    sizes = np.array([rng.randrange(1 << 30) for _ in keys], dtype=np.int64)
    checksums = np.array([rng.randrange(1 << 64) for _ in keys], dtype=np.uint64)
    rows = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1)
    one_by_one = (
        _record(COMMIT, k, int(o), int(s), int(c))
        for k, o, s, c in zip(keys, offsets, sizes, checksums, strict=True)
    )
    assert _block_records(COMMIT, rows, offsets, sizes, checksums) == b"".join(one_by_one)
    journal = Journal(tmp_path / "journal", 1, 2, 1 << 41)
    journal.commit()
    journal.committed_many(rows, offsets, sizes, checksums)
    replay = read_journal(tmp_path / "journal")
    assert replay.keys == keys and replay.checksums.tolist() == checksums.tolist()


def test_a_placed_commit_leaves_the_store_as_placing_then_publishing_does():
    """The two ways into the index: a write area's blocks hashed by their writer (straight
    in), and pending blocks published."""
    rng = random.Random(6)
    stores = [BlockStore(2048 * PAGE_BYTES, high_watermark=1.0, low_watermark=1.0) for _ in "ab"]
    placed, published = stores
    held = keys_of(rng, 10)
    for store in stores:
        store.commit(store.reserve(held, [100] * 10, owner=1).reservation_id, [1] * 10, owner=1)
    batch = keys_of(rng, 40) + held[:5]  # five already held: EXISTS
    sizes = [rng.randrange(1, 2 * PAGE_BYTES) for _ in batch]  # 1 or 2 pages each
    checksums = [rng.randrange(1 << 64) for _ in batch]
    area = placed.reserve_area(128 * PAGE_BYTES, owner=1)
    result = placed.commit_placed(area.area_id, batch, sizes, 1, False, checksums)
    area = published.reserve_area(128 * PAGE_BYTES, owner=1)
    reserved = published.place(area.area_id, batch, sizes, 1, False)
    published.publish(reserved.blocks, checksums)
    assert result.statuses == reserved.statuses
    assert result.statuses.count(Status.OK) == 40 and result.num_bytes == sum(sizes[:40])
    assert result.committed == batch[:40]
    for store in stores:
        assert store.lookup(batch) == (len(batch), False)
    blocks = [
        sorted((b.key, b.offset, b.size, b.checksum) for b in s.committed_blocks()) for s in stores
    ]
    assert blocks[0] == blocks[1]
    assert placed.committed_bytes == published.committed_bytes and not published.reserved_bytes


def test_a_few_keys_read_one_at_a_time_leave_the_store_as_the_columns_do(monkeypatch):
    """Reads (lookups, pins and their ends, touches) of fewer than ``MIN_COLUMN_KEYS`` keys
    take the store's one-key paths: the same reads taken as columns (the threshold lowered
    to 1) answer the same and leave the same counts, pins, reads and LRU order."""
    from kvpool.store import block_store

    rng = random.Random(7)
    held = keys_of(rng, 60)
    absent = keys_of(rng, 10)
    ops = []
    for _ in range(300):
        names = rng.sample(held + absent, rng.randint(1, 20))
        names += names[: rng.randint(0, 2)]  # a key named twice
        ops.append((rng.choice(["lookup", "pin", "prefix", "touch", "unpin"]), names))

    def run(threshold: int) -> tuple[list, BlockStore]:
        monkeypatch.setattr(block_store, "MIN_COLUMN_KEYS", threshold)
        store = BlockStore(4096 * PAGE_BYTES, high_watermark=1.0, low_watermark=1.0)
        reserved = store.reserve(held, [100 + i for i in range(60)], owner=1)
        store.commit(reserved.reservation_id, [1] * 60, owner=1)
        answers: list = []
        pins: list[int] = []
        chooser = random.Random(8)  # which pin ends, alike in both runs
        for op, names in ops:
            if op == "lookup":
                answers.append(store.lookup(names))
            elif op in ("pin", "prefix"):
                result = store.pin(names, 1, prefix=op == "prefix")
                answers.append([b.key if b else None for b in result.blocks])
                if result.pin_id:
                    pins.append(result.pin_id)
            elif op == "touch":
                answers.append(store.touch(names))
            elif pins:
                answers.append(store.unpin(pins.pop(chooser.randrange(len(pins)))))
            answers.append(len(store.eviction))  # a pinned block is never in the LRU
        answers.append([store.unpin(pin_id) for pin_id in pins])  # every block evictable again
        return answers, store

    one, each = run(1 << 30)
    many, columns = run(1)
    assert one == many
    assert each.counters == columns.counters
    high = each.index.high
    for column in ("pins", "reads", "flags"):
        assert (
            getattr(each.index, column)[:high].tolist()
            == getattr(columns.index, column)[:high].tolist()
        )
    order = []
    for store in (each, columns):  # the LRU's order: each victim taken out in turn
        victims = []
        for slot in store.eviction.victims():
            victims.append(slot)
            store.eviction.remove(slot)
        order.append(victims)
    assert order[0] == order[1] and len(order[0]) > 30
