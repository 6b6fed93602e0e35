from pathlib import Path

import pytest

from kvtier.tools.cluster.spec import load_spec, parse_spec
from kvtier.core.errors import ConfigError

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
"""


def test_hyperpod_keys_map_one_to_one(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(HYPERPOD_STYLE)
    spec = load_spec(path)
    assert spec.replicas == 3
    assert spec.strategy == "prefixaware"
    assert spec.cache.l1_enabled and spec.cache.l1_gib == 1.5
    assert spec.cache.l2_backend == "valkey"  # redis and valkey share one backend
    assert spec.cache.l2_url == "redis://127.0.0.1:6390"
    assert (spec.router_port, spec.replica_base_port) == (9000, 9100)


def test_defaults_without_a_file() -> None:
    spec = load_spec(None)
    assert (spec.replicas, spec.strategy, spec.cache.l2_backend) == (2, "kvaware", "posix")


def test_disabled_intelligent_routing_means_round_robin() -> None:
    spec = parse_spec({"intelligentRoutingSpec": {"enabled": False, "routingStrategy": "kvaware"}})
    assert spec.strategy == "roundrobin"


def test_tieredstorage_is_the_posix_backend() -> None:
    spec = parse_spec({"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "TieredStorage"}}})
    assert spec.cache.l2_backend == "posix"


@pytest.mark.parametrize(("data", "message"), [
    ({"replicas": 0}, "replicas: must be positive"),
    ({"replicas": "2"}, "replicas: expected int"),
    ({"intelligentRoutingSpec": {"routingStrategy": "fastest"}},
     "intelligentRoutingSpec.routingStrategy: 'fastest' is not one of"),
    ({"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "s3"}}},
     "kvCacheSpec.l2CacheSpec.l2CacheBackend: 's3'"),
    ({"kvCacheSpec": {"l2CacheSpec": {"l2CacheLocalUrl": "http://x"}}},
     "kvCacheSpec.l2CacheSpec.l2CacheLocalUrl"),
    ({"kvCacheSpec": {"enableL1cache": True}}, "kvCacheSpec.enableL1cache: unknown key"),
    ({"kvCacheSpec": {"l1CacheSizeGiB": True}}, "kvCacheSpec.l1CacheSizeGiB: expected a number"),
    ({"kvtier": {"routerPort": 80}}, "kvtier.routerPort: must be a port"),
    ({"kvtier": {"routerPort": 8101}}, "kvtier.routerPort: collides"),
    ({"kvtier": {"blockTokens": 100}}, "kvtier.blockTokens: must be a multiple of 16"),
    (["a list"], "document: must be a mapping"),
])
def test_invalid_configs_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_spec(data)


def test_unreadable_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
