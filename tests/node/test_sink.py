"""The sinks' one bounded-queue thread (kvpool.node.sink): a rule a test."""

import threading

from kvpool.node.sink import SinkThread


def test_rule_1_a_full_queue_refuses_without_blocking() -> None:
    taken, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def drain(items: list[int]) -> None:
        if items:
            taken.set()
            release.wait(5)  # the thread holds its batch: the queue fills behind it
            batches.append(items)

    sink: SinkThread[int] = SinkThread("test-sink", drain, max_queued=2, max_batch=1)
    sink.start()
    try:
        assert sink.put(0)
        assert taken.wait(5)
        assert sink.put(1) and sink.put(2)
        assert not sink.put(3)  # full: refused at once
    finally:
        release.set()
        sink.close(5)
    assert batches == [[0], [1], [2]]


def test_rule_2_batches_keep_the_order_and_the_bound() -> None:
    batches: list[list[int]] = []
    sink: SinkThread[int] = SinkThread(
        "test-sink", batches.append, max_queued=100, max_batch=4, gather_s=0.05
    )
    for i in range(10):
        assert sink.put(i)
    sink.start()
    assert sink.flush(5)
    sink.close(5)
    items = [item for batch in batches for item in batch]
    assert items == list(range(10))
    assert all(len(batch) <= 4 for batch in batches)
    assert [] in batches  # woken with nothing: the owner's turn between batches


def test_rule_3_flush_waits_for_what_was_put_and_close_drains_the_rest() -> None:
    handled: list[int] = []
    sink: SinkThread[int] = SinkThread("test-sink", handled.extend, max_queued=100, max_batch=8)
    sink.start()
    for i in range(20):
        sink.put(i)
    assert sink.flush(5) and handled == list(range(20))
    sink.put(20)
    sink.close(5)
    assert handled == list(range(21)) and not sink.is_running
