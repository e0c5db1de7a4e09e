"""The scheduler half against a real node, with plain request objects standing in for
vLLM's (they carry only the fields the connector reads)."""

import time
from types import SimpleNamespace

import pytest

from kvpool import Client
from kvpool.client.connection import Connection
from kvpool.config import Address
from kvpool.errors import ConfigError
from kvpool.integrations.vllm.config import ConnectorConfig, connector_config
from kvpool.integrations.vllm.scheduler import KVPoolScheduler
from kvpool.keys import Namespace, chained_hashes
from tests.helpers import commit_op, reserve_op

BS = 32
NS = Namespace(model="sched-test", block_size=BS)
# Whether a load is offered as asynchronous, with the default transfer mode.
IS_ASYNC = connector_config({}, environ={}).transfer == "whole"


def request(rid, num_blocks, first_token=0):
    tokens = list(range(first_token, first_token + num_blocks * BS + 1))
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=len(tokens),
        block_hashes=chained_hashes(tokens, BS),
        arrival_time=time.time(),
    )


def scheduler(node, role="kv_consumer", groups=None, backends=("CPU_ATTN",), **extra):
    """A scheduler half whose workers said they run ``backends`` (vLLM's handshake)."""
    config = connector_config({"address": node.unix_address, **extra}, environ={})
    sched = KVPoolScheduler(
        config,
        {(0, 0): NS},
        BS,
        can_load=role != "kv_producer",
        can_save=role != "kv_consumer",
        wait_for_pending=role == "kv_consumer",
        groups=groups,
    )
    sched.set_attention_backends(backends)
    return sched


