"""The Prometheus rules and the scrape config `kvtier up --monitor` writes, checked by Prometheus's
own `promtool`: syntax (`check rules`, `check config`) and behaviour (`test rules`: the
recording rules' arithmetic, each alert firing when it should and quiet when it should)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.monitoring import RULE_FILES, RULES_DIR, require_binary, scrape_config


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return require_binary("promtool")
    except ConfigError as exc:
        pytest.skip(str(exc))


def check(cmd: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_accepts_the_rule_files(promtool: str) -> None:
    out = check([promtool, "check", "rules", *(str(RULES_DIR / f) for f in RULE_FILES)])
    assert out.count("SUCCESS") == len(RULE_FILES)


def test_the_rule_unit_tests_pass(promtool: str) -> None:
    out = check([promtool, "test", "rules", "kvtier_test.yml"], cwd=RULES_DIR / "tests")
    assert "SUCCESS" in out


def test_promtool_accepts_the_scrape_config_of_a_fleet(promtool: str, tmp_path: Path) -> None:
    config = scrape_config(
        "http://127.0.0.1:8000",
        ["http://127.0.0.1:8100", "http://127.0.0.1:8101"],
        interval_s=1.0,
        rules=[RULES_DIR / f for f in RULE_FILES],
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config))
    out = check([promtool, "check", "config", str(path)])
    assert "SUCCESS" in out
    replicas = config["scrape_configs"][1]["static_configs"]
    assert [c["labels"]["replica"] for c in replicas] == [
        "http://127.0.0.1:8100",
        "http://127.0.0.1:8101",
    ]
