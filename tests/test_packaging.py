"""kvpool as a user installs it without the source tree: the wheel and sdist ``make dist``
builds (``python -m build``), the wheel installed into a clean virtual environment, and
``kvpool serve`` and ``kvpool status`` run from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from kvpool.node.daemon import READY_PREFIX

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_wheel_installs_and_serves_from_a_clean_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("kvpool-*.whl")
    (sdist,) = dist.glob("kvpool-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvpool/node/dashboard.html" in names and "kvpool/py.typed" in names
    assert not any(n.startswith("tests/") for n in names)
    with tarfile.open(sdist) as archive:
        members = {Path(m).relative_to(Path(m).parts[0]).as_posix() for m in archive.getnames()}
    assert {"pyproject.toml", "README.md", "LICENSE", "src/kvpool/__init__.py"} <= members

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, env=env, timeout=900)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvpool; print(kvpool.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed package, not the source tree

    kvpool = str(venv / "bin" / "kvpool")
    run_dir = tmp_path / "run"
    serve = [kvpool, "serve", "--memory", "16MiB", "--port", "0", "--admin-port", "0"]
    serve += ["--run-dir", str(run_dir), "--name", "packaged"]
    node = subprocess.Popen(
        serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env
    )
    try:
        info = None
        deadline = time.monotonic() + 60
        assert node.stdout is not None
        while info is None and time.monotonic() < deadline:
            line = node.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                info = json.loads(line[len(READY_PREFIX) :])
        assert info is not None, "kvpool serve from the wheel did not become ready"
        status = subprocess.run(
            [kvpool, "status", "--address", f"unix:{info['unix']}", "--json"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        (shown,) = json.loads(status.stdout)["nodes"]
        assert shown["state"] == "up" and shown["capacity_bytes"] == 16 << 20, shown
    finally:
        node.terminate()
        node.wait(30)
        if node.stdout is not None:
            node.stdout.close()