def step_output(**fields):
    """A scheduler output with nothing scheduled, but ``fields``."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        **fields,
    )


def test_consumer_defers_while_a_producer_is_still_writing(node, client):
    req = request("r1", 5)
    sched = scheduler(node, consumer_wait=5.0)
    writer = Connection(Address.parse(node.unix_address), client.config, time.monotonic() + 5)
    keys = NS.keys(req.block_hashes)
    reserved = writer.run(reserve_op(keys, [64] * 5), time.monotonic() + 5)
    req.arrival_time = time.time()
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # pending: ask again
    writer.run(commit_op(reserved.reservation_id), time.monotonic() + 5)
    assert sched.get_num_new_matched_tokens(req, 0) == (5 * BS, IS_ASYNC)
    # With the engine's own cache holding 2 blocks, only the 3 after them are loaded.
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, IS_ASYNC)
    writer.close()
    sched.shutdown()


def test_the_wait_is_bounded(node, client):
    req = request("r2", 3)
    sched = scheduler(node, consumer_wait=1.0)
    writer = Connection(Address.parse(node.unix_address), client.config, time.monotonic() + 5)
    writer.run(reserve_op(NS.keys(req.block_hashes), [64] * 3), time.monotonic() + 5)
    req.arrival_time = time.time()  # the wait counts from the request's arrival
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(1.05)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # gave up: recompute
    writer.close()
    sched.shutdown()


def test_matching_is_side_effect_free_and_acted_on_once_scheduled(node, client):
    req = request("r6", 6)
    client.put(NS.keys(req.block_hashes[:4]), [b"x"] * 4)
    sched = scheduler(node, "kv_both")
    sched.on_new_request(req)
    for _ in range(3):  # vLLM may ask several times: nothing changes but the answer's memo
        assert sched.get_num_new_matched_tokens(req, BS) == (3 * BS, IS_ASYNC)
    assert sched.stats.is_empty() and not sched._loads
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14, 15, 16],))
    sched.update_state_after_alloc(req, blocks, 3 * BS)
    assert sched.stats.data["lookups"] == 1 and sched.stats.data["hit_blocks"] == 4
    (job,) = sched._loads
    assert job.block_ids == [11, 12, 13] and job.block_hashes == req.block_hashes[1:4]
    sched.update_state_after_alloc(req, blocks, 0)  # again, once the load is done
    assert sched.stats.data["lookups"] == 1 and len(sched._loads) == 1
    sched.shutdown()


def test_no_lookup_when_the_engine_holds_every_block_the_pool_could_offer(node, client):
    req = request("r7", 4)  # 4 full blocks and one token
    client.put(NS.keys(req.block_hashes), [b"x"] * 4)
    sched = scheduler(node, "kv_both")
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 4 * BS) == (0, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
    sched.update_state_after_alloc(req, blocks, 0)
    assert "lookups" not in sched.stats.data  # no round trip was made
    # One block short of that, the pool is asked.
    other = request("r8", 4)
    sched.on_new_request(other)
    sched.get_num_new_matched_tokens(other, 3 * BS)
    sched.update_state_after_alloc(other, blocks, 0)
    assert sched.stats.data["lookups"] == 1
    sched.shutdown()


def test_layerwise_loads_run_in_the_step_whole_loads_wait_a_step(node, client):
    req = request("r1", 3)
    client.put(NS.keys(req.block_hashes), [b"x" * 64] * 3)
    for transfer, is_async in (("layerwise", False), ("whole", True)):
        sched = scheduler(node, "kv_both", transfer=transfer)
        sched.on_new_request(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, is_async)
        sched.shutdown()
    with pytest.raises(ConfigError, match="transfer"):
        scheduler(node, transfer="sideways")


def test_thresholds_and_roles(node, client):
    req = request("r3", 4)
    client.put(NS.keys(req.block_hashes[:2]), [b"x"] * 2)
    assert scheduler(node, "kv_both", min_load_blocks=3).get_num_new_matched_tokens(req, 0) == (
        0,
        False,
    )
    assert scheduler(node, "kv_both", min_load_tokens=2 * BS + 1).get_num_new_matched_tokens(
        req, 0
    ) == (0, False)
    assert scheduler(node, "kv_both").get_num_new_matched_tokens(req, 0) == (2 * BS, IS_ASYNC)
    assert scheduler(node, "kv_producer").get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_full_prompt_hit_still_leaves_a_token_to_compute(node, client):
    tokens = list(range(4 * BS))  # exactly 4 full blocks
    req = SimpleNamespace(
        request_id="r4",
        num_prompt_tokens=len(tokens),
        block_hashes=chained_hashes(tokens, BS),
        arrival_time=time.time(),
    )
    client.put(NS.keys(req.block_hashes), [b"x"] * 4)
    assert scheduler(node, "kv_both").get_num_new_matched_tokens(req, 0) == (3 * BS, IS_ASYNC)


def test_an_unreachable_pool_means_misses_not_waits(run_dir):
    config = connector_config(
        {"address": f"unix:{run_dir}/absent.sock", "lookup_timeout": 0.2}, environ={}
    )
    sched = KVPoolScheduler(
        config, {(0, 0): NS}, BS, can_load=True, can_save=True, wait_for_pending=False
    )
    req = request("r5", 3)
    start = time.monotonic()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not sched.health.is_healthy
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # fails fast now
    assert time.monotonic() - start < 1.0
    sched.shutdown()


def test_unknown_extra_config_is_refused():
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        connector_config({"adress": "x:1"}, environ={})
    with pytest.raises(ConfigError):
        connector_config({"min_load_blocks": 0}, environ={})
    config = connector_config(
        {"timeout": "0.5", "write_rcache": "false"}, environ={"KVPOOL_MIN_LOAD_TOKENS": "64"}
    )
    assert (
        config.client.timeout_s == 0.5
        and not config.client.write_rcache
        and config.min_load_tokens == 64
    )


def test_every_documented_extra_config_key_is_accepted():
    """The keys the configuration reference documents are those the connector takes
    (``prefetch_hold`` was documented and refused once)."""
    from kvpool.cli.reference import option_rows
    from kvpool.config import env_table

    documented = {row[0].strip("`") for row in option_rows(ConnectorConfig)}
    known = {o.key for o in env_table(ConnectorConfig).values()}
    assert documented == known
    assert {"prefetch_hold", "mla_any_tp", "transfer", "tenant", "address"} <= documented
    config = connector_config({"prefetch_hold": 5, "mla_any_tp": "true"}, environ={})
    assert config.prefetch_hold_s == 5 and config.mla_any_tp
    assert connector_config({}, environ={"KVPOOL_MLA_ANY_TP": "1"}).mla_any_tp
    assert not connector_config({}, environ={}).mla_any_tp


def test_hits_are_counted_by_the_tier_that_holds_them(start_node, tmp_path):
    node = start_node(
        name="tiers", memory="4MiB", extra=["--disk", str(tmp_path / "d"), "--disk-size", "32MiB"]
    )
    req = request("r7", 40)
    keys = NS.keys(req.block_hashes)
    with Client(node.unix_address) as client:
        for start in range(0, 40, 4):  # 10 MiB through 4 MiB of DRAM: the first ones spill
            batch = keys[start : start + 4]
            client.put(batch, [b"b" * (256 << 10)] * len(batch))
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.lookup(keys) < 40:
            time.sleep(0.05)
    sched = scheduler(node, "kv_both")
    sched.on_new_request(req)
    # Blocks on disk come up into DRAM first: the request waits for its load off the step
    # (asynchronously), whatever the transfer mode.
    assert sched.get_num_new_matched_tokens(req, 0) == (40 * BS, True)
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(41)),))
    sched.update_state_after_alloc(req, blocks, 40 * BS)
    (job,) = sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={},
        )
    ).loads
    assert job.is_async and len(job.block_ids) == 40
    data = sched.stats.data
    assert data["hit_blocks_disk"] > 0 and data["hit_blocks_dram"] > 0
    assert data["hit_blocks_disk"] + data["hit_blocks_dram"] == 40
    sched.shutdown()


def test_hybrid_groups_match_and_load_only_what_the_engine_reads(node, client):
    """Full attention and a sliding window of 64 tokens (2 blocks read by the next token):
    a prefix counts if the full group has all its blocks and the window group the blocks
    of its window; the load skips the window group's null blocks; keys never cross."""
    from kvpool.integrations.vllm.groups import FULL, SLIDING, CacheGroup, group_namespace

    groups = [CacheGroup(0, SLIDING, 64), CacheGroup(1, FULL)]
    window_ns, full_ns = (group_namespace(NS, g, 2) for g in groups)
    req = request("h1", 8)  # 8 full blocks and a token
    client.put(full_ns.keys(req.block_hashes), [b"f"] * 8)
    client.put(window_ns.keys(req.block_hashes[6:8]), [b"w"] * 2)
    sched = scheduler(node, "kv_both", groups=groups)
    sched.on_new_request(req)
    # Hybrid loads run off the step: vLLM takes their failures per request.
    assert sched.get_num_new_matched_tokens(req, 0) == (8 * BS, True)
    window = [0] * 6 + [26, 27]  # vLLM's null block (0) before the window
    blocks = SimpleNamespace(get_block_ids=lambda: ([*window, 28], list(range(10, 19))))
    sched.update_state_after_alloc(req, blocks, 8 * BS)
    (job,) = sched._loads
    assert job.block_ids == [26, 27, *range(10, 18)]
    assert job.groups == [0, 0] + [1] * 8
    assert job.block_hashes == req.block_hashes[6:8] + req.block_hashes[:8]

    # A window block missing: the longest prefix whose window is there (6 blocks: 4-5).
    other = request("h2", 8, first_token=1000)
    client.put(full_ns.keys(other.block_hashes), [b"f"] * 8)
    client.put(window_ns.keys(other.block_hashes[:6]), [b"w"] * 6)
    sched.on_new_request(other)
    assert sched.get_num_new_matched_tokens(other, 0) == (6 * BS, True)
    # Blocks under the one-group namespace are no group's.
    third = request("h3", 8, first_token=2000)
    client.put(NS.keys(third.block_hashes), [b"x"] * 8)
    sched.on_new_request(third)
    assert sched.get_num_new_matched_tokens(third, 0) == (0, False)
    sched.shutdown()


