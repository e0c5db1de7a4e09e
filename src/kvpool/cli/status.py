"""``kvpool status``: capacity, usage, hit rate, namespaces and each tenant's use of its
budgets, of a node or of a whole cluster (``--peers`` / ``--etcd``, or ``KVPOOL_PEERS`` /
``KVPOOL_ETCD``).

Every text a node reports (a namespace's label is a tenant's: anything a tenant wrote) is
shown as text, never as console markup, and with its control characters written out
(``\x1b``): nothing a node or a tenant sends runs in the operator's terminal."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvpool.client.client import Client
from kvpool.config import client_config_from, format_size
from kvpool.limits import WRITE_THROUGH_TIMEOUT_S
from kvpool.protocol.messages import NodeStats
from kvpool.stats import ESTIMATE_SCALES
from kvpool.store.accounts import Resource


def shown(text: str) -> Text:
    """A node's text as the operator sees it: never markup, control characters escaped."""
    return Text(
        "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    )


def hit_rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def node_table(rows: list[tuple[str, NodeStats | None]]) -> Table:
    table = Table(title="kvpool nodes")
    columns = (
        "node",
        "address",
        "state",
        "capacity",
        "used",
        "blocks",
        "hit rate",
        "puts",
        "evictions",
    )
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("node", "address", "state") else "right"
        )
    for address, stats in rows:
        if stats is None:
            table.add_row("?", shown(address), Text("down", style="red"), *["-"] * 6)
            continue
        percent = 100 * stats.used_bytes / max(stats.capacity_bytes, 1)
        table.add_row(
            shown(stats.node_id),
            shown(stats.tcp_address),
            Text("up", style="green"),
            format_size(stats.capacity_bytes),
            f"{format_size(stats.used_bytes)} ({percent:.0f}%)",
            str(stats.num_blocks),
            hit_rate(stats.hits, stats.misses),
            str(stats.puts),
            str(stats.evictions),
        )
    return table


PREFETCH_COLUMNS = (
    "issued",
    "in_dram",
    "started",
    "completed",
    "refused",
    "absent",
    "useful",
    "wasted",
    "held_blocks",
)


def prefetch_table(stats: list[NodeStats]) -> Table:
    """Per node: blocks prefetched for queued requests, and whether it paid (useful: read
    while held; wasted: the hold lapsed unread)."""
    table = Table(title="prefetch")
    table.add_column("node")
    for column in (*PREFETCH_COLUMNS, "held"):
        table.add_column(column.replace("_", " "), justify="right")
    for node in stats:
        p = node.prefetch
        if p is not None:
            cells = [str(getattr(p, c)) for c in PREFETCH_COLUMNS]
            table.add_row(shown(node.node_id), *cells, format_size(p.held_bytes))
    return table


# The per-tier counters shown after capacity and usage: column title, TierStats field.
TIER_COUNTER_COLUMNS = (
    ("blocks", "num_blocks"),
    ("hits", "hits"),
    ("reads", "reads"),
    ("writes", "writes"),
    ("refused", "refused"),
    ("dropped", "dropped"),
    ("slowed", "slowed"),
    ("promotions", "promotions"),
    ("served", "served"),
    ("evictions", "evictions"),
    ("corrupt", "corrupt"),
    ("recovered", "recovered"),
    ("errors", "errors"),
)


def tier_table(stats: list[NodeStats]) -> Table:
    table = Table(title="tiers")
    for column in ("node", "tier"):
        table.add_column(column, justify="left")
    for column in ("capacity", "used", *(title for title, _ in TIER_COUNTER_COLUMNS)):
        table.add_column(column, justify="right")
    for node in stats:
        for tier in node.tiers:
            percent = 100 * tier.used_bytes / max(tier.capacity_bytes, 1)
            table.add_row(
                shown(node.node_id),
                shown(tier.name),
                format_size(tier.capacity_bytes),
                f"{format_size(tier.used_bytes)} ({percent:.0f}%)",
                *(str(getattr(tier, field)) for _, field in TIER_COUNTER_COLUMNS),
            )
    return table


