"""Every setting of the node reaches its configuration from its command-line flag and from
its environment variable, parsed the same way; `kvpool serve --help` lists every flag."""

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvpool.cli.main import ROUTER_SETTINGS, SERVE_SETTINGS
from kvpool.cli.options import given, with_settings
from kvpool.config import NODE_ENV, NodeConfig, node_config_from, node_settings
from kvpool.errors import ConfigError

MiB = 1 << 20

# An access key file as an operator keeps one: readable by its owner only.
KEY_FILE = Path(tempfile.mkdtemp()) / "access-key"
KEY_FILE.write_text("a-key-from-a-file\n")
KEY_FILE.chmod(0o600)

# For each setting (by key): the text an operator gives, and the value the field then holds.
SAMPLES: dict[str, tuple[str, object]] = {
    "name": ("node-7", "node-7"),
    "run_dir": ("/tmp/kv", "/tmp/kv"),
    "host_id": ("host-a", "host-a"),
    "fresh": ("true", True),
    "memory_bytes": ("3MiB", 3 * MiB),
    "hugepages": ("true", True),
    "high_watermark": ("0.97", 0.97),
    "low_watermark": ("0.5", 0.5),
    "scrub_bytes_s": ("2MiB", 2 * MiB),
    "host": ("127.0.0.2", "127.0.0.2"),
    "port": ("9500", 9500),
    "advertise_host": ("node-7.local", "node-7.local"),
    "admin_host": ("127.0.0.3", "127.0.0.3"),
    "admin_port": ("9501", 9501),
    "access_id": ("pool", "pool"),
    "access_key": ("secret", "secret"),
    "access_key_file": (str(KEY_FILE), str(KEY_FILE)),
    "tenants_path": ("/etc/kvpool/tenants.toml", "/etc/kvpool/tenants.toml"),
    "pin_lease_s": ("12.5", 12.5),
    "reserve_lease_s": ("40", 40.0),
    "tls_cert": ("c.pem", "c.pem"),
    "tls_key": ("k.pem", "k.pem"),
    "tls_client_ca": ("client-ca.pem", "client-ca.pem"),
    "tls_ca": ("ca.pem", "ca.pem"),
    "tls_server_name": ("kvpool-node", "kvpool-node"),
    "kthena_insecure": ("1", True),
    "insecure": ("true", True),
    "disk_path": ("/mnt/nvme", "/mnt/nvme"),
    "disk_bytes": ("64MiB", 64 * MiB),
    "object_store": ("s3://bucket/pool", "s3://bucket/pool"),
    "object_store_bytes": ("1GiB", 1 << 30),
    "object_store_endpoint": ("http://s3.local:7480", "http://s3.local:7480"),
    "object_store_region": ("eu-west-1", "eu-west-1"),
    "object_refresh_s": ("5", 5.0),
    "object_read_timeout_s": ("0.5", 0.5),
    "kv_events": ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
    "kv_events_replay": ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5558"),
    "kv_events_topic": ("kv@pod@model", "kv@pod@model"),
    "kv_events_encoding": ("array", "array"),
    "kv_events_token_ids": ("true", True),
    "kv_events_curve_key": ("events.key_secret", "events.key_secret"),
    "kv_events_clients": ("events-clients.toml", "events-clients.toml"),
    "kthena_redis": ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    "kthena_block_size": ("32", 32),
    "peers": ("a:1, b:2", ("a:1", "b:2")),
    "etcd": ("http://127.0.0.1:2379", "http://127.0.0.1:2379"),
    "etcd_prefix": ("/pool/", "/pool/"),
    "etcd_ttl_s": ("9", 9),
    "replicas": ("2", 2),
    "max_connections": ("512", 512),
    "max_strangers": ("128", 128),
    "max_strangers_per_address": ("16", 16),
    "handshake_s": ("1.5", 1.5),
    "idle_s": ("60", 60.0),
    "tenant_buffer_bytes": ("32MiB", 32 * MiB),
    "tenant_parked_keys": ("1000", 1000),
    "tenant_label_rate": ("0.5", 0.5),
    "eviction": ("learned", "learned"),
}

# What a setting needs beside it to make a valid configuration.
COMPANIONS: dict[str, tuple[str, ...]] = {
    "disk_path": ("disk_bytes",),
    "disk_bytes": ("disk_path",),
    "object_store": ("disk_path", "disk_bytes"),
    "tls_cert": ("tls_key",),
    "tls_key": ("tls_cert",),
    "tls_client_ca": ("tls_cert", "tls_key"),
    "kv_events_replay": ("kv_events",),
    "kv_events_curve_key": ("kv_events_clients",),
    "kv_events_clients": ("kv_events_curve_key",),
}

SETTINGS = {setting.key: (section, name, setting) for section, name, setting in node_settings()}


def field_of(config: NodeConfig, key: str) -> object:
    section, name, _ = SETTINGS[key]
    return getattr(getattr(config, section) if section else config, name)


