"""The docs' pictures, drawn from the benchmarks' results (``benchmarks/record.py``, ``make
plots``): each is a PNG in docs/plots that says the machine, the date and the command of the
run it shows.

    .venv/bin/python -m benchmarks.plots benchmarks/results docs/plots

A plot whose result file is missing is left as it is, and said so.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from benchmarks.record import label

Record = dict[str, Any]
COLORS = {
    "ceiling": "#b0bec5",
    "kvpool": "#3f51b5",
    "peer": "#ef6c00",
    "other": "#00897b",
    "optimum": "#9e9e9e",
}


def _figure(
    record: Record, title: str, panels: int = 1, also: Record | None = None
) -> tuple[Figure, list[Any]]:
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels + 1.2, 4.4), squeeze=False)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    footer = f"{label(record)}\n{_command(record['command'])}"
    if also is not None:
        footer += f"\n{_command(also['command'])} ({also['date']})"
    fig.text(0.01, 0.01, footer, fontsize=7, color="#546e7a", va="bottom")
    return fig, list(axes[0])


def _command(command: str) -> str:
    """The command as the docs write it: a trace by its file name, Mooncake's interpreter as
    the Makefile's variable."""
    words = command.split()
    for n, word in enumerate(words):
        if word.endswith(".jsonl"):
            words[n] = Path(word).name
        elif n and words[n - 1] == "--mooncake-python":
            words[n] = "$MOONCAKE_PYTHON"
    return " ".join(words)


def _finish(fig: Figure) -> Figure:
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    return fig


def _tokens(value: float) -> str:
    return f"{value / 1e6:g}M"


def hit_rate(record: Record) -> Figure:
    """Hit rate against memory on the trace: the node's policies beside an LRU model and
    Belady's optimum; and the node's own estimate of what more or less memory would buy."""
    rows = record["result"]["rows"]
    fig, (curve, estimate) = _figure(
        record, "Hit rate against memory (Mooncake's conversation trace)", panels=2
    )
    capacities = [row["capacity_tokens"] for row in rows]
    curve.plot(
        capacities,
        [r["optimum"]["tokens"] for r in rows],
        "--",
        color=COLORS["optimum"],
        label="Belady's optimum",
    )
    curve.plot(
        capacities,
        [r["lru"]["tokens"] for r in rows],
        ":",
        color="#263238",
        lw=2,
        label="an LRU (model)",
    )
    policies = [node["eviction"] for node in rows[0]["nodes"]]
    for policy, color, marker in zip(
        policies, (COLORS["kvpool"], COLORS["other"]), "os", strict=False
    ):
        values = [next(n for n in r["nodes"] if n["eviction"] == policy)["tokens"] for r in rows]
        curve.plot(
            capacities,
            values,
            marker=marker,
            color=color,
            label=f"a kvpool node, --eviction {policy}",
        )
    curve.set_xscale("log")
    curve.set_xticks(capacities, [_tokens(c) for c in capacities])
    curve.set_xlabel("the node's memory (tokens of KV)")
    curve.set_ylabel("share of input tokens served from the pool")
    curve.set_ylim(0, None)
    curve.legend(fontsize=8)
    curve.grid(alpha=0.3)

    # The node's estimate (its online curve, in full blocks) at 0.5x-4x its memory, against
    # an LRU replayed at that memory: one line per node size.
    for row, color in zip(rows, plt.get_cmap("viridis")([0.1, 0.4, 0.65, 0.9]), strict=False):
        node = next(n for n in row["nodes"] if n["eviction"] == "lru")
        scales = sorted(node["estimates"], key=float)
        x = [float(s) * row["capacity_tokens"] for s in scales]
        estimate.plot(
            x,
            [node["estimates"][s] for s in scales],
            "o-",
            color=color,
            label=f"estimated by a {_tokens(row['capacity_tokens'])} node",
        )
        estimate.plot(x, [row["lru_at_scales"][s] for s in scales], "x:", color=color)
    estimate.plot([], [], "kx:", label="an LRU replayed at that memory")
    estimate.set_xscale("log")
    estimate.set_xlabel("memory (tokens of KV), 0.5x to 4x each node's")
    estimate.set_ylabel("hit rate (full blocks)")
    estimate.set_title("What more memory would buy: the node's own estimate", fontsize=10)
    estimate.legend(fontsize=7)
    estimate.grid(alpha=0.3)
    return _finish(fig)


