"""The ``kvpool`` command: serve, status, bench, demo, router."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from rich.console import Console

from kvpool.cli.options import given, with_settings
from kvpool.cli.reference import node_defaults, settings_defaults
from kvpool.config import node_settings, parse_size
from kvpool.errors import ConfigError, KVPoolError
from kvpool.router.config import ROUTER_SETTINGS, RouterSettings

app = typer.Typer(
    name="kvpool",
    help="kvpool: a distributed memory pool for LLM KV cache — store instead of recompute.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

# What `kvpool serve` sets: every field of the node's configuration (kvpool.config).
SERVE_SETTINGS = tuple(setting for _, _, setting in node_settings())


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.command()
@with_settings(SERVE_SETTINGS, node_defaults())
def serve(
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info", **values: object
) -> None:
    """Run a node daemon: a shared-memory arena served over a Unix socket and TCP.

    A restart (a crash, kill -9, an upgrade) finds the blocks of the last daemon again;
    `kvpool drain` empties the node.  Every option can also be given as its KVPOOL_*
    environment variable (an option wins over it)."""
    from kvpool.config import node_config_from
    from kvpool.node.daemon import run_daemon

    _logging(log_level)
    options = given(SERVE_SETTINGS, values)
    if options.get("access_key"):
        logging.getLogger("kvpool.node").warning(
            "--access-key is visible to every local user in the process list: "
            "give it with --access-key-file or KVPOOL_ACCESS_KEY instead"
        )
    config = node_config_from(options)
    run_daemon(config)


@app.command()
def status(
    address: Annotated[
        str | None, typer.Option(help="Node address (default: the local node, or KVPOOL_ADDRESS).")
    ] = None,
    peers: Annotated[str | None, typer.Option(help="A static cluster: host:port,...")] = None,
    etcd: Annotated[str | None, typer.Option(help="A cluster in etcd: https://host:2379")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show capacity, usage, hit rate and namespaces of the node, or of every node of a
    cluster (--peers / --etcd)."""
    from kvpool.cli.status import show_status

    show_status(address, peers, etcd, json_output)


@app.command()
def drain(
    address: Annotated[
        str | None, typer.Option(help="Node address (default: the local node, or KVPOOL_ADDRESS).")
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Stop the node but keep its contents (as SIGTERM).")
    ] = False,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="First hand the node's blocks, hottest first, to their homes among these "
            "nodes (host:port,...): the nodes that stay when this one leaves the cluster.",
        ),
    ] = None,
    rate: Annotated[
        str, typer.Option(help="With --to: at most this many bytes a second.")
    ] = "256MiB",
    deadline: Annotated[
        float, typer.Option(help="With --to: seconds the handoff may take at most.")
    ] = 60.0,
    discard_unplaced: Annotated[
        bool,
        typer.Option(
            "--discard-unplaced",
            help="With --to: empty the node even if some blocks could not be handed over "
            "(by default it is then kept, serving, and the exit status is 1).",
        ),
    ] = False,
) -> None:
    """Stop a node and empty it: its arena, journal and disk tier go.  With --to, it first
    hands every block it holds (DRAM, disk, and what is written meanwhile) to the nodes
    that stay (a node leaving the cluster: decommission), and is emptied only if all were
    placed; exit status 1 if some were not."""
    from kvpool.cli.status import hand_off, stop_node

    if to:
        targets = [t.strip() for t in to.split(",") if t.strip()]
        placed = hand_off(address, targets, parse_size(rate), deadline, seal=not keep)
        if not placed and not discard_unplaced and not keep:
            typer.echo(
                "not every block was placed: the node is kept, serving; run the drain "
                "again, or add --discard-unplaced to empty it anyway",
                err=True,
            )
            raise typer.Exit(1)
    stop_node(address, drain=not keep)
    if to and not placed:
        raise typer.Exit(1)


