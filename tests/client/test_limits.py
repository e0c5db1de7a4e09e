"""The client reads the node's lease limits from the node: the node decides them."""

from __future__ import annotations

from kvpool.client.client import Client


def test_the_client_reads_the_limits_the_node_was_started_with(start_node):
    node = start_node(extra=["--pin-lease", "5", "--reserve-lease", "7"])
    with Client(node.unix_address, timeout=10) as client:
        limits = client.limits()
    assert (limits.pin_s, limits.reserve_s) == (5.0, 7.0)
    assert 0 < limits.default_hold_s <= limits.hold_s
