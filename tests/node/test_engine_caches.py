"""The two-level replay (benchmarks/engine_caches.py): engines' own caches above one pool,
on a small synthetic agent trace, with the connector's own save decision."""

from benchmarks.engine_caches import agent_trace, replay

TRACE = agent_trace(600, seed=1)


def test_a_pool_the_size_of_the_engines_cache_adds_hits_only_when_it_saves_on_eviction():
    eager = replay(TRACE, 1, 50, 50, "round-robin", "eager", "lru")
    evicting = replay(TRACE, 1, 50, 50, "round-robin", "evicting", "lru")
    assert eager["engines"] == evicting["engines"]  # the engine's own cache is the same
    assert evicting["pool"] >= 5 * max(eager["pool"], 0.01)  # eager's pool duplicates it


def test_auto_saves_on_eviction_for_one_engine_and_eagerly_for_engines_dealt_in_turn():
    alone = replay(TRACE, 1, 50, 100, "round-robin", "auto", "lru")
    assert alone["auto_chose"] == ["evicting"]
    dealt = replay(TRACE, 4, 50, 800, "round-robin", "auto", "lru")
    assert dealt["auto_chose"].count("eager") >= 3


def test_under_balanced_cache_aware_routing_saving_on_eviction_is_ahead():
    eager = replay(TRACE, 4, 50, 200, "prefix-balanced", "eager", "lru")
    evicting = replay(TRACE, 4, 50, 200, "prefix-balanced", "evicting", "lru")
    assert evicting["busiest_engine_share"] < 0.3  # the routing spreads the requests
    assert evicting["pool"] > 1.5 * eager["pool"]
