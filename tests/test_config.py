import pytest

from kvpool.config import (
    Address,
    ClientConfig,
    ClusterConfig,
    DiskConfig,
    EventsConfig,
    NodeConfig,
    ObjectStoreConfig,
    TLSConfig,
    client_config_from,
    node_config_from,
    parse_size,
)
from kvpool.errors import ConfigError
from kvpool.limits import Budgets, LeaseLimits


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("512m", 512 << 20),
        ("1.5g", 3 << 29),
        ("4096", 4096),
        ("64KiB", 65536),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "4XB", "-1G"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_addresses():
    assert Address.parse("unix:/run/x.sock") == Address("unix", path="/run/x.sock")
    assert Address.parse("unix:///run/x.sock") == Address("unix", path="/run/x.sock")
    assert Address.parse("tcp://10.0.0.1:9400") == Address("tcp", host="10.0.0.1", port=9400)
    assert Address.parse("node-a:9400") == Address("tcp", host="node-a", port=9400)
    with pytest.raises(ConfigError):
        Address.parse("nowhere")


def test_node_config_refuses_public_listen_without_key():
    with pytest.raises(ConfigError, match="access key"):
        NodeConfig(host="0.0.0.0").validate()
    NodeConfig(host="0.0.0.0", access_key="secret", tls=TLSConfig(insecure=True)).validate()
    with pytest.raises(ConfigError):
        NodeConfig(memory_bytes=10).validate()
    with pytest.raises(ConfigError):
        NodeConfig(low_watermark=0.99, high_watermark=0.5).validate()
    with pytest.raises(ConfigError):
        NodeConfig(name="../etc").validate()


def test_plaintext_only_on_loopback_unless_insecure():
    # Off loopback, a node needs TLS or an explicit --insecure, for the data port and the
    # admin HTTP alike; on loopback plaintext stays the default.
    NodeConfig().validate()
    with pytest.raises(ConfigError, match=r"in plaintext.*--tls-cert.*--insecure"):
        NodeConfig(host="10.1.2.3", access_key="secret").validate()
    with pytest.raises(ConfigError, match=r"admin HTTP on 0\.0\.0\.0 in plaintext"):
        NodeConfig(admin_host="0.0.0.0", access_key="secret").validate()
    NodeConfig(
        host="10.1.2.3", access_key="secret", tls=TLSConfig(cert="c.pem", key="k.pem")
    ).validate()
    NodeConfig(host="10.1.2.3", access_key="secret", tls=TLSConfig(insecure=True)).validate()
    with pytest.raises(ConfigError, match="both --tls-cert and --tls-key"):
        NodeConfig(tls=TLSConfig(cert="c.pem")).validate()
    with pytest.raises(ConfigError, match="mutual TLS"):
        NodeConfig(tls=TLSConfig(client_ca="ca.pem")).validate()
    with pytest.raises(ConfigError, match="tenants file"):
        NodeConfig(tenants_path="t.toml", access_key="secret").validate()


def test_environment_then_overrides():
    env = {
        "KVPOOL_ADDRESS": "h:1",
        "KVPOOL_TIMEOUT": "0.5",
        "KVPOOL_READ_LOCAL_ONLY": "yes",
        "KVPOOL_PEERS": "a:1, b:2",
    }
    config = client_config_from({"timeout": 3.0}, env)
    assert config.address == "h:1" and config.timeout_s == 3.0 and config.read_local_only
    assert config.peers == ("a:1", "b:2")
    with pytest.raises(ConfigError):
        client_config_from({"nonsense": 1}, {})
    with pytest.raises(ConfigError):
        client_config_from(None, {"KVPOOL_TIMEOUT": "soon"})
    with pytest.raises(ConfigError):
        client_config_from(None, {"KVPOOL_USE_SHM": "maybe"})
    node = node_config_from(
        {"port": None, "name": "x"}, {"KVPOOL_MEMORY": "2GiB", "KVPOOL_PORT": "1234"}
    )
    assert node.memory_bytes == 2 << 30 and node.port == 1234 and node.name == "x"
    assert ClientConfig().validate().timeout_s > 0


