"""The ``kvpool`` command: serve, status, bench, demo, router."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from rich.console import Console

from kvpool.config import parse_size
from kvpool.errors import ConfigError, KVPoolError

app = typer.Typer(
    name="kvpool",
    help="kvpool: a distributed memory pool for LLM KV cache — store instead of recompute.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.command()
def serve(
    name: Annotated[
        str | None, typer.Option(help="Node name (also its directory under --run-dir).")
    ] = None,
    memory: Annotated[str | None, typer.Option(help="Arena size, e.g. 4GiB.")] = None,
    host: Annotated[str | None, typer.Option(help="TCP listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (0: any free port).")] = None,
    advertise_host: Annotated[
        str | None, typer.Option(help="Address other nodes use to reach this one.")
    ] = None,
    admin_host: Annotated[str | None, typer.Option(help="Admin HTTP listen address.")] = None,
    admin_port: Annotated[
        int | None, typer.Option(help="Admin HTTP port (0: any free port).")
    ] = None,
    run_dir: Annotated[
        str | None, typer.Option(help="Where the arena and the Unix socket live.")
    ] = None,
    access_id: Annotated[
        str | None, typer.Option(help="Access id clients authenticate with.")
    ] = None,
    access_key: Annotated[
        str | None, typer.Option(help="Access key (HMAC secret); prefer KVPOOL_ACCESS_KEY.")
    ] = None,
    host_id: Annotated[
        str | None, typer.Option(help="Host identity (defaults to the hostname).")
    ] = None,
    peers: Annotated[
        str | None, typer.Option(help="Static cluster: comma-separated host:port of every node.")
    ] = None,
    etcd: Annotated[
        str | None,
        typer.Option(help="etcd endpoint for cluster membership, e.g. http://127.0.0.1:2379."),
    ] = None,
    replicas: Annotated[
        int | None, typer.Option(help="Home copies kept of each block in a cluster.")
    ] = None,
    hugepages: Annotated[
        bool, typer.Option(help="Ask for transparent huge pages on the arena.")
    ] = False,
    disk: Annotated[
        str | None, typer.Option(help="A directory for the local disk tier (e.g. on NVMe).")
    ] = None,
    disk_size: Annotated[
        str | None, typer.Option(help="How much of it the disk tier may use, e.g. 500GiB.")
    ] = None,
    scrub_rate: Annotated[
        str | None,
        typer.Option(
            help="Bytes a second the node re-verifies what it holds (0: off), e.g. 64MiB."
        ),
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh", help="Start empty: drop what an earlier daemon left (arena and disk)."
        ),
    ] = False,
    kv_events: Annotated[
        str | None,
        typer.Option(
            help="Publish KV events (vLLM's format) on this ZMQ endpoint, e.g. tcp://*:5557."
        ),
    ] = None,
    kv_events_replay: Annotated[
        str | None, typer.Option(help="A ZMQ ROUTER endpoint that replays KV events.")
    ] = None,
    kv_events_topic: Annotated[
        str | None, typer.Option(help="The KV events' topic, e.g. kv@<pod>@<model>.")
    ] = None,
    kv_events_encoding: Annotated[
        str | None,
        typer.Option(help="map (vLLM since mid-2026) or array (earlier vLLM releases)."),
    ] = None,
    object_store: Annotated[
        str | None,
        typer.Option(
            help="The shared object-store tier below the disk, s3://BUCKET/PREFIX "
            "(credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."
        ),
    ] = None,
    object_store_endpoint: Annotated[
        str | None, typer.Option(help="The S3 endpoint, e.g. http://rgw.local:7480.")
    ] = None,
    object_store_region: Annotated[str | None, typer.Option(help="The S3 region.")] = None,
    object_store_size: Annotated[
        str | None, typer.Option(help="What the bucket may hold, e.g. 2TiB (oldest go first).")
    ] = None,
    object_refresh: Annotated[
        float | None, typer.Option(help="Seconds between reads of the bucket's index.")
    ] = None,
    tenants: Annotated[
        str | None,
        typer.Option(help="A tenants file (TOML): credentials, salts and quotas; reloaded."),
    ] = None,
    tls_cert: Annotated[
        str | None, typer.Option(help="TLS certificate (PEM) for the data port and admin HTTP.")
    ] = None,
    tls_key: Annotated[str | None, typer.Option(help="Its private key (PEM).")] = None,
    tls_client_ca: Annotated[
        str | None, typer.Option(help="Require client certificates signed by this CA (mTLS).")
    ] = None,
    tls_ca: Annotated[
        str | None, typer.Option(help="The CA of other nodes' certificates (node to node).")
    ] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Accept plaintext off loopback.")
    ] = False,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run a node daemon: a shared-memory arena served over a Unix socket and TCP.

    A restart (a crash, kill -9, an upgrade) finds the blocks of the last daemon again;
    `kvpool drain` empties the node."""
    from kvpool.config import node_config_from
    from kvpool.node.daemon import run_daemon

    _logging(log_level)
    overrides = {
        "name": name,
        "memory_bytes": parse_size(memory) if memory else None,
        "host": host,
        "port": port,
        "advertise_host": advertise_host,
        "admin_host": admin_host,
        "admin_port": admin_port,
        "run_dir": run_dir,
        "access_id": access_id,
        "access_key": access_key,
        "host_id": host_id,
        "peers": tuple(p.strip() for p in peers.split(",") if p.strip()) if peers else None,
        "etcd": etcd,
        "replicas": replicas,
        "hugepages": hugepages or None,
        "disk_path": disk,
        "disk_bytes": parse_size(disk_size) if disk_size else None,
        "scrub_bytes_s": parse_size(scrub_rate) if scrub_rate is not None else None,
        "fresh": fresh or None,
        "kv_events": kv_events,
        "kv_events_replay": kv_events_replay,
        "kv_events_topic": kv_events_topic,
        "kv_events_encoding": kv_events_encoding,
        "object_store": object_store,
        "object_store_endpoint": object_store_endpoint,
        "object_store_region": object_store_region,
        "object_store_bytes": parse_size(object_store_size) if object_store_size else None,
        "object_refresh_s": object_refresh,
        "tenants_path": tenants,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
        "tls_ca": tls_ca,
        "insecure": insecure or None,
    }
    config = node_config_from(overrides)
    run_daemon(config)