def cluster_hit_rate(record: Record) -> Figure:
    """Ten nodes' separate caches against the same nodes as one pool."""
    rows = record["result"]["rows"]
    fig, (axis,) = _figure(record, "Ten servers: separate caches or one pool")
    bars = [
        ("separate nodes", lambda r: _run(r, "separate")["tokens"], COLORS["ceiling"]),
        ("one kvpool cluster", lambda r: _run(r, "cluster")["tokens"], COLORS["kvpool"]),
        (
            "one ideal LRU of all\ntheir memory (model)",
            lambda r: r["lru_global"]["tokens"],
            COLORS["optimum"],
        ),
    ]
    width = 0.8 / len(bars)
    for i, (name, value, color) in enumerate(bars):
        xs = [n + (i - 1) * width for n in range(len(rows))]
        values = [value(r) for r in rows]
        axis.bar(xs, values, width, color=color, label=name)
        for x, v in zip(xs, values, strict=False):
            axis.text(x, v + 0.005, f"{v:.3f}", ha="center", fontsize=8)
    names = [f"{r['nodes']} nodes x {_tokens(r['capacity_tokens_per_node'])} tokens" for r in rows]
    axis.set_xticks(range(len(rows)), names)
    axis.set_ylabel("share of input tokens served from the pool")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(axis="y", alpha=0.3)
    return _finish(fig)


def _run(row: Record, mode: str) -> Record:
    return next(run for run in row["runs"] if run["mode"] == mode)


def ttft_per_turn(record: Record) -> Figure:
    """vLLM's time to first token per conversation turn, with and without the pool."""
    result = record["result"]
    turns = result["per_turn"]
    fig, (axis,) = _figure(record, "vLLM: time to first token per turn of a chat")
    xs = [t["turn"] for t in turns]
    axis.plot(
        xs,
        [t["nopool"] for t in turns],
        "o-",
        color=COLORS["peer"],
        label="vLLM alone (its own prefix cache, too small for the history)",
    )
    axis.plot(
        xs, [t["pool"] for t in turns], "o-", color=COLORS["kvpool"], label="vLLM with kvpool"
    )
    if "own" in turns[0]:
        axis.plot(
            xs,
            [t["own"] for t in turns],
            "s:",
            color=COLORS["optimum"],
            label="vLLM with a cache large enough for every conversation",
        )
    for t in turns:
        axis.annotate(
            f"{t['pool_cached']:.0%} cached",
            (t["turn"], t["pool"]),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=7,
            color=COLORS["kvpool"],
        )
    axis.set_xticks(xs, [f"{t['turn']}\n{t['prompt_tokens']} tokens" for t in turns])
    axis.set_xlabel("turn (and its prompt's length)")
    axis.set_ylabel("median time to first token (ms)")
    axis.set_ylim(0, None)
    identical = "identical" if result.get("outputs_identical") else "NOT identical"
    axis.set_title(
        f"{result['conversations']} conversations, tiny model; answers {identical}", fontsize=9
    )
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return _finish(fig)


