"""The guide's EMS connector on kvpool, beside kvpool's own connector and no connector, in
one run: the demo's multi-turn chat workload, median and p90 time to first token, and the
pool's hit rate.

All three engines run with vLLM's prefix caching off, as the guide deploys the EMS
connector, so that every reuse is the connector's.  The EMS engine first waits for the
connector's own health loop to call EMS healthy (three checks, 10 s apart).  Whether each
answers as the engine alone does is judged against the engine alone with its prefix cache
on and room for every conversation (``outputs_identical``: each turn's history from its
own prefix cache, :data:`kvpool.harness.workload.OWN`).

    .venv/bin/python -m benchmarks.ems [--json]

The connector files are read from ``ems-seed/`` under ``KVPOOL_THIRD_PARTY_DIR`` (default
``../shared``) and installed into a temporary directory with ``kvpool ems install``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.thirdparty import third_party_dir

from kvpool.ems.install import install
from kvpool.harness.process import NodeProcess
from kvpool.harness.tiny_model import build_tiny_model
from kvpool.harness.workload import (
    OWN_KV_CACHE_BYTES,
    Workload,
    kvpool_connector,
    run_workload,
)

ENGINE = {"enable_prefix_caching": False}
EMS_HEALTHY_AFTER_S = 22


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seed = third_party_dir() / "ems-seed"
    model = str(build_tiny_model(None))
    workload = Workload(num_conversations=8, num_turns=4)
    site = Path(tempfile.mkdtemp(prefix="kvpool-ems-site-"))
    run_dir = tempfile.mkdtemp(prefix="kvpool-ems-bench-", dir="/dev/shm")
    install(site, seed)
    out: dict[str, Any] = {"conversations": 8, "turns": 4, "prefix_caching": False}
    try:
        node = NodeProcess.private("ems-bench", "1GiB", run_dir=run_dir).start()
        ems_env = {
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "KVPOOL_ADDRESS": node.unix_address,
            "EMS_NUM_MIN_REUSE_TOKENS": "0",
            "EMS_NUM_MIN_LOAD_BLOCKS": "0",
            "EMS_LOOKUP_KEY_SERVER_BASE_PORT": str(_free_port()),
        }
        ems_connector = {
            "kv_connector": "EmsStoreConnector",
            "kv_connector_module_path": "vllm_ascend.distributed.ems_store.ems_store_connector",
            "kv_role": "kv_both",
        }
        runs = {
            "no connector": run_workload("nopool", model, workload, None, engine=ENGINE),
            "kvpool connector": run_workload(
                "kvpool", model, workload, kvpool_connector(node.unix_address), engine=ENGINE
            ),
            "EMS connector on kvpool": run_workload(
                "ems",
                model,
                workload,
                ems_connector,
                engine=ENGINE,
                env=ems_env,
                warmup_s=EMS_HEALTHY_AFTER_S,
            ),
        }
        node.stop()
        own = {"enable_prefix_caching": True, "kv_cache_memory_bytes": OWN_KV_CACHE_BYTES}
        reference = [
            t["token_ids"] for t in run_workload("own", model, workload, None, engine=own).turns
        ]
        for name, run in runs.items():
            ttfts = run.ttfts()
            out[name] = {
                "ttft_ms_median": round(statistics.median(ttfts), 2),
                "ttft_ms_p90": round(sorted(ttfts)[int(0.9 * len(ttfts))], 2),
                "hit_rate": round(run.hit_rate, 4),
                "outputs_identical": [t["token_ids"] for t in run.turns] == reference,
            }
    finally:
        shutil.rmtree(site, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.stdout.write(json.dumps(out, indent=None if args.json else 2) + "\n")


if __name__ == "__main__":
    main()
