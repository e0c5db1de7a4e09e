import pytest

from kvpool import AuthenticationError, Client


@pytest.fixture
def secured(start_node):
    return start_node(
        name="secure", extra=["--access-id", "engine"], env={"KVPOOL_ACCESS_KEY": "s3cret"}
    )


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_right_key_is_accepted_and_wrong_key_refused(secured, via):
    address = secured.unix_address if via == "unix" else secured.tcp_address
    with Client(address, access_id="engine", access_key="s3cret") as good:
        assert good.put([b"k" * 20], [b"v"]).all_stored
    for access_id, access_key in (("engine", "wrong"), ("other", "s3cret"), ("engine", "")):
        with (
            Client(address, access_id=access_id, access_key=access_key) as bad,
            pytest.raises(AuthenticationError),
        ):
            bad.lookup([b"k" * 20])
    with Client(address, access_id="engine", access_key="s3cret") as good:  # still serving
        assert good.lookup([b"k" * 20]) == 1


def test_a_client_refuses_a_node_that_cannot_prove_the_key(node):
    # The node has no key configured: a client that expects one must not trust it.
    with Client(node.tcp_address, access_key="expected") as c, pytest.raises(AuthenticationError):
        c.lookup([b"k" * 20])
