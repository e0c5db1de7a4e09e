"""Pins the public API and the direction of dependencies between layers."""

import ast
from pathlib import Path

import kvpool

SRC = Path(kvpool.__file__).parent

EXPECTED_API = {
    "AsyncClient",
    "AuthenticationError",
    "BadRequest",
    "ChecksumMismatch",
    "Client",
    "ClientConfig",
    "ConfigError",
    "FormatError",
    "ConnectError",
    "Forbidden",
    "GetResult",
    "InternalError",
    "KVPoolError",
    "LeaseExpired",
    "Namespace",
    "NoSpace",
    "NodeConfig",
    "NodeUnavailable",
    "PoolFuture",
    "PoolTimeout",
    "ProtocolError",
    "PutResult",
    "QuotaExceeded",
    "Status",
    "StoreError",
    "TooLarge",
    "TransportError",
    "UnsupportedVersion",
    "UsageError",
    "__version__",
    "block_key",
    "chained_hashes",
}


def test_public_api_is_pinned():
    assert set(kvpool.__all__) == EXPECTED_API
    for name in kvpool.__all__:
        assert hasattr(kvpool, name)


def _imports(package: str) -> set[str]:
    found = set()
    for path in (SRC / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def _forbidden(package: str, prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in _imports(package) if m.startswith(prefixes)}


def test_store_knows_nothing_of_sockets_or_asyncio():
    assert not _forbidden(
        "store", ("asyncio", "socket", "kvpool.node", "kvpool.client", "kvpool.protocol")
    )


def test_protocol_knows_no_store_node_or_client():
    assert not _forbidden(
        "protocol", ("kvpool.store", "kvpool.node", "kvpool.client", "kvpool.cluster")
    )


def test_client_knows_no_node_or_store():
    assert not _forbidden(
        "client", ("kvpool.node", "kvpool.store", "kvpool.integrations", "kvpool.router")
    )


def test_integrations_and_router_use_the_client_not_the_server():
    for package in ("integrations", "router"):
        assert not _forbidden(package, ("kvpool.node", "kvpool.store", "kvpool.protocol"))


def test_no_pickle_anywhere():
    for package in (
        "store",
        "protocol",
        "node",
        "client",
        "cluster",
        "router",
        "integrations",
        "cli",
    ):
        assert not _forbidden(package, ("pickle", "cloudpickle", "dill")), package
