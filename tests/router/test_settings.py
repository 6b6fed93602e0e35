"""Router settings, the replicas file and the `kvtier router` flags (one per setting)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.core.errors import ConfigError
from kvtier.router.settings import ReplicaSettings, RouterSettings, load_replicas_file
from kvtier.tools.router_cli import settings_from_args


def test_replicas_file_accepts_urls_and_objects_in_yaml_or_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text(
        "replicas:\n  - http://127.0.0.1:8001/\n"
        "  - {url: 'http://127.0.0.1:8002', name: b, vllm_events: 'ipc:///x',\n"
        "     vllm_events_replay: 'ipc:///y'}\n"
        "  - http://127.0.0.1:8003=tcp://127.0.0.1:5557\n"
    )
    json_file = tmp_path / "r.json"
    json_file.write_text('["http://127.0.0.1:8001"]')
    assert load_replicas_file(yaml_file) == (
        ReplicaSettings(url="http://127.0.0.1:8001", name="http://127.0.0.1:8001"),
        ReplicaSettings(
            url="http://127.0.0.1:8002",
            name="b",
            vllm_events="ipc:///x",
            vllm_events_replay="ipc:///y",
        ),
        ReplicaSettings(url="http://127.0.0.1:8003", vllm_events="tcp://127.0.0.1:5557"),
    )
    assert load_replicas_file(json_file) == (ReplicaSettings(url="http://127.0.0.1:8001"),)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[]", "no list"),
        ("- ftp://x\n", "entry 0.url: 'ftp://x' is not an http"),
        ("- {url: 'http://a:1', colour: red}\n", "entry 0.colour: unknown setting"),
        ("- 5\n", "entry 0"),
        ("{oops", "cannot read"),
        ("- http://a:1=notzmq\n", "entry 0.vllm_events: 'notzmq' is not a ZMQ endpoint"),
        ("\udcc3(", "cannot read .*: 'utf-8' codec can't decode byte 0xc3"),
    ],
)
def test_bad_replicas_files_are_config_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(text.encode(errors="surrogateescape"))
    with pytest.raises(ConfigError, match=match):
        load_replicas_file(path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": ()}, "^replicas: at least one replica"),
        ({"block_tokens": 0}, "^block_tokens: input should be greater than 0"),
        ({"port": 70000}, "^port: input should be less than 65536"),
        ({"health_interval_s": 0}, "^health_interval_s:"),
        ({"api_key": ""}, "^api_key:"),
        ({"strategy": "fastest"}, "^strategy:"),
        ({"max_body_bytes": "1x"}, "^max_body_bytes: cannot read"),
        ({"replicas": ["http://a:1", "http://a:1"]}, "^replicas: duplicate"),
        ({"replicas": ["http://a:1=tcp://*:5557"]}, "^replicas.0.vllm_events: 'tcp://"),
        ({"replicas": ["http://a:1=tcp://a"]}, "^replicas.0.vllm_events: .* not a ZMQ endpoint"),
        (
            {
                "replicas": [
                    {
                        "url": "http://a:1",
                        "vllm_events": "ipc:///e",
                        "vllm_events_replay": "tcp://*:5558",
                    }
                ]
            },
            r"^replicas.0.vllm_events_replay: 'tcp://\*:5558' is not a ZMQ endpoint",
        ),
        (
            {"replicas": [{"url": "http://a:1", "vllm_events_replay": "ipc:///r"}]},
            "^replicas.0.vllm_events_replay: only meaningful with vllm_events",
        ),
        (
            {"replicas_dns": "svc:8000", "replica_vllm_replay_port": 5558},
            "^replica_vllm_replay_port: only meaningful with replica_vllm_events_port",
        ),
        ({"replica_vllm_replay_port": 0}, "^replica_vllm_replay_port: input should be greater"),
    ],
)
def test_router_settings_name_the_bad_field(options: dict, message: str) -> None:
    base: dict = {"replicas": ["http://127.0.0.1:8001"]}
    with pytest.raises(ConfigError, match=message):
        RouterSettings(**{**base, **options})


def test_defaults_leave_the_block_size_to_the_replicas() -> None:
    settings = RouterSettings(replicas=["http://127.0.0.1:8001"])
    assert settings.block_tokens is None and settings.max_body_bytes == 16 * 1024**2


def test_flags_become_router_settings(tmp_path: Path) -> None:
    extra = tmp_path / "r.yaml"
    extra.write_text("- http://127.0.0.1:8003\n")
    args = build_parser().parse_args(
        [
            "router",
            "--replica",
            "http://127.0.0.1:8001",
            "--replica",
            "http://127.0.0.1:8002=ipc:///tmp/kv",
            "--replicas-file",
            str(extra),
            "--strategy",
            "kvaware",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--events",
            "tcp://a:1",
            "--block-tokens",
            "16",
            "--max-body-bytes",
            "1MiB",
            "--health-interval-s",
            "0.5",
        ]
    )
    settings = settings_from_args(args)
    assert [r.url for r in settings.replicas] == [
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002",
        "http://127.0.0.1:8003",
    ]
    assert settings.replicas[1].vllm_events == "ipc:///tmp/kv"
    assert (
        settings.strategy,
        settings.port,
        settings.api_key,
        settings.events,
        settings.block_tokens,
        settings.max_body_bytes,
        settings.health_interval_s,
    ) == ("kvaware", 9000, "k", ("tcp://a:1",), 16, 1024**2, 0.5)


def test_every_router_setting_has_a_flag() -> None:
    text = _router_help()
    for name in RouterSettings.model_fields:
        flag = {"replicas": "--replica", "model_dir": "--model"}.get(
            name, "--" + name.replace("_", "-")
        )
        assert flag in text, flag


def _router_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return str(sub.choices["router"].format_help())  # type: ignore[index]


def test_events_flag_accumulates_when_repeated_or_listed() -> None:
    args = build_parser().parse_args(
        [
            "router",
            "--replica",
            "http://a:1",
            "--events",
            "tcp://e:1",
            "--events",
            "tcp://e:2",
            "tcp://e:3",
        ]
    )
    assert settings_from_args(args).events == ("tcp://e:1", "tcp://e:2", "tcp://e:3")


def test_flag_errors_name_the_flag() -> None:
    args = build_parser().parse_args(["router", "--replica", "http://a:1", "--port", "x"])
    with pytest.raises(ConfigError, match="^--port: input should be a valid integer"):
        settings_from_args(args)


def test_no_replica_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="^--replica: at least one replica"):
        settings_from_args(build_parser().parse_args(["router"]))
