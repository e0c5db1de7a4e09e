import subprocess
import sys

import msgspec
import pytest

from kvpool.errors import ConfigError
from kvpool.keys import (
    NAMESPACE_ID_BYTES,
    Namespace,
    block_key,
    chained_hashes,
    check_hash_stability,
    is_valid_key,
    namespace_of,
)


def test_namespace_id_is_stable_across_processes():
    ns = Namespace(model="m", dtype="bfloat16", num_layers=4, block_size=32, tp_size=2, tp_rank=1)
    code = (
        "from kvpool.keys import Namespace;"
        "print(Namespace(model='m', dtype='bfloat16', num_layers=4, block_size=32,"
        " tp_size=2, tp_rank=1).id.hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == ns.id.hex()
    assert len(ns.id) == NAMESPACE_ID_BYTES


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"dtype": "float16"},
        {"layout": "mla"},
        {"num_layers": 5},
        {"block_size": 64},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"is_mla": True},
        {"tp_size": 4},
        {"tp_rank": 1},
        {"pp_size": 2},
        {"pp_rank": 1},
        {"tenant": "t"},
        {"hash_algo": "xxhash"},
    ],
)
def test_every_field_changes_the_namespace(change):
    base = dict(
        model="m", dtype="bfloat16", num_layers=4, block_size=32, num_kv_heads=2, head_dim=64
    )
    assert Namespace(**base).id != Namespace(**{**base, **change}).id


def test_keys_carry_namespace_and_hash():
    ns = Namespace(model="m")
    k = ns.key(b"\x01" * 32)
    assert namespace_of(k) == ns.id and k.endswith(b"\x01" * 32) and is_valid_key(k)
    with pytest.raises(ValueError):
        block_key(ns.id, b"")
    with pytest.raises(ValueError):
        block_key(ns.id, b"x" * 65)


def test_chained_hashes_name_the_whole_prefix():
    a = chained_hashes(list(range(100)), 16)
    b = chained_hashes([999, *list(range(1, 100))], 16)
    assert len(a) == 6
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes every key
    assert chained_hashes(list(range(100)), 16) == a


def test_hash_stability_refuses_random_seeds():
    check_hash_stability("sha256", {})
    check_hash_stability("sha256_cbor", {"PYTHONHASHSEED": "0"})
    check_hash_stability("xxhash", {"PYTHONHASHSEED": "42"})
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        check_hash_stability("xxhash", {})
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        check_hash_stability("xxhash_cbor", {"PYTHONHASHSEED": "random"})
    with pytest.raises(ConfigError):
        check_hash_stability("md5", {})


def test_each_tensor_parallel_rank_has_its_own_namespace_except_under_mla():
    dense = Namespace(model="m", num_kv_heads=1, head_dim=64, tp_size=2)
    ranks = {dense.for_rank(tp, pp) for tp in range(2) for pp in range(2)}
    assert len(ranks) == 4
    assert dense.for_rank(1, 0).tp_rank == 1
    # A TP=1 engine of the same model never reads a TP=2 engine's blocks.
    single = Namespace(model="m", num_kv_heads=1, head_dim=64)
    assert single.for_rank(0, 0).id not in {ns.id for ns in ranks}

    mla = Namespace(model="m", num_kv_heads=1, head_dim=576, is_mla=True, tp_size=8)
    # One namespace for every tensor-parallel rank of an engine ...
    assert {mla.for_rank(tp, 0) for tp in range(8)} == {mla.for_rank(0, 0)}
    # ... not shared with an engine of another tensor-parallel size (a miss) ...
    at_tp1 = msgspec.structs.replace(mla, tp_size=1)
    assert at_tp1.for_rank(0, 0).id != mla.for_rank(5, 0).id
    # ... unless both engines ask for it (a TP=8 prefill handing over to a TP=1 decode) ...
    assert at_tp1.for_rank(0, 0, mla_any_tp=True).id == mla.for_rank(5, 0, mla_any_tp=True).id
    # ... which never changes a sharded model's namespace ...
    assert dense.for_rank(1, 0, mla_any_tp=True) == dense.for_rank(1, 0)
    # ... and pipeline-parallel ranks hold different layers.
    assert mla.for_rank(0, 1).id != mla.for_rank(0, 0).id
