"""Watching a fleet: the metrics catalogue, a real Prometheus, the dashboard in a real browser.

    render_catalogue()          docs/metrics.md, rendered from the components' `MetricDef`s
                                (`python -m kvtier.tools.monitoring catalogue > docs/metrics.md`;
                                a test fails when the file differs)
    Prometheus(...)             Debian's `prometheus` scraping the router and every replica, with
                                the recording and alert rules of deploy/prometheus/; `start()`
                                waits until it is ready, `stop()` ends it (a context manager)
    capture_dashboard(url, ...) headless Chromium on the router's /dashboard: the DOM after the
                                page rendered, and optionally a PNG screenshot
                                (`python -m kvtier.tools.monitoring screenshot URL OUT.png`)

Prometheus and Chromium are system packages: `scripts/setup.sh` installs them with apt-get
(root); elsewhere `require_binary` says how to get them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.metric_defs import MetricDef
from kvtier.net.ports import free_port
from kvtier.net.readiness import wait_ready

__all__ = [
    "RULES_DIR",
    "Prometheus",
    "capture_dashboard",
    "render_catalogue",
    "require_binary",
]

RULES_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
"""deploy/prometheus/ of the source tree: recording rules, alert rules, their unit tests."""
RULE_FILES = ("kvtier.rules.yml", "kvtier.alerts.yml")
INSTALL_HINT = {
    "prometheus": "Debian/Ubuntu: `sudo apt-get install prometheus` (or run scripts/setup.sh as "
    "root); elsewhere the release tarball from prometheus.io/download, with `prometheus` and "
    "`promtool` on PATH",
    "promtool": "it ships with prometheus: `sudo apt-get install prometheus`",
    "chromium": "Debian: `sudo apt-get install chromium` (Ubuntu: `chromium-browser`); or set "
    "KVTIER_CHROMIUM to a Chromium/Chrome binary",
}
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--hide-scrollbars",
)


def require_binary(name: str) -> str:
    """The path of system binary `name`; a ConfigError saying how to install it otherwise."""
    override = os.environ.get("KVTIER_CHROMIUM") if name == "chromium" else None
    candidates = [override] if override else [name, *(["chromium-browser"] * (name == "chromium"))]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path:
            return path
    raise ConfigError(f"{name} is not installed: {INSTALL_HINT[name]}")


# ----------------------------------------------------------------------------- catalogue


def _catalogue_table(defs: Sequence[MetricDef]) -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for d in defs:
        labels = ", ".join(d.labels)
        meaning = d.help + (f" ({d.values})" if d.values else "")
        rows.append(f"| `{d.exposed}` | {d.kind} | {labels} | {meaning.replace('|', '&#124;')} |")
    return "\n".join(rows)


CATALOGUE_HEAD = """# Metrics catalogue

Every metric kvtier exports, generated from the code (`python -m kvtier.tools.monitoring
catalogue > docs/metrics.md`; `tests/monitoring/test_catalogue.py` fails when this file and the
code differ). Names follow Prometheus conventions: base units (`_seconds`, `_bytes`), counters
end in `_total`, histograms expose `_bucket`, `_sum` and `_count`, and label values come from
small fixed sets or the fleet's replica names. How to watch them: docs/observability.md.