def test_copy_threads_come_from_the_environment_and_are_bounded():
    assert client_config_from(None, {"KVPOOL_COPY_THREADS": "3"}).copy_threads == 3
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="copy_threads"):
            client_config_from(None, {"KVPOOL_COPY_THREADS": bad})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (DiskConfig(path="/mnt/nvme"), "needs both --disk PATH and --disk-size"),
        (DiskConfig(path="/mnt/nvme", capacity=-1), "must be positive"),
        (ObjectStoreConfig(url="gs://bucket"), "s3://"),
        (ObjectStoreConfig(url="s3://b", capacity=0), "--object-store-size"),
        (ObjectStoreConfig(refresh_s=0.01), "refresh"),
        (ObjectStoreConfig(read_timeout_s=0), "--object-read-timeout"),
        (EventsConfig(endpoint="tcp://*:1", encoding="json"), "map or array"),
        (EventsConfig(replay_endpoint="tcp://*:2"), "needs --kv-events"),
        (ClusterConfig(replicas=0), "--replicas"),
        (ClusterConfig(etcd="http://e:2379", etcd_ttl_s=0), "--etcd-ttl"),
        (TLSConfig(key="k.pem"), "both --tls-cert and --tls-key"),
        (TLSConfig(client_ca="ca.pem"), "mutual TLS"),
    ],
)
def test_each_section_refuses_what_concerns_it(section, message):
    with pytest.raises(ConfigError, match=message):
        section.validate()
    # ... and the node's configuration refuses it through that section.
    name = {
        DiskConfig: "disk",
        ObjectStoreConfig: "objects",
        EventsConfig: "events",
        ClusterConfig: "cluster",
        TLSConfig: "tls",
    }[type(section)]
    with pytest.raises(ConfigError, match=message):
        NodeConfig(**{name: section}).validate()


def test_sections_default_to_off_and_valid():
    config = NodeConfig().validate()
    assert not config.disk.path and not config.objects.url and not config.events.endpoint
    assert not config.cluster.is_clustered and not config.tls.cert
    for section in (DiskConfig(), ObjectStoreConfig(), EventsConfig(), ClusterConfig()):
        assert section.validate() is section


def test_what_concerns_two_sections_is_checked_by_the_node():
    objects = ObjectStoreConfig(url="s3://bucket/pool")
    objects.validate()  # fine alone
    with pytest.raises(ConfigError, match="needs --disk"):
        NodeConfig(objects=objects).validate()
    NodeConfig(objects=objects, disk=DiskConfig("/mnt/nvme", 64 << 20)).validate()
    with pytest.raises(ConfigError, match="in plaintext"):
        NodeConfig(host="10.1.2.3", access_key="secret", tls=TLSConfig(ca="ca.pem")).validate()
    with pytest.raises(ConfigError, match="lease durations"):
        NodeConfig(leases=LeaseLimits(pin_s=0.1)).validate()


def test_node_overrides_by_their_old_names_land_in_their_sections():
    config = node_config_from(
        {"disk_path": "/mnt/nvme", "disk_bytes": "64MiB", "kv_events": "tcp://127.0.0.1:5557"}, {}
    )
    assert config.disk == DiskConfig("/mnt/nvme", 64 << 20)
    assert config.events.endpoint == "tcp://127.0.0.1:5557"
    with pytest.raises(ConfigError, match="unknown node option"):
        node_config_from({"disk": "/mnt/nvme"}, {})


def test_budgets_come_from_their_settings_and_are_checked():
    config = node_config_from(
        {"max_strangers": "8", "max_strangers_per_address": "2", "tenant_buffer_bytes": "16MiB"},
        {"KVPOOL_TENANT_PARKED_KEYS": "100", "KVPOOL_IDLE_TIMEOUT": "3"},
    )
    assert config.budgets == Budgets(
        max_strangers=8,
        max_strangers_per_address=2,
        buffer_bytes=16 << 20,
        parked_keys=100,
        idle_s=3.0,
    )
    with pytest.raises(ConfigError, match="--max-strangers-per-address"):
        NodeConfig(budgets=Budgets(max_strangers=4, max_strangers_per_address=8)).validate()
    with pytest.raises(ConfigError, match="--tenant-buffer-bytes"):
        NodeConfig(budgets=Budgets(buffer_bytes=1 << 20)).validate()
    assert Budgets().local_reserved == 256  # of 4,096: the Unix socket's


def test_eviction_names_one_of_the_stores_policies():
    from kvpool.config import EVICTION_POLICIES
    from kvpool.store.policies import NAME_TO_POLICY

    assert set(EVICTION_POLICIES) == set(NAME_TO_POLICY)
    assert node_config_from({"eviction": "learned"}, environ={}).eviction == "learned"
    assert node_config_from({}, environ={"KVPOOL_EVICTION": "lru"}).eviction == "lru"
    with pytest.raises(ConfigError, match="--eviction"):
        node_config_from({"eviction": "random"}, environ={})


def test_the_placeholder_key_of_an_example_manifest_refuses_to_start(run_dir) -> None:
    """A node given the examples' placeholder key (``change-me``) does not start: the
    message names the variable and the chart's value to set."""
    from tests.commands import said, serve

    refused = serve(run_dir, "--host", "0.0.0.0", env={"KVPOOL_ACCESS_KEY": "change-me"})
    assert refused.returncode == 2
    message = said(refused)
    assert "placeholder" in message and "KVPOOL_ACCESS_KEY" in message, message
    assert "accessKey" in message and "kvpool-access" in message, message