def test_every_setting_has_a_sample_flag_variable_and_help():
    assert set(SAMPLES) == set(SETTINGS)
    flags = [s.flag for _, _, s in SETTINGS.values()]
    assert len(set(flags)) == len(flags) and len(NODE_ENV) == len(flags)
    assert all(var.startswith("KVPOOL_") for var in NODE_ENV)
    assert all(s.help for _, _, s in SETTINGS.values())


def test_the_existing_variable_names_still_work():
    old = {
        "KVPOOL_NODE_NAME", "KVPOOL_RUN_DIR", "KVPOOL_MEMORY", "KVPOOL_HOST", "KVPOOL_PORT",
        "KVPOOL_ADVERTISE_HOST", "KVPOOL_ADMIN_HOST", "KVPOOL_ADMIN_PORT", "KVPOOL_ACCESS_ID",
        "KVPOOL_ACCESS_KEY", "KVPOOL_HOST_ID", "KVPOOL_PEERS", "KVPOOL_ETCD",
        "KVPOOL_ETCD_PREFIX", "KVPOOL_REPLICAS", "KVPOOL_FRESH", "KVPOOL_DISK",
        "KVPOOL_DISK_SIZE", "KVPOOL_SCRUB_RATE", "KVPOOL_KV_EVENTS", "KVPOOL_KV_EVENTS_REPLAY",
        "KVPOOL_KV_EVENTS_TOPIC", "KVPOOL_KV_EVENTS_ENCODING", "KVPOOL_OBJECT_STORE",
        "KVPOOL_OBJECT_STORE_ENDPOINT", "KVPOOL_OBJECT_STORE_REGION", "KVPOOL_OBJECT_STORE_SIZE",
        "KVPOOL_TENANTS", "KVPOOL_TLS_CERT", "KVPOOL_TLS_KEY", "KVPOOL_TLS_CLIENT_CA",
        "KVPOOL_TLS_CA", "KVPOOL_INSECURE", "KVPOOL_PIN_LEASE", "KVPOOL_RESERVE_LEASE",
    }  # fmt: skip
    assert old <= set(NODE_ENV)


def serve_app(configs: list[NodeConfig]) -> typer.Typer:
    """`kvpool serve`'s options on a command that keeps the configuration it would run."""
    app = typer.Typer()

    @app.command()
    @with_settings(SERVE_SETTINGS)
    def serve(**values: object) -> None:
        configs.append(node_config_from(given(SERVE_SETTINGS, values), environ={}))

    return app


def arguments(key: str) -> list[str]:
    args = []
    for each in (key, *COMPANIONS.get(key, ())):
        setting = SETTINGS[each][2]
        text = SAMPLES[each][0]
        args += [setting.flag] if setting.is_switch else [setting.flag, text]
    return args


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_each_flag_sets_its_field(key):
    configs: list[NodeConfig] = []
    result = CliRunner().invoke(serve_app(configs), arguments(key))
    assert result.exit_code == 0, result.output
    (config,) = configs
    assert field_of(config, key) == SAMPLES[key][1]


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_each_variable_sets_its_field(key):
    environ = {
        SETTINGS[each][2].env_var: SAMPLES[each][0] for each in (key, *COMPANIONS.get(key, ()))
    }
    assert field_of(node_config_from(None, environ), key) == SAMPLES[key][1]


def test_a_flag_wins_over_its_variable_and_a_left_out_one_does_not_hide_it():
    configs: list[NodeConfig] = []
    app = serve_app(configs)
    assert CliRunner().invoke(app, ["--port", "9600"]).exit_code == 0
    assert configs[-1].port == 9600
    environ = {"KVPOOL_PORT": "9700", "KVPOOL_FRESH": "1"}
    config = node_config_from(given(SERVE_SETTINGS, {"port": "9600", "fresh": False}), environ)
    assert config.port == 9600 and config.fresh  # --fresh left off: the variable holds


def test_text_a_flag_cannot_parse_is_a_config_error():
    with pytest.raises(ConfigError, match="--port"):
        given(SERVE_SETTINGS, {"port": "many"})
    with pytest.raises(ConfigError, match="not a size"):
        node_config_from(None, {"KVPOOL_MEMORY": "lots"})


def test_router_options_are_parsed_by_their_settings():
    values = {"port": "8100", "prefetch_hold": "2.5", "insecure": True, "model": None}
    assert given(ROUTER_SETTINGS, values) == {"port": 8100, "prefetch_hold": 2.5, "insecure": True}


def help_text(command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "400", "TERM": "dumb", **_path_env()},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_serve_and_router_help_list_every_flag_with_its_help():
    text = help_text("serve")
    for _, _, setting in SETTINGS.values():
        assert setting.flag in text and setting.help in text
    assert "Log level." in text  # the command's own options keep their help too
    text = help_text("router")
    for setting in ROUTER_SETTINGS:
        assert setting.flag in text and setting.help in text
    assert "A TOML or JSON file of router settings." in text


def _path_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME")}
