"""The store's index (columns by slot, an open-addressed key table) against a dict: every
key found where it was put, never after it left, in any order of inserts and removals."""

from __future__ import annotations

import random

import numpy as np

from kvpool.keys import MAX_KEY_BYTES, MIN_KEY_BYTES
from kvpool.store.index import BlockIndex


def random_key(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(MIN_KEY_BYTES, MAX_KEY_BYTES))


def check(index: BlockIndex, model: dict[bytes, int], gone: list[bytes]) -> None:
    for key, slot in model.items():
        assert index.find(key) == slot
        assert index.key(slot) == key and index.is_live(slot)
    for key in gone:
        if key not in model:
            assert index.find(key) == -1
    assert len(index) == len(model)


def test_inserts_and_removals_in_a_nearly_full_table_find_every_key():
    # 512 slots in 1,024 buckets, kept nearly full: long probe runs, many of them crossing
    # the table's end, and removals from their middle (backward-shift deletion).
    rng = random.Random(7)
    index = BlockIndex(512)
    model: dict[bytes, int] = {}
    gone: list[bytes] = []
    for step in range(20_000):
        if len(model) < 500 and (len(model) < 400 or rng.random() < 0.5):
            key = random_key(rng)
            if key in model:
                continue
            model[key] = index.insert(key, step * 4096, 4096, step, sealed=False)
        else:
            key = rng.choice(list(model))
            slot = model.pop(key)
            index.unlink(slot)
            index.release(slot)
            gone.append(key)
        if step % 2_000 == 0:
            check(index, model, gone[-500:])
    check(index, model, gone)


def test_a_key_is_found_only_with_its_whole_bytes():
    index = BlockIndex(16)
    key = b"n" * 16 + b"\x00\x01"
    slot = index.insert(key, 0, 4096, 1, sealed=True)
    assert index.find(key) == slot
    assert index.find(key[:-1]) == -1  # a prefix: shorter
    assert index.find(key + b"\x00") == -1  # trailing zeros: longer
    assert index.find(b"n" * 16 + b"\x00\x02") == -1
    assert index.is_sealed(slot) and index.block(slot).key == key


def test_bulk_adoption_places_keys_as_inserts_would():
    rng = random.Random(3)
    index = BlockIndex(4096)
    keys = list({random_key(rng) for _ in range(2048)})
    n = len(keys)
    slots = index.adopt(
        keys, np.arange(n) * 4096, np.full(n, 4096), np.arange(n, dtype=np.uint64) + 1
    )
    assert slots.tolist() == list(range(n))
    model = dict(zip(keys, range(n), strict=True))
    check(index, model, [random_key(rng) for _ in range(100)])
    assert [index.offset(s) for s in range(n)] == [s * 4096 for s in range(n)]
    assert not any(index.is_sealed(s) for s in range(n))  # verified by readers, lazily
    # Removals and inserts after an adoption keep the table whole.
    for key in keys[::3]:
        slot = model.pop(key)
        index.unlink(slot)
        index.release(slot)
    for _ in range(500):
        key = random_key(rng)
        if key not in model:
            model[key] = index.insert(key, 0, 4096, 9, sealed=True)
    check(index, model, keys[::3])


def test_freed_slots_are_reused_before_new_ones():
    index = BlockIndex(64)
    slots = [index.insert(bytes([i]) * 20, 0, 4096, 0, sealed=True) for i in range(10)]
    index.unlink(slots[4])
    index.release(slots[4])
    assert index.insert(b"z" * 20, 0, 4096, 0, sealed=True) == slots[4]
    assert index.high == 10
