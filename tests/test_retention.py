"""Retention hints as requests carry them (kvpool.retention): parsed within bounds, a
malformed one refused, each block's priority the highest of the ranges over it."""

import pytest

from kvpool.errors import ConfigError
from kvpool.retention import (
    DEFAULT_PRIORITY,
    MAX_RANGES,
    PARAMS_KEY,
    SESSION_PRIORITY,
    Hint,
    TokenRange,
    as_params,
    by_hint,
    hint_from,
)


def test_a_block_takes_the_highest_priority_of_the_ranges_over_it():
    hint = Hint((TokenRange(0, 64, 90, 600.0), TokenRange(48, None, 20, 0.0)))
    # Blocks of 32 tokens: [0,32) in the first range, [32,64) in both, the rest in the second.
    assert hint.block_priorities(0, 4, 32) == [(90, 600.0), (90, 600.0), (20, 0.0), (20, 0.0)]
    assert Hint().block_priorities(0, 2, 32) == [(DEFAULT_PRIORITY, 0.0)] * 2


def test_a_session_keeps_its_prefix_above_the_default_for_its_time():
    hint = Hint((TokenRange(0, 32, 95, 60.0),), session_id="chat-1", session_s=120.0)
    assert hint.block_priorities(0, 2, 32) == [(95, 60.0), (SESSION_PRIORITY, 120.0)]


def test_hints_travel_as_kv_transfer_params_and_come_back_the_same():
    hint = Hint((TokenRange(0, 4096, 90, 600.0),), session_id="agent-7", session_s=300.0)
    assert hint_from(as_params(hint)) == hint
    assert hint_from({}) is None and hint_from({"other": 1}) is None


@pytest.mark.parametrize(
    "raw",
    [
        "not an object",
        {"ranges": [{"start": 0, "priority": 101}]},
        {"ranges": [{"start": 0, "priority": -1}]},
        {"ranges": [{"start": -5, "priority": 50}]},
        {"ranges": [{"start": 0, "priority": 50, "duration_s": 10**9}]},
        {"ranges": [{"start": 0, "priority": 50}] * (MAX_RANGES + 1)},
        {"ranges": ["x"]},
        {"session_id": "x" * 257},
        {"session_id": 5},
    ],
)
def test_a_malformed_hint_is_refused(raw):
    with pytest.raises(ConfigError):
        hint_from({PARAMS_KEY: raw})


def test_one_request_per_priority_and_duration_and_none_for_the_default():
    keys = [b"a", b"b", b"c", b"d"]
    hints = [(90, 60.0), (DEFAULT_PRIORITY, 0.0), (90, 60.0), (10, 0.0)]
    assert by_hint(keys, hints) == {(90, 60.0): [b"a", b"c"], (10, 0.0): [b"d"]}