def test_an_engine_with_a_group_the_pool_cannot_reuse_is_offered_nothing(node, client):
    from kvpool.integrations.vllm.groups import FULL, UNSUPPORTED, CacheGroup

    # E.g. Mamba outside vLLM's align mode: no state is kept at block boundaries.
    groups = [CacheGroup(0, FULL), CacheGroup(1, UNSUPPORTED, spec_name="MambaSpec")]
    sched = scheduler(node, "kv_both", groups=groups)
    req = request("m1", 4)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    assert sched.stats.data["skipped_unsupported"] == 1 and "lookups" not in sched.stats.data
    assert not sched.can_save
    sched.shutdown()


def test_a_recurrent_state_is_matched_at_the_prefix_end_and_saved_from_vllms_hand_offs(
    node, client
):
    """Mamba in vLLM's align mode: a prefix of N blocks needs the full-attention blocks and
    the state after block N-1; a missing state shortens the match to the last state held.
    States are saved from the hand-offs vLLM makes, at block boundaries only."""
    from kvpool.integrations.vllm.groups import FULL, STATE, CacheGroup, group_namespace

    groups = [CacheGroup(0, STATE), CacheGroup(1, FULL)]
    state_ns, full_ns = (group_namespace(NS, g, 2) for g in groups)
    sched = scheduler(node, "kv_both", groups=groups)
    req = request("s1", 8, first_token=3000)
    client.put(full_ns.keys(req.block_hashes), [b"f"] * 8)
    client.put(state_ns.keys([req.block_hashes[i] for i in (3, 7)]), [b"s"] * 2)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (8 * BS, True)
    table = [0] * 7 + [41]  # vLLM's null blocks before the prefix's last state
    blocks = SimpleNamespace(get_block_ids=lambda: ([*table, 42], list(range(10, 19))))
    sched.update_state_after_alloc(req, blocks, 8 * BS)
    (job,) = sched._loads
    assert job.block_ids == [41, *range(10, 18)] and job.groups == [0] + [1] * 8
    assert job.block_hashes[0] == req.block_hashes[7]

    other = request("s2", 8, first_token=4000)
    client.put(full_ns.keys(other.block_hashes), [b"f"] * 8)
    client.put(state_ns.keys([other.block_hashes[3]]), [b"s"])  # no state after block 7
    sched.on_new_request(other)
    assert sched.get_num_new_matched_tokens(other, 0) == (4 * BS, True)
    # The engine's own cache holds 5 blocks: no state past it, nothing to load.
    assert sched.get_num_new_matched_tokens(other, 5 * BS) == (0, False)

    hand_offs = {"s2": [(0, 51, 2 * BS), (0, 52, 2 * BS + 7), (1, 53, 3 * BS), (0, 54, 99 * BS)]}
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=hand_offs),
    )
    (save,) = sched.build_connector_meta(output).saves
    # Only the state group's hand-off at a prompt block's end: block 1's state, in block 51.
    assert save.block_ids == [51] and save.groups == [0]
    assert save.block_hashes == [other.block_hashes[1]]
    sched.shutdown()


