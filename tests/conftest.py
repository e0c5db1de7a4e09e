"""Shared fixtures: real node daemons started as child processes, each in its own run
directory under /dev/shm so that tests never collide, and a real S3 server (radosgw, see
tests/s3server.py) shared by the whole session."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.harness.process import NodeProcess
from tests.integrations.engine import EnginePool
from tests.s3server import S3Server

SHM = Path("/dev/shm")
ENGINE_GROUP = "engines"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``), every test that runs vLLM goes
    to one worker, in order, with the session's shared engines (:class:`EnginePool`): the
    other worker runs the rest of the suite beside it."""
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))


@pytest.fixture(scope="session", autouse=True)
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ``VLLM_CACHE_ROOT`` for every engine of the session: vLLM inspects a model's
    architecture once (6 s a start), and nothing is left in the machine's home."""
    path = tmp_path_factory.mktemp("vllm-cache")
    previous = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("VLLM_CACHE_ROOT", None)
    else:
        os.environ["VLLM_CACHE_ROOT"] = previous


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = SHM / f"kvpool-test-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o770)
    yield path
    shutil.rmtree(path, ignore_errors=True)


NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def start_node(run_dir: Path) -> Iterator[NodeFactory]:
    """Start ``kvpool serve`` children: ``start_node(name="a", memory="64MiB", extra=[...])``."""
    started: list[NodeProcess] = []

    def start(
        name: str = "node",
        memory: str = "64MiB",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> NodeProcess:
        node = NodeProcess.private(
            name, memory, run_dir=str(run_dir), extra=extra or [], env={**os.environ, **(env or {})}
        )
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.stop()


@pytest.fixture
def node(start_node: NodeFactory) -> NodeProcess:
    return start_node()


@pytest.fixture
def client(node: NodeProcess) -> Iterator[Client]:
    with Client(node.unix_address, timeout=10) as c:
        yield c


@pytest.fixture
def tcp_client(node: NodeProcess) -> Iterator[Client]:
    with Client(node.tcp_address, use_shm=False, timeout=10) as c:
        yield c


@pytest.fixture(scope="session")
def engines(vllm_cache: Path) -> Iterator[EnginePool]:
    """The session's shared vLLM engines (:class:`~tests.integrations.engine.EnginePool`):
    one per model and settings, started on first use."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One radosgw (memstore OSD, no mgr) for the session; started on first use."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on ``s3_server``: its name."""
    return s3_server.make_bucket(f"kvpool-test-{secrets.token_hex(6)}")
