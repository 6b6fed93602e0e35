"""Router settings, the replicas file and the `kvtier router` flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.core.errors import ConfigError
from kvtier.router.cli import config_from_args
from kvtier.router.settings import ReplicaConfig, RouterConfig, load_replicas_file


def test_replicas_file_accepts_urls_and_objects_in_yaml_or_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text("replicas:\n  - http://127.0.0.1:8001/\n"
                         "  - {url: 'http://127.0.0.1:8002', name: b, vllm_events: 'ipc:///x'}\n")
    json_file = tmp_path / "r.json"
    json_file.write_text('["http://127.0.0.1:8001"]')
    assert load_replicas_file(yaml_file) == (
        ReplicaConfig("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
        ReplicaConfig("http://127.0.0.1:8002", "b", "ipc:///x"))
    assert load_replicas_file(json_file) == (ReplicaConfig("http://127.0.0.1:8001"),)


@pytest.mark.parametrize(("text", "match"), [
    ("[]", "no list"),
    ("- ftp://x\n", "http"),
    ("- {url: 'http://a:1', colour: red}\n", "colour"),
    ("- 5\n", "entry 0"),
    ("{oops", "cannot read"),
])
def test_bad_replicas_files_are_config_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_replicas_file(path)


@pytest.mark.parametrize(("options", "field"), [
    ({"replicas": ()}, "replicas"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"port": 70000}, "port"),
    ({"health_interval_s": 0}, "health_interval_s"),
    ({"api_key": ""}, "api_key"),
    ({"replicas": (ReplicaConfig("http://a:1"), ReplicaConfig("http://a:1"))}, "duplicate"),
])
def test_router_config_names_the_bad_field(options: dict, field: str) -> None:
    base: dict = {"replicas": (ReplicaConfig("http://127.0.0.1:8001"),)}
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{**base, **options})


def test_flags_become_a_router_config(tmp_path: Path) -> None:
    extra = tmp_path / "r.yaml"
    extra.write_text("- http://127.0.0.1:8003\n")
    args = build_parser().parse_args([
        "router", "--replica", "http://127.0.0.1:8001",
        "--replica", "http://127.0.0.1:8002=ipc:///tmp/kv", "--replicas-file", str(extra),
        "--strategy", "kvaware", "--port", "9000", "--api-key", "k", "--events", "tcp://a:1",
        "--block-tokens", "16"])
    config = config_from_args(args)
    assert [r.url for r in config.replicas] == [
        "http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]
    assert config.replicas[1].vllm_events == "ipc:///tmp/kv"
    assert (config.strategy, config.port, config.api_key, config.events,
            config.block_tokens) == ("kvaware", 9000, "k", ("tcp://a:1",), 16)


def test_events_flag_accumulates_when_repeated_or_listed() -> None:
    args = build_parser().parse_args(["router", "--replica", "http://a:1", "--events", "tcp://e:1",
                                      "--events", "tcp://e:2", "tcp://e:3"])
    assert config_from_args(args).events == ("tcp://e:1", "tcp://e:2", "tcp://e:3")


def test_no_replica_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="replica"):
        config_from_args(build_parser().parse_args(["router"]))