def test_an_engine_whose_backend_is_declined_loads_nothing_but_still_saves(node, client, caplog):
    """CPU_MLA cannot continue a prefix it did not compute (kvpool.integrations.vllm.
    backends): a miss for every request, said once; the pool's blocks are not saved
    again, and new blocks are saved for engines that can load them."""
    req = request("d1", 6, first_token=5000)
    client.put(NS.keys(req.block_hashes[:4]), [b"x"] * 4)
    sched = scheduler(node, "kv_both", backends=("CPU_MLA",))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert sched._requests["d1"].next_save_block == 4  # blocks 4 and 5 are saved
    assert sched.can_save and "CPU_MLA" in sched.declined
    warnings = [r.getMessage() for r in caplog.records if "no prefix is loaded" in r.getMessage()]
    assert len(warnings) == 1 and "CPU_MLA" in warnings[0], warnings
    sched.shutdown()


def test_nothing_is_loaded_until_the_workers_say_which_backends_they_run(node, client):
    req = request("d2", 3, first_token=6000)
    client.put(NS.keys(req.block_hashes), [b"x"] * 3)
    sched = scheduler(node, "kv_both", backends=())  # no handshake (yet)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.set_attention_backends(["CPU_ATTN", "CPU_ATTN"])
    assert sched.attention_backends == ("CPU_ATTN",)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, IS_ASYNC)
    sched.shutdown()


