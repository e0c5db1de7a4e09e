"""``kvpool status``: the node's (or cluster's) capacity, usage, hit rate and namespaces."""

from __future__ import annotations

import sys

import msgspec
from rich.console import Console
from rich.table import Table

from kvpool.client.client import Client
from kvpool.config import format_size
from kvpool.protocol.messages import NodeStats


def hit_rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def node_table(rows: list[tuple[NodeStats | None, str, str]]) -> Table:
    table = Table(title="kvpool nodes")
    for column in (
        "node",
        "address",
        "state",
        "capacity",
        "used",
        "blocks",
        "hit rate",
        "puts",
        "evictions",
    ):
        table.add_column(
            column, justify="left" if column in ("node", "address", "state") else "right"
        )
    for stats, address, state in rows:
        if stats is None:
            table.add_row(address, address, f"[red]{state}[/]", *["-"] * 6)
            continue
        percent = 100 * stats.used_bytes / max(stats.capacity_bytes, 1)
        used = f"{format_size(stats.used_bytes)} ({percent:.0f}%)"
        table.add_row(
            stats.node_id,
            stats.tcp_address,
            f"[green]{state}[/]",
            format_size(stats.capacity_bytes),
            used,
            str(stats.num_blocks),
            hit_rate(stats.hits, stats.misses),
            str(stats.puts),
            str(stats.evictions),
        )
    return table


def namespace_table(stats: list[NodeStats]) -> Table:
    table = Table(title="namespaces")
    for column in ("namespace", "node", "blocks", "used", "hits", "misses", "hit rate"):
        table.add_column(column, justify="left" if column in ("namespace", "node") else "right")
    for node in stats:
        for ns in node.namespaces:
            table.add_row(
                ns.label or ns.namespace_id[:16],
                node.node_id,
                str(ns.num_blocks),
                format_size(ns.used_bytes),
                str(ns.hits),
                str(ns.misses),
                hit_rate(ns.hits, ns.misses),
            )
    return table


def show_status(address: str | None, json_output: bool) -> None:
    with Client(address) as client:
        stats = client.stats()
    if json_output:
        sys.stdout.write(msgspec.json.encode({"nodes": [stats]}).decode() + "\n")
        return
    console = Console(width=max(Console().width, 140))
    console.print(node_table([(stats, stats.tcp_address, "up")]))
    if stats.namespaces:
        console.print(namespace_table([stats]))
