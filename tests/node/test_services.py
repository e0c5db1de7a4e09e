"""The pieces of a session's services: the registry's caps (tenants, strangers, the node),
credentials, the byte counters with their write-through, and lookups parked on a key."""

import asyncio
import time
from dataclasses import dataclass

import pytest

from kvpool.config import NodeConfig
from kvpool.errors import NodeUnavailable
from kvpool.limits import Budgets
from kvpool.node.connections import SessionRegistry
from kvpool.node.services import Credentials, NodeIdentity, StoreChanges, Traffic, Turns
from kvpool.store.accounts import NODE, Accounts
from kvpool.store.block import CommitResult
from kvpool.tenants import Credential, Tenant


@dataclass(eq=False)
class Connection:
    tenant: Tenant | None = None
    credential: Credential | None = None
    peer: str = "10.0.0.1"
    is_local: bool = False
    buffer_bytes: int = 4096
    is_idle_since: float | None = None
    closed: bool = False

    @property
    def account(self) -> bytes:
        return self.tenant.tag if self.tenant is not None else NODE

    def close(self) -> None:
        self.closed = True


def registry_of(*tenants: Tenant, **budgets: float) -> SessionRegistry:
    accounts = Accounts(Budgets(**budgets))  # type: ignore[arg-type]
    accounts.set_tenants(tenants, 1 << 30, 1 << 30)
    return SessionRegistry(accounts.budgets, accounts)


def test_the_registry_caps_each_tenants_connections():
    alpha = Tenant("alpha", b"salt-a", 1 << 20, max_connections=2)
    beta = Tenant("beta", b"salt-b", 1 << 20, max_connections=1)
    registry = registry_of(alpha, beta)
    first, second, third = Connection(alpha), Connection(alpha), Connection(alpha)
    for session in (first, second, third):
        registry.opened(session)
    registry.admit(first)
    registry.admit(second)
    with pytest.raises(NodeUnavailable):
        registry.admit(third)
    other = Connection(beta)
    registry.opened(other)
    registry.admit(other)  # another tenant's cap is its own
    assert registry.num_of(alpha) == 2 and len(registry) == 4
    registry.closed(first)
    registry.closed(third)
    third = Connection(alpha)
    registry.opened(third)
    registry.admit(third)  # a closed connection frees its place
    assert registry.num_of(alpha) == 2 and len(registry) == 3
    keyless = Connection()
    registry.opened(keyless)
    registry.admit(keyless)  # no tenant: not counted against any cap


def test_strangers_crowd_out_only_each_other():
    """Past the stranger pool's caps the oldest stranger (of that address, or of the address
    with the most) is closed; a member is never closed to make room, and the node's remote
    cap counts members only."""
    registry = registry_of(max_connections=32, max_strangers=4, max_strangers_per_address=2)
    member = Connection(peer="10.0.0.9")
    registry.opened(member)
    registry.admit(member)
    crowd = [Connection(peer=f"10.0.0.{1 + i % 3}") for i in range(12)]
    for stranger in crowd:
        registry.opened(stranger)
    assert registry.num_strangers == 4 and not member.closed
    assert sum(not s.closed for s in crowd) == 4
    assert all(s.closed for s in crowd[:6])  # the oldest went first
    survivor = next(s for s in crowd if not s.closed)
    registry.admit(survivor)
    evicted = crowd[0]
    with pytest.raises(NodeUnavailable):  # evicted: it cannot become a member
        registry.admit(evicted)
    local = Connection(peer="unix", is_local=True)
    registry.opened(local)  # the Unix socket's: a member from the start, never a stranger
    assert registry.num_strangers == 3


def test_a_flood_from_a_few_addresses_closes_its_own_strangers():
    """A client's handshake from its own address outlives any number of strangers from a
    few others: past the pool's cap, the address with the most loses its oldest."""
    registry = registry_of(max_connections=32, max_strangers=8, max_strangers_per_address=4)
    client = Connection(peer="10.9.9.9")
    registry.opened(client)
    for i in range(1000):
        registry.opened(Connection(peer=f"10.0.0.{i % 2}"))
    assert not client.closed and registry.num_strangers == 8
    registry.admit(client)


def test_the_remote_cap_keeps_the_local_slots():
    registry = registry_of(max_connections=32)  # 2 of them the Unix socket's
    for i in range(30):
        remote = Connection(peer=f"10.0.1.{i}")
        registry.opened(remote)
        registry.admit(remote)
    late = Connection(peer="10.0.2.1")
    registry.opened(late)
    with pytest.raises(NodeUnavailable, match="remote connections"):
        registry.admit(late)
    local = Connection(peer="unix", is_local=True)
    assert registry.can_open_local()
    registry.opened(local)
    registry.admit(local)


def test_idle_members_are_closed():
    registry = registry_of(idle_s=10.0)
    busy, idle, fresh = Connection(), Connection(is_idle_since=5.0), Connection(is_idle_since=95.0)
    for session in (busy, idle, fresh):
        registry.opened(session)
        registry.admit(session)
    assert registry.close_idle(100.0) == 1
    assert idle.closed and not busy.closed and not fresh.closed


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
    key = b"k" * 16
    traffic.published(CommitResult([], [key], 100), replicate=False)
    traffic.published(CommitResult([], [key], 100), replicate=True)
    traffic.sent(7)
    assert traffic.bytes_in == 200 and traffic.bytes_out == 7
    assert written == [[key]]


def test_a_parked_lookup_wakes_on_its_key_or_its_timeout():
    async def scenario() -> tuple[float, float]:
        changes = StoreChanges()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        loop.call_later(0.05, changes.notify, [b"other"])  # another key: not woken
        loop.call_later(0.1, changes.notify, [b"other", b"mine"])
        await changes.wait(b"mine", 5.0)
        woken = time.monotonic() - started
        started = time.monotonic()
        await changes.wait(b"mine", 0.05)  # nothing changes
        assert not len(changes)  # nobody is left parked
        return woken, time.monotonic() - started

    woken, timed_out = asyncio.run(scenario())
    assert 0.09 <= woken < 1.0
    assert 0.04 <= timed_out < 1.0


def test_the_identity_advertises_its_address():
    identity = NodeIdentity.of(NodeConfig(host="0.0.0.0", advertise_host="10.0.0.5"))
    identity.tcp_port = 7000
    assert identity.tcp_address == "10.0.0.5:7000"


def test_tenants_take_the_loops_turns_round_robin():
    """Requests that were waiting go on one per tenant a round: three of alpha's and one
    of beta's are served alpha, beta, alpha, alpha (not alpha's three first)."""

    async def scenario() -> list[str]:
        turns = Turns()
        served: list[str] = []

        async def request(account: bytes, name: str) -> None:
            await turns.take(account)
            served.append(name)

        alpha = [request(b"alpha", f"alpha-{i}") for i in range(3)]
        await asyncio.gather(*alpha, request(b"beta", "beta-0"))
        return served

    assert asyncio.run(scenario()) == ["alpha-0", "beta-0", "alpha-1", "alpha-2"]
