"""``kvpool demo``, the README's first command, as a newcomer runs it: a node and a real vLLM
engine on the tiny model, with and without the pool."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_the_demo_reuses_the_pool_and_changes_no_output():
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "demo", "--conversations", "4", "--turns", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["conversations"], summary["turns"]) == (4, 3)
    # Greedy outputs are those of the engine alone when its own prefix cache keeps every
    # conversation's history (it did), and later turns found their history in the pool (a
    # prompt's tokens the engine's own cache had lost).
    assert summary["own_kept_history"] is True
    assert summary["outputs_identical"] is True
    assert summary["hit_rate"] > 0
    assert summary["ttft_ms_median_pool"] is not None