def estimate_table(stats: list[NodeStats]) -> Table:
    """Per node and tier: the hit rate it estimates it would have with that tier at each
    multiple of its capacity (the faster tiers as they are)."""
    table = Table(title="what more memory would buy (estimated hit rate)")
    table.add_column("node")
    table.add_column("tier")
    for scale in ESTIMATE_SCALES:
        table.add_column(f"{scale:g}x", justify="right")
    for node in stats:
        for tier in node.tiers:
            rates = {e.scale: e.hit_rate for e in tier.estimates}
            if rates:
                cells = [f"{100 * rates[s]:.1f}%" if s in rates else "-" for s in ESTIMATE_SCALES]
                table.add_row(node.node_id, tier.name, *cells)
    return table


def memory_table(stats: list[NodeStats]) -> Table:
    """Per node: what its bookkeeping costs, per block held and per connection open."""
    table = Table(title="memory")
    table.add_column("node")
    for column in ("index", "per block", "conn buffers", "per conn", "heap", "heap per block"):
        table.add_column(column, justify="right")
    for node in stats:
        blocks = max(node.num_blocks, 1)
        connections = max(node.num_connections, 1)
        table.add_row(
            shown(node.node_id),
            format_size(node.metadata_bytes),
            f"{node.metadata_bytes / blocks:.0f} B" if node.num_blocks else "-",
            format_size(node.connection_buffer_bytes),
            format_size(node.connection_buffer_bytes // connections)
            if node.num_connections
            else "-",
            format_size(node.heap_bytes),
            f"{node.heap_bytes / blocks:.0f} B" if node.num_blocks else "-",
        )
    return table


def format_table(stats: list[NodeStats]) -> Table:
    """Per node: its release, and each persistent format it writes and what it found at
    start (the previous release's files, adopted and migrated in place)."""
    table = Table(title="formats")
    for column in ("node", "release", "format", "version", "written by", "found at start"):
        table.add_column(column, justify="right" if column == "version" else "left")
    for node in stats:
        for row in node.formats:
            found = row.found or "-"
            table.add_row(node.node_id, node.release, row.name, str(row.version), row.writer, found)
    return table


def namespace_table(stats: list[NodeStats]) -> Table:
    table = Table(title="namespaces")
    columns = ("namespace", "node", "saves", "blocks", "used", "hits", "misses", "hit rate")
    for column in columns:
        left = column in ("namespace", "node", "saves")
        table.add_column(column, justify="left" if left else "right")
    for node in stats:
        for ns in node.namespaces:
            table.add_row(
                shown(ns.label or ns.namespace_id[:16]),
                shown(node.node_id),
                ns.saving or "-",  # one of a few words the node checked (kvpool status)
                str(ns.num_blocks),
                format_size(ns.used_bytes),
                str(ns.hits),
                str(ns.misses),
                hit_rate(ns.hits, ns.misses),
            )
    return table


def account_columns() -> list[tuple[str, str, bool]]:
    """Each resource of the tenant ledger (:class:`~kvpool.store.accounts.Resource`), shown
    "used / limit": its column's title, its name, whether it counts bytes."""
    return [
        (r.value.removesuffix("_bytes").replace("_", " "), r.value, r.value.endswith("_bytes"))
        for r in Resource
    ]


def _amount(value: int, is_bytes: bool) -> str:
    return format_size(value) if is_bytes else str(value)


def account_table(stats: list[NodeStats]) -> Table:
    """Per node and tenant: what the tenant holds of each budget, out of its limit, and
    how often each refused it (``kvpool.store.accounts``)."""
    table = Table(title="tenants")
    table.add_column("tenant")
    table.add_column("node")
    columns = account_columns()
    for title, _, _ in columns:
        table.add_column(title, justify="right")
    table.add_column("refused", justify="left")
    for node in stats:
        for account in node.accounts:
            cells = []
            for _, name, is_bytes in columns:
                used = _amount(account.used.get(name, 0), is_bytes)
                limit = account.limits.get(name)
                cells.append(used if limit is None else f"{used} / {_amount(limit, is_bytes)}")
            refused = ", ".join(f"{name} {n}" for name, n in sorted(account.refused.items()))
            table.add_row(shown(account.tenant), shown(node.node_id), *cells, shown(refused))
    return table


def show_status(
    address: str | None, peers: str | None, etcd: str | None, json_output: bool
) -> None:
    options: dict[str, Any] = {}
    if peers:
        options["peers"] = [p for p in peers.split(",") if p.strip()]
    if etcd:
        options["etcd"] = etcd
    config = client_config_from(options)
    if address is not None:
        config = config.replace(address=address)
    elif config.peers or config.etcd:
        config = config.replace(address="")  # the cluster view needs no local node
    with Client(config=config) as client:
        rows = client.cluster_stats()
    if json_output:
        nodes = [
            {
                "address": addr,
                "state": "up" if s else "down",
                **(msgspec.to_builtins(s) if s else {}),
            }
            for addr, s in rows
        ]
        sys.stdout.write(msgspec.json.encode({"nodes": nodes}).decode() + "\n")
        return
    console = Console(width=max(Console().width, 180))
    console.print(node_table(rows))
    up = [s for _, s in rows if s is not None]
    if any(s.heap_bytes for s in up):
        console.print(memory_table(up))
    if any(s.tiers for s in up):
        console.print(tier_table(up))
    if any(t.estimates for s in up for t in s.tiers):
        console.print(estimate_table(up))
    if any(s.prefetch for s in up):
        console.print(prefetch_table(up))
    if any(s.formats for s in up):
        console.print(format_table(up))
    if any(s.accounts for s in up):
        console.print(account_table(up))
    if any(s.namespaces for s in up):
        console.print(namespace_table(up))


def hand_off(
    address: str | None, targets: list[str], rate_bytes: int, deadline_s: float, *, seal: bool
) -> bool:
    """Ask a node to hand every block it holds to ``targets`` and wait until it has (or its
    deadline passed; ``seal``: then take no more writes); say what moved and what did not.
    Whether every block was placed."""
    from kvpool.client import ops

    options: dict[str, Any] = {} if address is None else {"address": address}
    config = client_config_from(options)
    with Client(config=config) as client:
        node = client._require_local()
        node_id = node.welcome.node_id
        result = node.call(
            lambda _: ops.handoff(node_id, targets, rate_bytes, deadline_s, seal),
            deadline_s + config.timeout_s + WRITE_THROUGH_TIMEOUT_S,
        )
    console = Console(stderr=True)
    console.print(
        f"handed {result.num_blocks} blocks ({format_size(result.num_bytes)}; "
        f"{result.num_from_disk} from disk) to {len(targets)} node(s) in "
        f"{result.elapsed_ms / 1000:.1f} s; {result.num_failed} failed, "
        f"{result.num_left} left at the deadline; {result.num_written} written meanwhile"
    )
    placed = result.num_failed == 0 and result.num_left == 0
    if seal and placed and result.is_sealed:
        console.print("every block is placed; the node takes no more writes")
    return placed


def stop_node(address: str | None, *, drain: bool) -> None:
    """Ask a node to stop (``drain``: and to empty itself), and wait until it has."""
    import time

    from kvpool.client import ops
    from kvpool.errors import TransportError

    options: dict[str, Any] = {} if address is None else {"address": address}
    config = client_config_from(options)
    with Client(config=config) as client:
        node = client._require_local()
        node_id = node.welcome.node_id
        node.call(lambda _: ops.shutdown(node_id, drain), config.timeout_s)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                client.health(timeout=1.0)
            except TransportError:
                break
            time.sleep(0.1)
    Console(stderr=True).print(
        f"node at {config.address} stopped" + (" and emptied" if drain else "")
    )
