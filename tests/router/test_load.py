"""1,000 concurrent streaming requests through the router (stand-in engines)."""

from benchmarks.router_load import run


def test_a_thousand_concurrent_streams_all_complete():
    # 20 requests one at a time each way, not the benchmark's 200: each takes its whole
    # stream (80 ms), and the test asserts only that they were measured.
    result = run(num_requests=1000, num_engines=2, chunks=8, delay=0.01, num_quiet=20)
    routed = result["router"]
    assert routed["errors"] == 0, routed["error_kinds"]
    assert routed["completed"] == 1000
    assert result["direct"]["completed"] == 1000
    # The latency the router adds is reported (see docs/benchmarks.md), not asserted: timing
    # on a shared machine is not a test.  It must at least have been measured.
    assert result["added_first_byte_p50_ms"] is not None and result["quiet_router"]["p50"] > 0
    print("router added first-byte latency:", {k: v for k, v in result.items() if "added" in k})


def test_a_burst_leaves_a_bounded_idle_pool():
    # A burst's connections beyond the bound are closed as they are released, so that a
    # later request never has to close hundreds of expired ones before it can connect.
    import asyncio

    import aiohttp

    from kvpool.router.app import BoundedIdleConnector
    from tests.router.servers import FakeEngine

    engine = FakeEngine(name="pool")

    async def burst() -> tuple[int, int]:
        connector = BoundedIdleConnector(4, limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                async with session.post(
                    engine.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}
                ) as response:
                    await response.read()

            await asyncio.gather(*(one() for _ in range(40)))
            idle = sum(len(conns) for conns in connector._conns.values())
            await one()  # and the pool still serves
            return idle, sum(len(conns) for conns in connector._conns.values())

    try:
        idle, after = asyncio.run(burst())
    finally:
        engine.stop()
    assert 1 <= idle <= 4 and 1 <= after <= 4
