"""The one guard: a pool failure is a miss with a reason, reported to the health monitor;
a bug is logged and leaves the pool's health alone."""

import logging

from kvpool import Client
from kvpool.client.health import HealthMonitor, HealthPolicy
from kvpool.errors import NodeUnavailable, PoolTimeout
from kvpool.kvcache.guard import PoolGuard

log = logging.getLogger("test.guard")


def monitor():
    return HealthMonitor(lambda: None, HealthPolicy(max_slow=2))


def test_a_pool_error_is_a_miss_and_marks_the_pool_unhealthy():
    health = monitor()
    guard = PoolGuard(health, log)
    with guard.call("load") as outcome:
        raise NodeUnavailable("gone", node="n1")
    assert outcome.failed and outcome.reason.startswith("NodeUnavailable: gone")
    assert not health.is_healthy and not guard.is_healthy


def test_a_bug_is_logged_and_leaves_health_alone(caplog):
    health = monitor()
    guard = PoolGuard(health, log)
    with caplog.at_level(logging.ERROR, logger="test.guard"), guard.call("save") as outcome:
        raise RuntimeError("a bug in a copy")
    assert outcome.reason == "RuntimeError: a bug in a copy"
    assert health.is_healthy
    assert any(r.exc_info and "save failed" in r.getMessage() for r in caplog.records)


def test_a_call_that_returns_ends_a_run_of_slow_ones():
    health = monitor()
    guard = PoolGuard(health, log)
    with guard.call("lookup"):
        raise PoolTimeout("slow")
    with guard.call("lookup") as outcome:
        pass
    assert not outcome.failed
    with guard.call("lookup"):
        raise PoolTimeout("slow")
    assert health.is_healthy  # two slow calls, but not in a row


def test_without_a_monitor_a_failure_is_only_a_reason(start_node):
    node = start_node()
    guard = PoolGuard(None, log)
    with Client(node.unix_address, timeout=0.5) as client:
        node.kill()
        with guard.call("lookup") as outcome:
            client.lookup([b"k" * 16])
    assert outcome.failed and guard.is_healthy
