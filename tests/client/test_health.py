from kvpool.client.health import HealthMonitor, HealthPolicy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Probe:
    def __init__(self):
        self.ok = True

    def __call__(self):
        if not self.ok:
            raise ConnectionError("down")


def make(**policy):
    clock, probe = Clock(), Probe()
    monitor = HealthMonitor(probe, HealthPolicy(**policy), clock=clock)
    return monitor, probe, clock


def test_fails_fast_and_recovers_after_consecutive_successes():
    monitor, probe, _clock = make(recover_after=3, max_flaps=5)
    assert monitor.is_healthy
    monitor.report_failure("timeout")
    assert not monitor.is_healthy
    monitor.check_once()
    monitor.check_once()
    assert not monitor.is_healthy
    probe.ok = False
    monitor.check_once()  # a failure resets the count
    probe.ok = True
    monitor.check_once()
    monitor.check_once()
    assert not monitor.is_healthy
    monitor.check_once()
    assert monitor.is_healthy


def test_flapping_blocks_recovery_until_the_window_passes():
    monitor, _probe, clock = make(recover_after=1, flap_window_s=30, max_flaps=3)
    for _ in range(3):
        clock.now += 1
        monitor.report_failure("flap")
        if _ < 2:
            monitor.check_once()
            assert monitor.is_healthy
    assert monitor.is_flapping
    for _ in range(10):
        clock.now += 1
        monitor.check_once()
    assert not monitor.is_healthy  # still inside the window
    clock.now += 30
    monitor.check_once()
    assert monitor.is_healthy and not monitor.is_flapping


def test_background_probe_thread():
    import time

    probe = Probe()
    probe.ok = False
    monitor = HealthMonitor(probe, HealthPolicy(interval_s=0.02, recover_after=2)).start()
    try:
        deadline = time.monotonic() + 5
        while monitor.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not monitor.is_healthy
        probe.ok = True
        while not monitor.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.is_healthy
    finally:
        monitor.stop()


def test_a_slow_pool_is_unhealthy_only_after_several_timeouts_in_a_row():
    from kvpool.errors import ConnectError, PoolTimeout

    monitor, _probe, _clock = make(max_slow=3)
    monitor.report_failure(PoolTimeout("slow"))
    monitor.report_failure(PoolTimeout("slow"))
    assert monitor.is_healthy  # a busy host, not a dead pool
    monitor.report_call()  # a call that succeeded ends the run
    monitor.report_failure(PoolTimeout("slow"))
    monitor.report_failure(PoolTimeout("slow"))
    assert monitor.is_healthy
    monitor.report_failure(PoolTimeout("slow"))
    assert not monitor.is_healthy
    other, _, _ = make(max_slow=3)
    other.report_failure(ConnectError("refused"))
    assert not other.is_healthy  # unreachable: at once
