"""The EMS-compatible SDK against a real node, without vLLM: registration of every layout
the guide's connector hands over, round trips, bad arguments, a dead pool, installation."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvpool.client.client import Client
from kvpool.ems import (
    CcConfig_v1,
    CcKvOption,
    Ems,
    EmsConfig,
    EmsErrorCode,
    EmsException,
    KVCacheType,
)
from kvpool.ems.context import ContextCaching
from kvpool.ems.install import install

NB, BS = 16, 32


def identity(**changes):
    values = {
        "rank_id": 0,
        "device_id": 0,
        "model_id": "cc_kvstore@_@ds_default_ns_001",
        "tp_world_size": 1,
        "pp_world_size": 1,
        "rank_in_tp_group": 0,
        "rank_in_pp_group": 0,
        "llm_engine": "vllm@tests_tiny",
    }
    values.update(changes)
    return CcConfig_v1(**values)


@pytest.fixture
def ems(node, monkeypatch):
    monkeypatch.setenv("KVPOOL_ADDRESS", node.unix_address)
    Ems.init(EmsConfig(access_id="", access_key="", cc_config_v1=identity()))
    yield Ems.get_cc()
    Ems.get_cc().close()


def slots(block_ids):
    return (np.array(block_ids)[:, None] * BS + np.arange(BS)).ravel().tolist()


OPTION = CcKvOption(write_rcache=True, read_local_only=False, timeout=5000)


def cpu_form(layers=2):
    """vLLM's CPU layer tensors, handed over as the guide's connector does: per block."""
    caches = [torch.randn(NB, 2, BS, 2 * 64) for _ in range(layers)]
    return caches, [[layer[i] for i in range(len(layer))] for layer in caches]


def kv_form(layers=2):
    caches = [(torch.randn(NB, BS, 2, 64), torch.randn(NB, BS, 2, 64)) for _ in range(layers)]
    return [t for pair in caches for t in pair], [list(pair) for pair in caches]


def mla_form(layers=2):
    caches = [(torch.randn(NB, BS, 1, 512), torch.randn(NB, BS, 1, 64)) for _ in range(layers)]
    return [t for pair in caches for t in pair], [list(pair) for pair in caches]


def cpu_mla_form(layers=2):
    """vLLM's CPU MLA layer tensors (one 576-wide latent per token), handed over per block."""
    caches = [torch.randn(NB, BS, 576).bfloat16() for _ in range(layers)]
    return caches, [[layer[i] for i in range(len(layer))] for layer in caches]


def wait(cc, future, timeout=10):
    deadline = time.monotonic() + timeout
    while not cc.is_ready(future) and time.monotonic() < deadline:
        time.sleep(0.01)
    return cc.get_result(future)


@pytest.mark.parametrize("form", [cpu_form, kv_form, mla_form, cpu_mla_form])
def test_every_layout_round_trips(ems, form):
    tensors, handed = form()
    ems.register_kvcache(handed)
    # What the guide's connector reads back right after registering must be 4-D.
    assert len(list(handed[0][0].shape)) == 4
    hashes = [hash((0, i)) for i in range(5)]  # as the connector makes them
    saved = [t[[1, 2, 3, 4, 5]].clone() for t in tensors]
    result = wait(
        ems,
        ems.async_save(
            slot_mapping=slots([1, 2, 3, 4, 5]), hashes=hashes, offsets=[BS] * 5, option=OPTION
        ),
    )
    assert (result.success, result.total) == (5, 5)
    assert ems.exists(hashes=[*hashes, hash((0, 99))], option=OPTION).success == 5
    for t in tensors:
        t.zero_()
    result = wait(
        ems,
        ems.async_load(
            slot_mapping=slots([9, 10, 11, 12, 13]), hashes=hashes, offsets=[BS] * 5, option=OPTION
        ),
    )
    assert (result.success, result.total) == (5, 5)
    for t, before in zip(tensors, saved, strict=True):
        assert torch.equal(t[[9, 10, 11, 12, 13]], before)
        assert not t[[1, 2, 3]].any()  # nothing else touched


def test_a_load_reports_the_leading_blocks_it_wrote(ems):
    _, handed = cpu_form()
    ems.register_kvcache(handed)
    hashes = [hash((1, i)) for i in range(4)]
    wait(
        ems,
        ems.async_save(
            slot_mapping=slots([0, 1]), hashes=hashes[:2], offsets=[BS] * 2, option=OPTION
        ),
    )
    result = wait(
        ems,
        ems.async_load(
            slot_mapping=slots([5, 6, 7, 8]), hashes=hashes, offsets=[BS] * 4, option=OPTION
        ),
    )
    assert (result.success, result.total) == (2, 4)  # the connector recomputes the rest