@app.command()
def status(
    address: Annotated[
        str | None, typer.Option(help="Node address (default: the local node, or KVPOOL_ADDRESS).")
    ] = None,
    peers: Annotated[str | None, typer.Option(help="A static cluster: host:port,...")] = None,
    etcd: Annotated[str | None, typer.Option(help="A cluster in etcd: http://host:2379")] = None,
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
) -> None:
    """Stop a node and empty it: its arena, journal and disk tier go."""
    from kvpool.cli.status import stop_node

    stop_node(address, drain=not keep)


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


@app.command()
def router(
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            help="An engine: URL[,role=both|prefill|decode][,node=host:port]. Repeatable.",
        ),
    ] = None,
    config: Annotated[
        str | None, typer.Option(help="A TOML or JSON file of router settings.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port.")] = None,
    policy: Annotated[
        str | None, typer.Option(help="round_robin, least_load, session or cache_aware.")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="The model's tokenizer (cache_aware routing, and prefetch)."),
    ] = None,
    prefetch_hold: Annotated[
        float | None,
        typer.Option(
            help="With --tokenizer: the chosen engine's node brings the prompt's blocks up "
            "from its lower tiers and holds them this many seconds (0: no prefetch)."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="The model name the engines' pool namespaces carry.")
    ] = None,
    block_size: Annotated[int | None, typer.Option(help="The engines' KV block size.")] = None,
    cache_weight: Annotated[
        float | None, typer.Option(help="cache_aware: weight of the prefix share.")
    ] = None,
    load_weight: Annotated[
        float | None, typer.Option(help="cache_aware: weight of the load share.")
    ] = None,
    read_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds an engine may stay silent before it counts as failed."),
    ] = None,
    tenants: Annotated[
        str | None, typer.Option(help="A tenants file: requests carry ID:KEY as a bearer token.")
    ] = None,
    tls_cert: Annotated[str | None, typer.Option(help="TLS certificate (PEM): HTTPS.")] = None,
    tls_key: Annotated[str | None, typer.Option(help="Its private key (PEM).")] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Accept plaintext off loopback.")
    ] = False,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """An OpenAI-compatible proxy in front of vLLM engines: prefill/decode disaggregation
    and cache-aware, load-aware routing."""
    from kvpool.router.main import run_router

    _logging(log_level)
    overrides = {
        "host": host,
        "port": port,
        "policy": policy,
        "tokenizer": tokenizer,
        "prefetch_hold": prefetch_hold,
        "model": model,
        "block_size": block_size,
        "cache_weight": cache_weight,
        "load_weight": load_weight,
        "read_timeout": read_timeout,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "insecure": insecure or None,
        "tenants": tenants,
    }
    run_router(config, overrides, engine or [])


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