def test_an_engine_of_one_sliding_window_group_loads_its_window_only(node, client):
    """Every layer with a window of 64 tokens (vLLM's allocator not hybrid: one group): the
    keys stay the engine's one namespace, the load skips vLLM's null blocks before the
    window, and it runs off the step (a failed block is recomputed with its request)."""
    from kvpool.integrations.vllm.groups import SLIDING, CacheGroup

    req = request("w1", 8, first_token=7000)
    client.put(NS.keys(req.block_hashes[6:8]), [b"w"] * 2)  # only the window's blocks
    sched = scheduler(node, "kv_both", groups=[CacheGroup(0, SLIDING, 64)])
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (8 * BS, True)
    table = [0] * 6 + [26, 27, 28]
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (table,)), 8 * BS)
    (job,) = sched._loads
    assert job.block_ids == [26, 27] and job.groups is None and job.is_async
    assert job.block_hashes == req.block_hashes[6:8]
    # Saves skip null blocks too, and name each block saved for the KV events.
    req.all_token_ids = list(range(7000, 7000 + 8 * BS + 1))
    output = step_output(
        kv_connector_block_state=SimpleNamespace(
            get_block_ids=lambda req_id: ([0, 0, 0, 0, 0, 0, 26, 27, 28],),
            boundary_state_offloads={},
        )
    )
    output.scheduled_new_reqs = [SimpleNamespace(req_id="w1", num_computed_tokens=0)]
    output.num_scheduled_tokens = {"w1": 8 * BS + 1}
    sched._requests["w1"].next_save_block = 0
    (save,) = sched.build_connector_meta(output).saves
    assert save.block_ids == [26, 27] and save.block_hashes == req.block_hashes[6:8]
    assert [o.token_ids[0] for o in save.origins] == [7000 + 6 * BS, 7000 + 7 * BS]
    sched.shutdown()


def test_a_pure_state_space_engine_loads_the_state_at_the_prefix_end(node, client):
    from kvpool.integrations.vllm.groups import STATE, CacheGroup

    req = request("g1", 8, first_token=8000)
    client.put(NS.keys([req.block_hashes[i] for i in (3, 7)]), [b"s"] * 2)
    sched = scheduler(node, "kv_both", groups=[CacheGroup(0, STATE)])
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (8 * BS, True)
    table = [0] * 7 + [41, 42]
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (table,)), 8 * BS)
    (job,) = sched._loads
    assert job.block_ids == [41] and job.block_hashes == [req.block_hashes[7]] and job.is_async
    sched.shutdown()


