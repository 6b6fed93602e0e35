"""ConnectorConfig: extra-config keys beat KVTIER_* variables, which beat defaults."""

from __future__ import annotations

import pytest

from kvtier.core.errors import ConfigError
from kvtier.vllm.settings import ConnectorConfig, kv_transfer_config


def test_defaults_without_extra_config_or_environment() -> None:
    assert ConnectorConfig.from_sources(None, {}) == ConnectorConfig()
    assert ConnectorConfig().block_tokens == 128


def test_environment_fills_what_the_extra_config_leaves_out() -> None:
    config = ConnectorConfig.from_sources(
        {"l2_path": "/mnt/kv", "block_tokens": 512},
        {"KVTIER_L2_PATH": "/ignored", "KVTIER_L1_BYTES": "1048576",
         "KVTIER_EVENTS_ENDPOINT": "tcp://127.0.0.1:5601", "KVTIER_LOOKUP_TTL_S": "0.5"})
    assert config.l2_path == "/mnt/kv"
    assert config.block_tokens == 512
    assert config.l1_bytes == 1048576
    assert config.events_endpoint == "tcp://127.0.0.1:5601"
    assert config.lookup_ttl_s == 0.5


def test_unknown_key_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match="l2_pth"):
        ConnectorConfig.from_sources({"l2_pth": "/mnt/kv"}, {})


@pytest.mark.parametrize(("extra", "field"), [
    ({"l1_bytes": -1}, "l1_bytes"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"block_tokens": "many"}, "block_tokens"),
    ({"events_endpoint": "127.0.0.1:5601"}, "events_endpoint"),
    ({"io_threads": 0}, "io_threads"),
    ({"load_threads": 0}, "load_threads"),
])
def test_invalid_values_name_their_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ConnectorConfig.from_sources(extra, {})


def test_invalid_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVTIER_L1_BYTES"):
        ConnectorConfig.from_sources({}, {"KVTIER_L1_BYTES": "2GiB"})


def test_transfer_config_loads_the_connector_and_recomputes_failed_loads() -> None:
    config = ConnectorConfig(l2_path="/mnt/kv", l1_bytes=1024)
    transfer = kv_transfer_config(config)
    assert transfer == {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l1_bytes": 1024, "l2_path": "/mnt/kv"},
    }
    assert ConnectorConfig.from_sources(transfer["kv_connector_extra_config"], {}) == config