@app.command()
def bench(
    address: Annotated[
        str | None,
        typer.Option(help="Benchmark a running node at this TCP address instead of starting one."),
    ] = None,
    sizes: Annotated[str, typer.Option(help="Block sizes.")] = "64KiB,512KiB,2MiB",
    total: Annotated[str, typer.Option(help="Bytes moved per case.")] = "512MiB",
    batch: Annotated[str, typer.Option(help="Bytes per batched call.")] = "32MiB",
    redis: Annotated[
        bool, typer.Option(help="Run Redis side by side (needs redis-server).")
    ] = True,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure put/get throughput and latency, same-node and over TCP, beside memcpy, a plain
    socket stream and Redis."""
    from kvpool.cli.bench import BenchOptions, run_bench

    options = BenchOptions(
        block_sizes=[parse_size(s) for s in sizes.split(",")],
        total_bytes=parse_size(total),
        batch_bytes=parse_size(batch),
        with_redis=redis,
        address=address,
    )
    run_bench(options, json_output)


@app.command()
def demo(
    pool_only: Annotated[
        bool, typer.Option("--pool-only", help="Only the pool: no engine.")
    ] = False,
    conversations: Annotated[int, typer.Option(help="Conversations, interleaved.")] = 8,
    turns: Annotated[int, typer.Option(help="Turns per conversation.")] = 4,
    compare_example: Annotated[
        bool, typer.Option("--compare-example", help="Also run vLLM's ExampleConnector.")
    ] = False,
    model_dir: Annotated[str | None, typer.Option(help="Where the tiny model is built.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Start a node and a vLLM engine with the kvpool connector on a tiny model built
    locally, replay a multi-turn chat, and compare time to first token with and without
    the pool (--pool-only: the pool alone, no engine)."""
    if pool_only:
        import json

        from kvpool.demo.pool import run_pool_demo

        result = run_pool_demo(Console())
        if json_output:
            sys.stdout.write(json.dumps(result) + "\n")
        return
    from kvpool.demo.chat import run_demo

    run_demo(
        Console(width=max(Console().width, 120)),
        num_conversations=conversations,
        num_turns=turns,
        compare_example=compare_example,
        json_output=json_output,
        model_dir=model_dir,
    )


def _router_defaults() -> dict[str, str]:
    return settings_defaults(ROUTER_SETTINGS, RouterSettings)


@app.command()
@with_settings(ROUTER_SETTINGS, _router_defaults(), env=False)
def router(
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            help="An engine: URL[,role=both|prefill|decode][,node=host:port][,tenants=NAME] "
            "(with --tenants, the one tenant it serves). Repeatable.",
        ),
    ] = None,
    config: Annotated[
        str | None, typer.Option(help="A TOML or JSON file of router settings.")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
    **values: object,
) -> None:
    """An OpenAI-compatible proxy in front of vLLM engines: prefill/decode disaggregation
    and cache-aware, load-aware routing."""
    from kvpool.router.main import run_router

    _logging(log_level)
    run_router(config, given(ROUTER_SETTINGS, values), engine or [])


ems_app = typer.Typer(help="The EMS-compatible SDK (kvpool.ems).", no_args_is_help=True)
app.add_typer(ems_app, name="ems")


@ems_app.command("install")
def ems_install(
    target: Annotated[str, typer.Argument(help="A directory to add to PYTHONPATH.")],
    connector_files: Annotated[
        str | None,
        typer.Option(
            help="Your copy of the guide's connector files: also install them as "
            "vllm_ascend.distributed.ems_store, with a torch_npu stand-in (hosts without Ascend)."
        ),
    ] = None,
) -> None:
    """Write a thin `ems` package over kvpool.ems into TARGET (never over a real one)."""
    from kvpool.ems.install import install

    written = install(target, connector_files)
    console.print(f"wrote {len(written)} files under {target}; add it to PYTHONPATH")


def main() -> None:
    try:
        app()
    except ConfigError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)
    except KVPoolError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(1)
