"""Run one benchmark with ``--json`` and keep its result, with the machine, the date and the
command that produced it, as the file the plots are drawn from (``benchmarks/plots.py``,
``make plots``):

    .venv/bin/python -m benchmarks.record benchmarks/results/fairness.json -- \\
        benchmarks.fairness --seconds 30 --json

The command after ``--`` is a module run with this interpreter (``kvpool`` runs the CLI).
Its standard output must be one JSON document (possibly after lines of progress); the file
holds ``{"command", "date", "machine", "result"}``.  Nothing is written when it fails.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """What the figures depend on: the CPU, its cores and vector units, memory, GPU none."""
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    units = [unit for unit in ("avx512f", "amx_tile") if unit in flags]
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "vector": ",".join(units) or "none",
        "memory_gib": round(memory_gib),
        "python": platform.python_version(),
    }


def label(record: dict[str, Any]) -> str:
    """One line for a plot: the machine and the date of the run."""
    m = record["machine"]
    units = {"avx512f": "AVX-512", "amx_tile": "AMX"}
    vector = "+".join(units.get(u, u) for u in m["vector"].split(",")) if m["vector"] else ""
    return (
        f"{m['cores']} vCPU {m['cpu']}, {vector or 'no AVX-512'}, {m['memory_gib']} GiB, "
        f"no GPU; {record['date']}"
    )


def parse_output(stdout: str) -> Any:
    """The JSON document a benchmark printed: all of it, or its last line."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        lines = [line for line in stdout.splitlines() if line.strip()]
        if not lines:
            raise
        return json.loads(lines[-1])


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, command = Path(argv[0]), argv[2:]
    module, args = command[0], command[1:]
    runner = ["-m", module]  # `kvpool` runs the CLI (kvpool/__main__.py)
    done = subprocess.run(
        [sys.executable, *runner, *args], stdout=subprocess.PIPE, text=True, check=False
    )
    if done.returncode != 0:
        print(f"{shlex.join(command)} failed ({done.returncode})", file=sys.stderr)
        return done.returncode
    record = {
        "command": shlex.join(command),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "result": parse_output(done.stdout),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
