"""1,000 concurrent streaming requests through the router (stand-in engines)."""

from benchmarks.router_load import run


def test_a_thousand_concurrent_streams_all_complete():
    result = run(num_requests=1000, num_engines=2, chunks=8, delay=0.01)
    routed = result["router"]
    assert routed["errors"] == 0, routed["error_kinds"]
    assert routed["completed"] == 1000
    assert result["direct"]["completed"] == 1000
    # The latency the router adds is reported (see docs/benchmarks.md), not asserted: timing
    # on a shared machine is not a test.  It must at least have been measured.
    assert result["added_first_byte_p50_ms"] is not None and result["quiet_router"]["p50"] > 0
    print("router added first-byte latency:", {k: v for k, v in result.items() if "added" in k})