def test_a_save_copies_its_blocks_before_it_returns(ems):
    tensors, handed = cpu_form()
    ems.register_kvcache(handed)
    expected = tensors[0][3].clone()
    future = ems.async_save(
        slot_mapping=slots([3]), hashes=[hash((2, 0))], offsets=[BS], option=OPTION
    )
    tensors[0][3].fill_(7.0)  # the engine reuses the block at once
    assert wait(ems, future).success == 1
    tensors[0].zero_()
    wait(
        ems,
        ems.async_load(slot_mapping=slots([4]), hashes=[hash((2, 0))], offsets=[BS], option=OPTION),
    )
    assert torch.equal(tensors[0][4], expected)


@pytest.mark.parametrize(
    "slot_mapping,offsets",
    [
        ([5] * BS, [BS]),  # not consecutive
        (list(range(1, BS + 1)), [BS]),  # not aligned on a block
        (slots([0])[:-1], [BS]),  # too short
        (slots([NB + 3]), [BS]),  # a block outside the cache
        (slots([0, 1]), [BS, BS // 2]),  # not whole blocks
        ("not a list", [BS]),
    ],
)
def test_bad_arguments_raise_invalid_argument(ems, slot_mapping, offsets):
    _, handed = cpu_form()
    ems.register_kvcache(handed)
    hashes = [hash((3, i)) for i in range(len(offsets))]
    for call in (ems.async_load, ems.async_save):
        with pytest.raises(EmsException) as raised:
            call(slot_mapping=slot_mapping, hashes=hashes, offsets=offsets, option=OPTION)
        assert raised.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
        assert raised.value.status_code().name == "EMS_INVALID_ARGUMENT"


def test_layouts_it_cannot_read_are_refused_clearly(ems):
    strided = torch.randn(NB, 64, BS)[:, ::2, :]  # a page that is not one run of memory
    with pytest.raises(EmsException) as raised:
        ems.register_kvcache([[strided]])
    assert raised.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException):
        ems.register_kvcache([[torch.randn(NB, 4)], [torch.randn(NB + 1, 4)]])


def test_engines_share_blocks_exactly_when_their_kv_is_compatible(node, monkeypatch):
    monkeypatch.setenv("KVPOOL_ADDRESS", node.unix_address)
    hashes = [hash((4, i)) for i in range(3)]

    def engine(**changes):
        Ems.init(EmsConfig(cc_config_v1=identity(**changes)))
        cc = Ems.get_cc()
        _, handed = cpu_form()
        cc.register_kvcache(handed)
        return cc

    first = engine()
    wait(
        first,
        first.async_save(
            slot_mapping=slots([0, 1, 2]), hashes=hashes, offsets=[BS] * 3, option=OPTION
        ),
    )
    assert engine().exists(hashes=hashes, option=OPTION).success == 3  # the same engine again
    assert (
        engine(rank_in_tp_group=1, tp_world_size=2).exists(hashes=hashes, option=OPTION).success
        == 0
    )
    assert engine(model_id="other").exists(hashes=hashes, option=OPTION).success == 0
    mla = engine(kvcache_type=KVCacheType.MLA)
    assert mla.exists(hashes=hashes, option=OPTION).success == 0


def test_mla_ranks_share_one_copy_that_rank_0_saves(node):
    """One latent page per block per layer, alike on every tensor-parallel rank: rank 0
    saves it, rank 1 stores nothing and loads rank 0's; sharded (MHA) ranks, and MLA
    engines of another tensor-parallel size, never see it."""
    hashes = [hash((6, i)) for i in range(3)]

    def rank(tp_rank, tp_size=2, kind=KVCacheType.MLA):
        cc = ContextCaching(
            Client(node.unix_address, timeout=10),
            identity(rank_in_tp_group=tp_rank, tp_world_size=tp_size, kvcache_type=kind),
        )
        caches, handed = cpu_mla_form()
        cc.register_kvcache(handed)
        return cc, caches

    (zero, zero_caches), (one, one_caches) = rank(0), rank(1)
    try:
        assert zero.registered.layout.num_planes == 2  # one latent plane per layer
        assert zero.registered.layout.page_bytes == BS * 576 * 2
        save = {"slot_mapping": slots([1, 2, 3]), "hashes": hashes, "offsets": [BS] * 3}
        assert (wait(one, one.async_save(**save, option=OPTION)).success, one.writes) == (0, False)
        assert zero.exists(hashes=hashes, option=OPTION).success == 0  # rank 1 wrote nothing
        assert wait(zero, zero.async_save(**save, option=OPTION)).success == 3
        assert one.exists(hashes=hashes, option=OPTION).success == 3
        load = {"slot_mapping": slots([7, 8, 9]), "hashes": hashes, "offsets": [BS] * 3}
        assert wait(one, one.async_load(**load, option=OPTION)).success == 3
        for mine, saved in zip(one_caches, zero_caches, strict=True):
            assert torch.equal(mine[[7, 8, 9]], saved[[1, 2, 3]])
        for other in (rank(1, kind=KVCacheType.MHA)[0], rank(0, tp_size=1)[0]):
            assert other.exists(hashes=hashes, option=OPTION).success == 0
            other.close()
    finally:
        zero.close()
        one.close()


def test_a_dead_pool_answers_misses_in_time_and_init_says_recover(start_node, monkeypatch):
    node = start_node(name="ems-dead")
    monkeypatch.setenv("KVPOOL_ADDRESS", node.unix_address)
    Ems.init(EmsConfig(cc_config_v1=identity()))
    cc = Ems.get_cc()
    _, handed = cpu_form()
    cc.register_kvcache(handed)
    hashes = [hash((5, i)) for i in range(3)]
    wait(
        cc,
        cc.async_save(
            slot_mapping=slots([0, 1, 2]), hashes=hashes, offsets=[BS] * 3, option=OPTION
        ),
    )
    node.kill()
    short = CcKvOption(write_rcache=True, read_local_only=False, timeout=500)
    started = time.monotonic()
    assert cc.exists(hashes=hashes, option=short).success == 0
    assert time.monotonic() - started < 1.0
    result = wait(
        cc,
        cc.async_load(slot_mapping=slots([4, 5, 6]), hashes=hashes, offsets=[BS] * 3, option=short),
    )
    assert (result.success, result.total) == (0, 3)  # a partial result, not an exception
    assert Ems.check_health() is False
    with pytest.raises(EmsException) as raised:
        Ems.init(EmsConfig(cc_config_v1=identity()))
    assert raised.value.status_code() == EmsErrorCode.EMS_RECOVERD_ERROR
    again = start_node(name="ems-dead")  # warm restart: the blocks come back
    assert Ems.check_health() is True
    Ems.init(EmsConfig(cc_config_v1=identity()))
    cc = Ems.get_cc()
    cc.register_kvcache(cpu_form()[1])
    assert cc.exists(hashes=hashes, option=OPTION).success == 3
    cc.close()
    again.stop()


def test_install_writes_a_thin_package_and_never_shadows_a_real_one(tmp_path):
    target = tmp_path / "site"
    seed = tmp_path / "seed"
    seed.mkdir()
    for name in ("__init__.py", "ems_adapter.py", "ems_env.py", "ems_store_connector.py"):
        (seed / name).write_text(f"# {name}\n")
    install(target, seed)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ems import Ems, CcKvOption, EmsException, EmsErrorCode, EmsConfig, CcConfig_v1;"
            "from ems.cc_v1.cc_config import KVCacheType;"
            "import torch_npu, torch; torch_npu.npu.synchronize();"
            "import vllm_ascend.distributed.ems_store.ems_env as e;"
            "print(Ems.__module__, KVCacheType.MLA.name, hasattr(torch, 'npu'))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["kvpool.ems.api", "MLA", "False"]
    install(target, seed)  # again: it replaces only what it wrote
    (target / "ems" / "mine.py").write_text("x = 1\n")
    (target / "ems" / "__init__.py").write_text("# someone else's\n")
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="not written by kvpool"):
        install(target, seed)
    real = tmp_path / "real"
    (real / "torch_npu").mkdir(parents=True)
    (real / "torch_npu" / "__init__.py").write_text("")
    sys.path.insert(0, str(real))
    try:
        with pytest.raises(ConfigError, match="real 'torch_npu'"):
            install(tmp_path / "other", seed)
    finally:
        sys.path.remove(str(real))