def throughput(bench: Record, mooncake: Record | None) -> Figure:
    """kvpool's put/get against its ceilings of the same run, beside Redis and Mooncake."""
    panels = 3 if mooncake else 2
    fig, axes = _figure(bench, "Throughput against the ceiling of the same run", panels, mooncake)
    cases = bench["result"]["cases"]
    for axis, path, ceiling in ((axes[0], "shm", "memcpy"), (axes[1], "tcp", "socket stream")):
        ours = [c for c in cases if c["system"] == "kvpool" and c["path"] == path]
        redis = {
            (c["op"], c["block_bytes"]): c["gbps"]
            for c in cases
            if c["system"] == "redis" and c["path"] == path
        }
        names = [f"{c['op']}\n{c['block_bytes'] // 1024} KiB" for c in ours]
        series = [
            (ceiling, [c["ceiling_gbps"] for c in ours], COLORS["ceiling"]),
            ("kvpool", [c["gbps"] for c in ours], COLORS["kvpool"]),
        ]
        if redis:
            series.append(
                (
                    "Redis",
                    [redis.get((c["op"], c["block_bytes"]), 0) for c in ours],
                    COLORS["other"],
                )
            )
        _bars(axis, names, series)
        where = "same host (shared memory)" if path == "shm" else "over TCP (loopback)"
        axis.set_title(f"kvpool bench, {where}", fontsize=9)
    if mooncake:
        rows = mooncake["result"]
        where = {"shm": "host", "shm, pipelined": "host pipelined", "tcp": "TCP"}
        names = [f"{where.get(r['path'], r['path'])} {r['op']} {r['batch_mib']}M" for r in rows]
        _bars(
            axes[2],
            names,
            [
                ("ceiling", [r["ceiling_gbps"] for r in rows], COLORS["ceiling"]),
                ("kvpool", [r["kvpool_gbps"] for r in rows], COLORS["kvpool"]),
                ("Mooncake Store", [r["mooncake_gbps"] for r in rows], COLORS["peer"]),
            ],
        )
        axes[2].set_title(f"beside Mooncake Store, 2 MiB blocks ({mooncake['date']})", fontsize=9)
        axes[2].tick_params(axis="x", labelrotation=40)
        for tick in axes[2].get_xticklabels():
            tick.set_horizontalalignment("right")
    axes[0].set_ylabel("GB/s")
    return _finish(fig)


def _bars(axis: Any, names: list[str], series: list[tuple[str, list[float], str]]) -> None:
    width = 0.8 / len(series)
    for i, (name, values, color) in enumerate(series):
        xs = [n + (i - (len(series) - 1) / 2) * width for n in range(len(names))]
        axis.bar(xs, values, width, color=color, label=name)
    axis.set_xticks(range(len(names)), names, fontsize=7)
    axis.legend(fontsize=7)
    axis.grid(axis="y", alpha=0.3)


def fairness(record: Record) -> Figure:
    """A tenant's p99 on a quiet node, under attack, and with the attackers paused."""
    result = record["result"]
    phases = [("quiet", "quiet"), ("attacked", "under attack"), ("paused", "attackers paused")]
    fig, (axis,) = _figure(record, "Fair under attack: a well-behaved tenant's p99")
    names = ["lookup", "put"]
    series = [
        (text, [result[phase][f"{op}_p99_ms"] for op in names], color)
        for (phase, text), color in zip(
            phases, (COLORS["ceiling"], COLORS["peer"], COLORS["kvpool"]), strict=False
        )
    ]
    _bars(axis, names, series)
    axis.set_ylabel("p99 latency (ms)")
    axis.set_title(
        f"under attack / quiet: lookup {result['lookup_p99_ratio']}x, "
        f"put {result['put_p99_ratio']}x (the bar: 2x)",
        fontsize=9,
    )
    return _finish(fig)


def _read(results: Path, name: str) -> Record | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


PLOTS: dict[str, tuple[tuple[str, ...], Callable[..., Figure]]] = {
    "hit-rate": (("trace-replay",), hit_rate),
    "cluster-hit-rate": (("trace-cluster",), cluster_hit_rate),
    "ttft-per-turn": (("demo",), ttft_per_turn),
    "throughput": (("bench", "vs-mooncake?"), throughput),
    "fairness": (("fairness",), fairness),
}


def draw(results: Path, out: Path) -> list[str]:
    """Every plot whose results exist, into ``out``; the names drawn."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, (inputs, plot) in PLOTS.items():
        records = [_read(results, i.rstrip("?")) for i in inputs]
        required = [r for i, r in zip(inputs, records, strict=False) if not i.endswith("?")]
        if any(r is None for r in required):
            print(f"{name}: no result in {results} yet (make plots runs it)", file=sys.stderr)
            continue
        fig = plot(*records)
        fig.savefig(out / f"{name}.png", dpi=100, metadata={"Software": None})
        plt.close(fig)
        drawn.append(name)
    return drawn


def main(argv: list[str]) -> int:
    results, out = (Path(a) for a in (argv + ["benchmarks/results", "docs/plots"][len(argv) :]))
    for name in draw(results, out):
        print(f"{out / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
