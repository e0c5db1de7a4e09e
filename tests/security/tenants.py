"""Helpers for the hostile-client tests: a tenants file, credentials, raw requests."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpool import Client
from kvpool.client import ops
from kvpool.client.connection import Connection
from kvpool.config import Address, client_config_from
from kvpool.protocol.messages import Message, Op

CLUSTER = ("cluster", "cluster-key-" + "c" * 20)


class TenantsFile:
    """A tenants file the test rewrites as an operator would (keys added, revoked)."""

    def __init__(self, path: Path):
        self.path = path
        self.tenants: dict[str, dict[str, Any]] = {}

    def add(
        self, name: str, quota: str = "8MiB", max_connections: int = 256, keys: int = 1
    ) -> list[tuple[str, str]]:
        credentials = [(f"{name}-{i}", secrets.token_hex(16)) for i in range(1, keys + 1)]
        self.tenants[name] = {
            "salt": secrets.token_hex(16),
            "quota": quota,
            "max_connections": max_connections,
            "keys": dict(credentials),
        }
        return credentials

    def write(self) -> None:
        lines = ["[cluster]", f'access_id = "{CLUSTER[0]}"', f'key = "{CLUSTER[1]}"', ""]
        for name, tenant in self.tenants.items():
            lines += [
                f"[tenants.{name}]",
                f'salt = "{tenant["salt"]}"',
                f'quota = "{tenant["quota"]}"',
                f"max_connections = {tenant['max_connections']}",
                f"[tenants.{name}.keys]",
                *(f'"{i}" = "{k}"' for i, k in tenant["keys"].items()),
                "",
            ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines))
        tmp.chmod(0o600)  # the node refuses a tenants file others may read
        tmp.replace(self.path)  # as an operator's tool would: never a half-written file
        time.sleep(0.01)


def client(address: str, credential: tuple[str, str], **options: Any) -> Client:
    access_id, access_key = credential
    return Client(address, access_id=access_id, access_key=access_key, timeout=10, **options)


@contextmanager
def raw_connection(address: str, credential: tuple[str, str]) -> Iterator[Connection]:
    """An authenticated connection that sends whatever request the test builds."""
    config = client_config_from(
        {"address": address, "access_id": credential[0], "access_key": credential[1]}
    )
    connection = Connection(Address.parse(address), config, time.monotonic() + 10)
    try:
        yield connection
    finally:
        connection.close()


def send(connection: Connection, op: Op, message: Message, response: type[Message]) -> Any:
    def request() -> ops.Op_[Any]:
        yield ops.Request(op, message)
        answer, _ = yield ops.Recv(op, response)
        return answer

    return connection.run(request(), time.monotonic() + 10)
