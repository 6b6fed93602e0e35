from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import load_spec, parse_spec

HYPERPOD_STYLE = """
model: null
replicas: 3
intelligentRoutingSpec:
  enabled: true
  routingStrategy: prefixaware
kvCacheSpec:
  enableL1Cache: true
  l1CacheSizeGiB: 1.5
  enableL2Cache: true
  l2CacheSpec:
    l2CacheBackend: redis
    l2CacheLocalUrl: redis://127.0.0.1:6390
kvtier:
  routerPort: 9000
  replicaBasePort: 9100
  connector:
    block_tokens: 256
    l2_exists_ttl_s: 0.5
  router:
    health_interval_s: 0.25
"""


def test_hyperpod_keys_map_one_to_one(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(HYPERPOD_STYLE)
    spec = load_spec(path)
    assert spec.replicas == 3
    assert spec.strategy == "prefixaware"
    assert spec.cache.l1_enabled and spec.cache.l1_gib == 1.5
    assert spec.cache.l2.kind == "valkey"  # redis and valkey share one backend
    assert spec.cache.l2.url == "redis://127.0.0.1:6390"
    assert (spec.local.router_port, spec.local.replica_base_port) == (9000, 9100)
    assert spec.local.router == {"health_interval_s": 0.25}
    connector = spec.connector_settings(
        replica_id="r0", events_endpoint="tcp://127.0.0.1:1", l2_location="redis://127.0.0.1:6390"
    )
    assert connector is not None
    assert (
        connector.l1_bytes,
        connector.l2_url,
        connector.block_tokens,
        connector.l2_exists_ttl_s,
    ) == (int(1.5 * 1024**3), "redis://127.0.0.1:6390", 256, 0.5)


def test_defaults_without_a_file() -> None:
    spec = load_spec(None)
    assert (spec.replicas, spec.strategy, spec.cache.l2.kind) == (2, "kvaware", "posix")


def test_logs_are_bounded_to_64_mib_by_default_and_0_means_unbounded() -> None:
    assert load_spec(None).local.log_max_mib == 64
    assert parse_spec({"kvtier": {"logMaxMiB": 0}}).local.log_max_mib == 0


def test_disabled_intelligent_routing_means_round_robin() -> None:
    spec = parse_spec({"intelligentRoutingSpec": {"enabled": False, "routingStrategy": "kvaware"}})
    assert spec.strategy == "roundrobin"


def test_tieredstorage_is_the_posix_backend() -> None:
    spec = parse_spec({"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "TieredStorage"}}})
    assert spec.cache.l2.kind == "posix"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"replicas": 0}, "replicas: input should be greater than 0"),
        ({"replicas": "2"}, "replicas: input should be a valid integer, got '2'"),
        (
            {"intelligentRoutingSpec": {"routingStrategy": "fastest"}},
            "intelligentRoutingSpec.routingStrategy: input should be 'prefixaware', ",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "s3"}}},
            "kvCacheSpec.l2CacheSpec.l2CacheBackend: .*got 's3'",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheLocalUrl": "http://x"}}},
            "kvCacheSpec.l2CacheSpec.l2CacheLocalUrl: 'http://x' is not a redis://",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CachePersistent": True}}},
            "kvCacheSpec.l2CacheSpec.l2CachePersistent: only for the valkey backend; a posix L2",
        ),
        (
            {
                "kvCacheSpec": {
                    "l2CacheSpec": {
                        "l2CacheBackend": "valkey",
                        "l2CacheLocalUrl": "redis://cache:6379",
                        "l2CachePersistent": True,
                    }
                }
            },
            "kvCacheSpec.l2CacheSpec.l2CachePersistent: kvtier starts no Valkey server",
        ),
        (
            {"kvCacheSpec": {"enableL1cache": True}},
            "kvCacheSpec.enableL1cache: unknown setting (known: enableL1Cache, ",
        ),
        (
            {"kvCacheSpec": {"l1CacheSizeGiB": True}},
            "kvCacheSpec.l1CacheSizeGiB: input should be a valid number, got True",
        ),
        (
            {"kvtier": {"routerPort": 80}},
            "kvtier.routerPort: input should be greater than or equal",
        ),
        ({"kvtier": {"routerPort": 8101}}, "kvtier.routerPort: collides"),
        (
            {"kvtier": {"logMaxMiB": -1}},
            "kvtier.logMaxMiB: input should be greater than or equal to 0, got -1",
        ),
        (
            {"kvtier": {"connector": {"block_tokens": 0}}},
            "kvtier.connector.block_tokens: input should be greater than 0",
        ),
        (
            {"kvtier": {"connector": {"l2_path": "/x"}}},
            "kvtier.connector.l2_path: set by kvCacheSpec.l2CacheSpec",
        ),
        (
            {"kvtier": {"connector": {"l2_file_mode": 400}}},
            "kvtier.connector.l2_file_mode: 400 would read as decimal",
        ),
        ({"kvtier": {"router": {"max_blocks": "x"}}}, "kvtier.router.max_blocks: input should be"),
        ({"kvtier": {"router": {"replicas": []}}}, "kvtier.router.replicas: set by replicas"),
        (["a list"], "document: must be a mapping"),
    ],
)
def test_invalid_configs_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        parse_spec(data)


def test_a_quoted_or_0o_file_mode_in_yaml_is_octal(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("kvtier:\n  connector:\n    l2_file_mode: 0o640\n")
    assert load_spec(path).local.connector == {"l2_file_mode": "0o640"}  # a string to PyYAML
    path.write_text('kvtier:\n  connector:\n    l2_file_mode: "640"\n')
    connector = load_spec(path).connector_settings(
        replica_id="r0", events_endpoint="tcp://127.0.0.1:1", l2_location=None
    )
    assert connector is not None and connector.l2_file_mode == 0o640


def test_unreadable_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    bad.write_bytes(b"\xc3\x28 binary")
    with pytest.raises(ConfigError, match="bad.yaml: not a text file"):
        load_spec(bad)
