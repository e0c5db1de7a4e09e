import json
import shutil
import subprocess
import sys

from kvpool import Client, Namespace
from tests.helpers import content


def kvpool(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_status_shows_the_node_and_its_namespaces(node):
    ns = Namespace(model="tiny-llama", dtype="bfloat16", layout="cpu")
    with Client(node.unix_address) as c:
        c.describe(ns)
        keys = ns.keys([bytes([i]) * 32 for i in range(5)])
        c.put(keys, [content(k, 4096) for k in keys])
        c.lookup([*keys, ns.key(b"missing" * 4)])
    result = kvpool("status", "--address", node.unix_address, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (stats,) = data["nodes"]
    assert stats["num_blocks"] == 5 and stats["capacity_bytes"] == 64 << 20
    (namespace,) = stats["namespaces"]
    assert namespace["label"] == "tiny-llama bfloat16 cpu" and namespace["num_blocks"] == 5
    table = kvpool("status", "--address", node.unix_address)
    assert table.returncode == 0
    assert (
        "tiny-llama bfloat16 cpu" in table.stdout and "83.3%" in table.stdout
    )  # 5 of 6 blocks hit
    assert "memory" in table.stdout and "per block" in table.stdout  # what the index costs
    assert stats["metadata_bytes"] > 0 and stats["heap_bytes"] > 0


def test_status_shows_what_a_node_says_as_text():
    """Whatever a node (or a tenant, through a label) says is shown as the text it is: no
    console markup, control characters written out (issue 43, item 6)."""
    from rich.console import Console

    from kvpool.cli.status import shown

    said = "[/][link=https://evil.example]x[/link]\x1b]52;c;aGk=\x07\u2028"
    assert shown(said).plain == "[/][link=https://evil.example]x[/link]\\x1b]52;c;aGk=\\x07\\u2028"
    console = Console(width=200, force_terminal=True, record=True)
    console.print(shown(said))
    assert "\x1b]52" not in console.export_text(styles=True)


def test_the_tenants_table_shows_every_resource_of_the_ledger():
    """One column per resource of the tenant ledger, "used / limit" where it has a limit."""
    import msgspec
    from rich.console import Console

    from kvpool.cli.status import account_table
    from kvpool.protocol.messages import NodeStats
    from kvpool.stats import AccountStats
    from kvpool.store.accounts import Resource

    fields = {f.name: 0 for f in msgspec.structs.fields(NodeStats) if f.required}
    fields.update(node_id="n1", host_id="h", tcp_address="", uptime_s=0.0)
    account = AccountStats(
        tenant="beta",
        used={"arena_bytes": 3 << 20, "disk_bytes": 1 << 20},
        limits={"arena_bytes": 8 << 20, "disk_bytes": 16 << 20},
    )
    stats = NodeStats(**fields, accounts=[account])
    console = Console(width=400, record=True)
    console.print(account_table([stats]))
    text = console.export_text()
    header = text.splitlines()[2]
    for resource in Resource:
        title = resource.value.removesuffix("_bytes").replace("_", " ")
        assert title in header, (title, header)
    assert "3.0 MiB / 8.0 MiB" in text and "1.0 MiB / 16.0 MiB" in text


def test_status_of_a_node_that_is_not_there_is_a_clear_error(run_dir):
    result = kvpool("status", "--address", f"unix:{run_dir}/nowhere.sock")
    assert result.returncode == 1 and "cannot connect" in result.stderr


def test_bench_json_has_every_case_and_field():
    result = kvpool(
        "bench", "--json", "--sizes", "64KiB,2MiB", "--total", "16MiB", "--batch", "4MiB"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    cases = report["cases"]
    fields = {
        "system",
        "op",
        "path",
        "block_bytes",
        "gbps",
        "ceiling_gbps",
        "ratio",
        "p50_ms",
        "p99_ms",
    }
    for case in cases:
        assert fields <= set(case)
        assert case["gbps"] > 0 and case["ceiling_gbps"] > 0
        # The ratio is the median of per-round ratios: near, not equal to, the ratio of medians.
        assert 0.2 < case["ratio"] / (case["gbps"] / case["ceiling_gbps"]) < 5
        if case["path"].startswith("shm"):  # also beside memcpy over the copy threads
            assert case["threads_ceiling_gbps"] > 0 and case["threads_ratio"] > 0
        else:
            assert case["threads_ceiling_gbps"] is None
    kv = {(c["op"], c["path"], c["block_bytes"]) for c in cases if c["system"] == "kvpool"}
    assert kv == {
        (op, path, size)
        for op in ("put", "get")
        for path in ("shm", "tcp")
        for size in (65536, 2 << 20)
    } | {("put", "shm, pipelined", size) for size in (65536, 2 << 20)}
    redis_rows = [c for c in cases if c["system"] == "redis"]
    if shutil.which("redis-server"):
        assert len(redis_rows) == 4
        assert all(c["vs_redis"] for c in cases if c["system"] == "kvpool")
    else:
        assert any("redis-server is not installed" in note for note in report["notes"])
    assert report["lookup"]["num_keys"] == 1000 and report["lookup"]["found"] == 1000
    assert report["lookup"]["p99_ms"] > 0


def test_a_router_whose_tokenizer_cannot_be_loaded_says_so(tmp_path):
    """Offline, a hub name not in the cache: one line naming the setting, no traceback."""
    import os

    config = tmp_path / "router.toml"
    config.write_text(
        'port = 0\ntokenizer = "nobody/no-such-model"\nmodel = "m"\n'
        '[[engines]]\nurl = "http://127.0.0.1:9"\n'
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = kvpool("router", "--config", str(config), env=env, timeout=120)
    assert result.returncode == 2, result.stderr  # a configuration error, as the CLI's others
    assert "cannot load the tokenizer 'nobody/no-such-model'" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
