"""The pieces of a session's services: the registry's tenant caps, credentials, the byte
counters with their write-through, and lookups that wait for the store to change."""

import asyncio
import time
from dataclasses import dataclass

import pytest

from kvpool.config import NodeConfig
from kvpool.errors import NodeUnavailable
from kvpool.node.services import Credentials, NodeIdentity, SessionRegistry, StoreChanges, Traffic
from kvpool.store.block import Block, CommitResult
from kvpool.tenants import Credential, Tenant


@dataclass(eq=False)
class Connection:
    tenant: Tenant | None = None
    credential: Credential | None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def test_the_registry_caps_each_tenants_connections():
    alpha = Tenant("alpha", b"salt-a", 1 << 20, max_connections=2)
    beta = Tenant("beta", b"salt-b", 1 << 20, max_connections=1)
    registry = SessionRegistry()
    first, second, third = Connection(alpha), Connection(alpha), Connection(alpha)
    for session in (first, second, third):
        registry.opened(session)
    registry.admit(first)
    registry.admit(second)
    with pytest.raises(NodeUnavailable):
        registry.admit(third)
    registry.admit(Connection(beta))  # another tenant's cap is its own
    assert registry.num_of(alpha) == 2 and len(registry) == 3
    registry.closed(first)
    registry.admit(third)  # a closed connection frees its place
    assert registry.num_of(alpha) == 2 and len(registry) == 2
    registry.admit(Connection())  # no tenant: not counted against any cap


def test_credentials_of_the_nodes_one_key():
    keyed = Credentials(NodeConfig(access_id="me", access_key="secret"), None)
    assert keyed.requires_auth and keyed.announces_auth
    credential = keyed.credential("me")
    assert credential is not None and credential.key == "secret" and credential.tenant is None
    assert keyed.credential("someone else") is None
    open_node = Credentials(NodeConfig(), None)
    assert not open_node.requires_auth and open_node.credential("me") is None


def test_traffic_counts_and_writes_through_only_what_was_asked():
    written: list[list[bytes]] = []
    traffic = Traffic(lambda keys: written.append(list(keys)))
    block = Block(b"k" * 16, 0, 100)
    traffic.published(CommitResult([], [block]), replicate=False)
    traffic.published(CommitResult([], [block]), replicate=True)
    traffic.sent(7)
    assert traffic.bytes_in == 200 and traffic.bytes_out == 7
    assert written == [[block.key]]


def test_a_waiting_lookup_wakes_on_a_change_or_its_timeout():
    async def scenario() -> tuple[float, float]:
        changes = StoreChanges()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        loop.call_later(0.05, changes.notify)
        await changes.wait(5.0)
        woken = time.monotonic() - started
        started = time.monotonic()
        await changes.wait(0.05)  # nothing changes
        return woken, time.monotonic() - started

    woken, timed_out = asyncio.run(scenario())
    assert woken < 1.0
    assert 0.04 <= timed_out < 1.0


def test_the_identity_advertises_its_address():
    identity = NodeIdentity.of(NodeConfig(host="0.0.0.0", advertise_host="10.0.0.5"))
    identity.tcp_port = 7000
    assert identity.tcp_address == "10.0.0.5:7000"
