"""ConnectorSettings: extra-config keys beat KVTIER_* variables, which beat defaults; every
store setting is reachable through the connector."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.settings import StoreSettings
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config

# A non-default value for every store setting, valid together.
STORE_VALUES: dict[str, Any] = {
    "l1_bytes": 1 << 20,
    "l2_path": "/mnt/kv",
    "l2_url": None,
    "l2_profile": "juicefs",
    "l2_capacity_bytes": 1 << 30,
    "l2_high_watermark": 0.8,
    "l2_low_watermark": 0.5,
    "l2_janitor_interval_s": 2.5,
    "l2_touch_interval_s": 30.0,
    "l2_exists_ttl_s": 0.25,
    "admission": "min-tokens",
    "admission_min_tokens": 512,
    "write_queue_blocks": 8,
    "io_threads": 3,
    "l2_username": "kvtier",
    "l2_password_file": "/run/secrets/valkey",
    "l2_tls_ca_file": "/etc/ssl/valkey-ca.pem",
    "l2_file_mode": 0o640,
    "l2_direct_reads": False,
}
TEXT = {"l2_file_mode": "0o640"}
"""Spellings in a document or the environment where the value itself is not one (permissions
are octal strings)."""


def test_the_table_covers_every_store_setting() -> None:
    assert set(STORE_VALUES) == set(StoreSettings.model_fields)


def test_defaults_without_extra_config_or_environment() -> None:
    assert ConnectorSettings.from_sources(None, {}) == ConnectorSettings()
    assert ConnectorSettings().block_tokens is None  # the engine's block size


@pytest.mark.parametrize("name", sorted(StoreSettings.model_fields))
def test_every_store_setting_is_reachable_through_the_extra_config(name: str) -> None:
    value = STORE_VALUES[name]
    extra = (
        {"l2_path": "/mnt/kv", name: TEXT.get(name, value)}
        if name != "l2_url"
        else {"l2_url": "redis://127.0.0.1:6379/0"}
    )
    connector = ConnectorSettings.from_sources(extra, {})
    expected = value if name != "l2_url" else "redis://127.0.0.1:6379/0"
    assert getattr(connector.store_settings(), name) == expected


@pytest.mark.parametrize("name", sorted(StoreSettings.model_fields))
def test_every_store_setting_is_reachable_through_the_environment(name: str) -> None:
    value = STORE_VALUES[name] if name != "l2_url" else "redis://127.0.0.1:6379/0"
    environ = {f"KVTIER_{name.upper()}": TEXT.get(name, str(value))}
    if name not in ("l2_path", "l2_url"):
        environ["KVTIER_L2_PATH"] = "/mnt/kv"
    connector = ConnectorSettings.from_sources({}, environ)
    assert getattr(connector.store_settings(), name) == value


def test_environment_fills_what_the_extra_config_leaves_out() -> None:
    config = ConnectorSettings.from_sources(
        {"l2_path": "/mnt/kv", "block_tokens": 512},
        {
            "KVTIER_L2_PATH": "/ignored",
            "KVTIER_L1_BYTES": "1GiB",
            "KVTIER_EVENTS_ENDPOINT": "tcp://127.0.0.1:5601",
            "KVTIER_LOOKUP_TTL_S": "0.5",
            "KVTIER_LOAD_ASYNC": "true",
        },
    )
    assert config.l2_path == "/mnt/kv"
    assert config.block_tokens == 512
    assert config.l1_bytes == 1024**3
    assert config.events_endpoint == "tcp://127.0.0.1:5601"
    assert config.lookup_ttl_s == 0.5
    assert config.load_async is True


def test_unknown_key_is_rejected_by_name_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"l2_pth: unknown setting \(known: .*l2_path"):
        ConnectorSettings.from_sources({"l2_pth": "/mnt/kv"}, {})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"l1_bytes": -1}, "l1_bytes"),
        ({"l1_bytes": "lots"}, "l1_bytes"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"block_tokens": "many"}, "block_tokens"),
        ({"events_endpoint": "127.0.0.1:5601"}, "events_endpoint"),
        ({"io_threads": 0}, "io_threads"),
        ({"load_threads": 0}, "load_threads"),
        ({"l2_low_watermark": 0.95, "l2_path": "/x"}, "l2_low_watermark"),
        ({"admission": "sometimes"}, "admission"),
    ],
)
def test_invalid_values_name_their_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        ConnectorSettings.from_sources(extra, {})


def test_invalid_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="^KVTIER_L1_BYTES: cannot read 'lots'"):
        ConnectorSettings.from_sources({}, {"KVTIER_L1_BYTES": "lots"})


def test_transfer_config_loads_the_connector_and_recomputes_failed_loads() -> None:
    config = ConnectorSettings(l2_path="/mnt/kv", l1_bytes="1KiB")
    transfer = kv_transfer_config(config)
    assert transfer == {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l1_bytes": 1024, "l2_path": "/mnt/kv"},
    }
    assert ConnectorSettings.from_sources(transfer["kv_connector_extra_config"], {}) == config


@pytest.mark.parametrize("spelling", ["0o640", "640", "0640"])
def test_file_permissions_are_read_as_octal_strings(spelling: str) -> None:
    assert ConnectorSettings.from_sources({"l2_file_mode": spelling}, {}).l2_file_mode == 0o640


@pytest.mark.parametrize("value", [400, 416, 400.0])
def test_a_number_for_file_permissions_in_the_extra_config_is_refused(value: object) -> None:
    """JSON and YAML read 400 as decimal (0o620): the mode must be written as a string."""
    with pytest.raises(ConfigError, match=r'^l2_file_mode: .*octal string such as "0o640"'):
        ConnectorSettings.from_sources({"l2_file_mode": value}, {})


def test_file_permissions_given_in_python_may_be_an_int() -> None:
    config = ConnectorSettings(l2_path="/mnt/kv", l2_file_mode=0o640)
    assert config.l2_file_mode == 0o640
    assert config.store_settings().l2_file_mode == 0o640
    assert config.replaced(l1_bytes=0).l2_file_mode == 0o640


def test_file_permissions_survive_the_trip_to_a_replica_as_octal() -> None:
    config = ConnectorSettings(l2_path="/mnt/kv", l2_file_mode=0o640)
    extra = json.loads(json.dumps(kv_transfer_config(config)))["kv_connector_extra_config"]
    assert extra["l2_file_mode"] == "0o640"
    assert ConnectorSettings.from_sources(extra, {}) == config


def test_background_cpus_take_a_cpu_list_or_inherit() -> None:
    assert ConnectorSettings(background_cpus="0,2-3").background_cpus == "0,2-3"
    assert ConnectorSettings(background_cpus="inherit").background_cpus == "inherit"
    for bad in ("", "a", "1-", "0,,1"):
        with pytest.raises(ConfigError, match="background_cpus"):
            ConnectorSettings(background_cpus=bad)


def test_a_setting_given_explicitly_wins_over_the_environment_even_at_its_default() -> None:
    """A replica inherits its launcher's environment: a `KVTIER_*` variable there must not
    replace what the flags or the deployment file set, defaults included."""
    given = ConnectorSettings.from_mapping({"l1_bytes": "2GiB", "load_async": False})
    extra = kv_transfer_config(given)["kv_connector_extra_config"]
    env = {"KVTIER_L1_BYTES": "8GiB", "KVTIER_LOAD_ASYNC": "true", "KVTIER_ADMISSION": "reused"}
    replica = ConnectorSettings.from_sources(extra, env)
    assert (replica.l1_bytes, replica.load_async) == (2 * 1024**3, False)
    assert replica.admission == "reused"  # not given: the environment still applies


@pytest.mark.parametrize(
    ("given", "named"),
    [
        # a pod on an IPv6 cluster names itself by http://$(POD_IP):8000 (deploy/k8s)
        ("http://fd00::7:8000", "http://[fd00::7]:8000"),
        ("http://[fd00::7]:8000", "http://[fd00::7]:8000"),
        ("http://fd00::7:8000/", "http://[fd00::7]:8000/"),
        ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
        ("host-1:4242", "host-1:4242"),
    ],
)
def test_a_replica_id_names_an_ipv6_host_as_the_router_does(given: str, named: str) -> None:
    """The router names a discovered replica http://[ADDRESS]:PORT (kvtier.router.discovery):
    an unbracketed IPv6 host would make the replica's events come from an unknown replica."""
    settings = ConnectorSettings.from_sources({}, {"KVTIER_REPLICA_ID": given})
    assert settings.replica_id == named