- **Router** (`GET /metrics` of `kvtier router`): defined in `kvtier.router.metrics`.
- **Connector** and **L2** (`GET /metrics` of each vLLM replica, beside vLLM's own `vllm:*`):
  defined in `kvtier.vllm.connector_metrics`, carried by vLLM's connector-stats hooks
  (`kvtier.vllm.stats`), labelled with vLLM's `model_name` and `engine`. They move while the
  engine steps (vLLM sends no stats when idle).
  Every replica reports the L2 pool's figures from the janitor's status file: aggregate the
  gauges with `max`, the janitor's counters with `sum` (only the lease holder evicts).
"""


def render_catalogue() -> str:
    """The whole of docs/metrics.md."""
    from kvtier.router.metrics import ROUTER_METRICS
    from kvtier.vllm.connector_metrics import CONNECTOR_METRICS, L2_METRICS

    sections = [
        CATALOGUE_HEAD,
        "## Router\n\n" + _catalogue_table(ROUTER_METRICS),
        "## Connector (each replica)\n\n" + _catalogue_table(CONNECTOR_METRICS),
        "## L2 pool (each replica, from the janitor)\n\n" + _catalogue_table(L2_METRICS),
        "## Recording rules (deploy/prometheus/kvtier.rules.yml)\n\n" + _rules_table(),
    ]
    return "\n\n".join(sections) + "\n"


def _rules_table() -> str:
    import yaml

    doc = yaml.safe_load((RULES_DIR / RULE_FILES[0]).read_text())
    rows = ["| series | from |", "|---|---|"]
    for group in doc["groups"]:
        for rule in group["rules"]:
            labels = ", ".join(f'{k}="{v}"' for k, v in rule.get("labels", {}).items())
            name = rule["record"] + (f"{{{labels}}}" if labels else "")
            expr = " ".join(str(rule["expr"]).split()).replace("|", "&#124;")
            rows.append(f"| `{name}` | `{expr}` |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- Prometheus


def scrape_config(
    router: str, replicas: Sequence[str], *, interval_s: float, rules: Sequence[Path]
) -> dict[str, Any]:
    """prometheus.yml for one router and its replicas (each labelled `replica=<its URL>`, the
    name the router gives it)."""

    def target(url: str) -> str:
        return urllib.parse.urlsplit(url).netloc

    interval = f"{int(interval_s * 1000)}ms"
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "rule_files": [str(p) for p in rules],
        "scrape_configs": [
            {
                "job_name": "kvtier-router",
                "static_configs": [{"targets": [target(router)]}],
            },
            {
                "job_name": "kvtier-replica",
                "static_configs": [
                    {"targets": [target(url)], "labels": {"replica": url}} for url in replicas
                ],
            },
        ],
    }


class Prometheus:
    """A Prometheus server on loopback for one fleet; owns its process and data directory."""

    def __init__(
        self,
        work_dir: Path,
        router: str,
        replicas: Sequence[str],
        *,
        port: int | None = None,
        interval_s: float = 1.0,
        rules_dir: Path = RULES_DIR,
        on_started: Callable[[int], None] | None = None,
    ) -> None:
        """`on_started` gets the server's pid as soon as its process exists, before the wait
        for it to be ready (to record it: the server outlives a killed starter)."""
        self.work_dir = work_dir
        self._on_started = on_started
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = [rules_dir / name for name in RULE_FILES]
        missing = [str(p) for p in rules if not p.is_file()]
        if missing:
            raise ConfigError(f"Prometheus rules not found: {', '.join(missing)}")
        self.config = scrape_config(router, replicas, interval_s=interval_s, rules=rules)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id (None: not started)."""
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 60.0) -> Self:
        binary = require_binary("prometheus")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        config.write_text(json.dumps(self.config, indent=2))  # JSON is YAML
        cmd = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            "--storage.tsdb.retention.time=1d",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(self.work_dir / "prometheus.log", "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            if self._on_started is not None:
                self._on_started(self._proc.pid)
            wait_ready(self.url + "/-/ready", timeout_s, exited=self._proc.poll, what="prometheus")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a success, else KvtierError with Prometheus's
        error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                doc = json.load(resp)
        except urllib.error.HTTPError as exc:
            doc = json.load(exc)
        if doc.get("status") != "success":
            raise KvtierError(f"prometheus {path} {params}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar as one sample) `expr` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])


# ----------------------------------------------------------------------------- browser


def capture_dashboard(
    url: str,
    *,
    screenshot: Path | None = None,
    wait_ms: int = 4000,
    size: tuple[int, int] = (1500, 1250),
    timeout_s: float = 90.0,
) -> str:
    """Load `url` (a router's /dashboard) in headless Chromium with a fresh profile, let its
    scripts run for `wait_ms` of virtual time, and return the DOM it rendered; also write a PNG
    to `screenshot` when given (a second load)."""
    binary = require_binary("chromium")
    with tempfile.TemporaryDirectory(prefix="kvtier-chromium-") as profile:
        base = [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={wait_ms}",
        ]
        dom = _run_browser([*base, "--dump-dom", url], timeout_s)
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            _run_browser([*base, f"--screenshot={screenshot.resolve()}", url], timeout_s)
            if not screenshot.is_file():
                raise KvtierError(f"chromium wrote no screenshot to {screenshot}")
    return dom


def _run_browser(cmd: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise KvtierError(f"chromium did not finish within {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-800:]
        raise KvtierError(f"chromium exited with {done.returncode}: {tail}")
    return done.stdout.decode(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.monitoring")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("catalogue", help="print docs/metrics.md")
    shot = sub.add_parser("screenshot", help="PNG of a router's dashboard")
    shot.add_argument("url", help="router base URL")
    shot.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.what == "catalogue":
        print(render_catalogue(), end="")
    else:
        capture_dashboard(args.url.rstrip("/") + "/dashboard", screenshot=args.out)
        print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
