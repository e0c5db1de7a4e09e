"""``kvpool demo``: a node daemon and a real vLLM engine on a tiny model built locally,
replaying a multi-turn chat workload with and without the pool.

It prints the time to first token of each turn both ways, the pool's hit rate, and whether
the outputs were identical to the engine's own when its own prefix cache keeps the history
(greedy sampling: loading the right KV changes nothing).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kvpool.harness.process import NodeProcess

if TYPE_CHECKING:
    from kvpool.harness.workload import Comparison

LABELS = {
    "nopool": "no connector",
    "pool": "kvpool",
    "example": "ExampleConnector",
    "own": "no connector, 20x the KV cache",
}


def run_demo(
    console: Console,
    *,
    num_conversations: int,
    num_turns: int,
    compare_example: bool,
    json_output: bool,
    model_dir: str | None,
) -> dict[str, Any]:
    from kvpool.harness.tiny_model import build_tiny_model
    from kvpool.harness.workload import (
        Workload,
        compare,
        example_connector,
        kvpool_connector,
    )

    with console.status("building the tiny model (first run only)"):
        model = str(build_tiny_model(model_dir))
    workload = Workload(num_conversations=num_conversations, num_turns=num_turns)
    name = f"demo-{os.getpid()}"
    with (
        NodeProcess.private(name, "1GiB", ephemeral=True) as node,
        tempfile.TemporaryDirectory() as example_dir,
    ):
        configs: dict[str, dict[str, Any] | None] = {
            "nopool": None,
            "pool": kvpool_connector(node.unix_address),
        }
        if compare_example:
            configs["example"] = example_connector(example_dir)
        with console.status("") as status:

            def progress(run: str) -> None:
                status.update(
                    f"vLLM engine with {LABELS[run]}: {num_conversations} conversations x "
                    f"{num_turns} turns"
                )

            comparison = compare(model, workload, configs, progress)
        summary = comparison.summary()
        summary["node"] = node.info["name"]
        summary["per_turn"] = comparison.per_turn()
    if json_output:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        _print_report(console, comparison, summary, list(comparison.runs))
    return summary


def _print_report(
    console: Console, comparison: Comparison, summary: dict[str, Any], runs: list[str]
) -> None:
    """The per-turn table and the summary lines; ``runs``: the engines compared, by name."""
    num_conversations = summary["conversations"]
    table = Table(
        title=f"kvpool demo: time to first token per turn (median ms), {num_conversations} "
        "interleaved conversations, tiny Llama on vLLM (CPU)"
    )
    table.add_column("turn", justify="right")
    table.add_column("prompt tokens", justify="right")
    for run in runs:
        table.add_column(LABELS[run], justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("prompt cached: no pool / kvpool", justify="right")
    for row in comparison.per_turn():
        cells = [str(row["turn"]), str(row["prompt_tokens"])]
        cells += [f"{row[run]:.0f}" if row[run] is not None else "-" for run in runs]
        speedup = row["nopool"] / row["pool"] if row["nopool"] and row["pool"] else None
        cells.append(f"{speedup:.1f}x" if speedup else "-")
        cells.append(f"{100 * row['nopool_cached']:.0f}% / {100 * row['pool_cached']:.0f}%")
        table.add_row(*cells)
    console.print(table)
    console.print(
        "median TTFT after the first turn: "
        f"{summary['ttft_ms_median_nopool']} ms without the pool, "
        f"{summary['ttft_ms_median_pool']} ms with it ({summary.get('speedup_median', '-')}x); "
        f"pool hit rate {100 * summary['hit_rate']:.1f}% of the prompt tokens the engine's own "
        f"cache missed"
    )
    console.print(
        "outputs identical to the engine alone with a KV cache that keeps every history "
        f"(each turn's prefix from its own prefix cache): {summary['outputs_identical']}"
    )
    console.print(
        f"p90 TTFT after the first turn: {summary['ttft_ms_p90_nopool']} ms without the pool, "
        f"{summary['ttft_ms_p90_pool']} ms with it"
    )
    if "example" in runs:
        console.print(
            f"ExampleConnector: median TTFT {summary['ttft_ms_median_example']} ms, "
            f"p90 {summary['ttft_ms_p90_example']} ms, "
            f"hit rate {100 * summary['hit_rate_example']:.1f}%"
        )