def test_blocks_of_generated_tokens_are_saved_once_computed(node, client):
    """vLLM's own prefix cache keeps the blocks of a request's answer (a conversation's next
    turn repeats it): so does the pool.  A block is saved in the step that computes its last
    token, once vLLM has hashed it, and never before: not the block of a token sampled but
    not yet computed, nor one whose tokens are not all known."""
    tokens = list(range(7000, 7000 + 2 * BS + 1))  # 2 full prompt blocks and a token
    req = SimpleNamespace(
        request_id="g1",
        num_prompt_tokens=len(tokens),
        block_hashes=chained_hashes(tokens, BS),
        arrival_time=time.time(),
    )
    sched = scheduler(node, "kv_both")
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    table = ([20, 21, 22, 23],)

    def step(num_computed: int, num_scheduled: int, *, is_new: bool = False) -> list[int]:
        new = [SimpleNamespace(req_id="g1", num_computed_tokens=num_computed)] if is_new else []
        cached = SimpleNamespace(
            req_ids=[] if is_new else ["g1"],
            num_computed_tokens=[] if is_new else [num_computed],
        )
        output = SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"g1": num_scheduled},
            kv_connector_block_state=SimpleNamespace(
                get_block_ids=lambda _: table, boundary_state_offloads={}
            ),
        )
        return [i for job in sched.build_connector_meta(output).saves for i in job.block_ids]

    assert step(0, len(tokens), is_new=True) == [20, 21]  # the prompt's full blocks
    # Decode: each step computes the token sampled by the one before.  Block 2 fills with
    # the 31st generated token; its hash exists once that token is sampled.
    for num_computed in range(len(tokens), 3 * BS - 1):
        tokens.append(num_computed)
        req.block_hashes = chained_hashes(tokens, BS)
        assert step(num_computed, 1) == [], num_computed
    tokens.append(3 * BS - 1)
    req.block_hashes = chained_hashes(tokens, BS)  # block 2's tokens all known
    assert len(req.block_hashes) == 3
    assert step(3 * BS - 1, 1) == [22]  # computed by this step: saved, once
    tokens.append(3 * BS)
    assert step(3 * BS, 1) == []
    sched.shutdown()


def test_saving_on_eviction_the_pool_is_looked_up_past_the_engines_own_hit(node, client):
    """The engine keeps a prefix's root and dropped its leaves to the pool: those load."""
    req = request("r-evicting", 6)
    client.put(NS.keys(req.block_hashes[3:6]), [b"x"] * 3)  # the leaves only
    eager = scheduler(node, "kv_both")
    eager.on_new_request(req)
    assert eager.get_num_new_matched_tokens(req, 3 * BS) == (0, False)  # from the root: none
    evicting = scheduler(node, "kv_both", save="evicting")
    evicting.on_new_request(req)
    assert evicting.get_num_new_matched_tokens(req, 3 * BS) == (3 * BS, IS_ASYNC)
    for sched in (eager, evicting):
        sched.shutdown()


def test_saving_on_eviction_saves_what_vllms_free_queue_drops_next_with_its_origins(node):
    """vLLM's own block pool (no engine): a request's blocks are saved only once the engine
    freed them, as the blocks nearest eviction, and they keep what they were computed from
    (the node's KV events)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=BS)  # 4 + null
    sched = scheduler(node, "kv_both", save="evicting")
    sched.bind_block_pool(pool, lookahead=8)
    req = request("r-drop", 4)
    req.all_token_ids = list(range(4 * BS + 1))
    blocks = pool.get_new_blocks(4)
    ids = [b.block_id for b in blocks]
    sched.on_new_request(req)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), 0)
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r-drop", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={"r-drop": 4 * BS + 1},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: (ids,)),
    )
    assert sched.build_connector_meta(output).saves == []  # computed, held: not saved
    for block, block_hash in zip(blocks, req.block_hashes, strict=True):
        block.set_block_hash(make_block_hash_with_group_id(block_hash, 0))
    pool.free_blocks(reversed(blocks))  # the request finished: its leaf is dropped first
    (job,) = sched.build_connector_meta(step_output()).saves
    assert job.block_ids == ids[::-1] and job.block_hashes == req.block_hashes[::-1]
    assert job.origins is not None
    assert [o.token_ids for o in job.origins] == [
        list(range(i * BS, (i + 1) * BS)) for i in reversed(range(4))
    ]
    assert sched.build_connector_meta(step_output()).saves == []  # once each
    sched.shutdown()
