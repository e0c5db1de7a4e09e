"""Start the router and fake engines as real processes for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from tests.cluster.fabric import free_port


class Proc:
    def __init__(
        self, args: list[str], ready: str, env: dict[str, str] | None = None, timeout: float = 60
    ):
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.output: list[str] = []
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.output.append(line)
            if ready in line:
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("process exited before it was ready:\n" + "".join(self.output[-40:]))
        import threading

        self._reader = threading.Thread(
            target=lambda: self.output.extend(self.proc.stdout), daemon=True
        )
        self._reader.start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        if not self._reader.is_alive():
            self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class FakeEngine(Proc):
    def __init__(self, name: str = "fake", port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        super().__init__(
            [
                sys.executable,
                "-m",
                "tests.router.fake_engine",
                "--port",
                str(self.port),
                "--name",
                name,
            ],
            "FAKE_READY",
        )

    def configure(self, **state: object) -> None:
        post(f"{self.url}/_config", state)

    def reset(self) -> None:
        """Back to the defaults, its log empty."""
        post(f"{self.url}/_reset", {})

    def log(self) -> list[dict]:
        return get_json(f"{self.url}/_log")


class RouterProc(Proc):
    def __init__(self, engines: list[str], *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "kvpool",
            "router",
            "--port",
            str(self.port),
            "--log-level",
            "info",
        ]
        for engine in engines:
            command += ["--engine", engine]
        super().__init__([*command, *args], "KVPOOL_ROUTER_READY", env=env, timeout=120)


def post(url: str, body: object, method: str = "POST", timeout: float = 30) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get_json(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())
