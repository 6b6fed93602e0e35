"""Pods as processes: a rendered Deployment's container run the way a kubelet would run it.

Each pod gets its own network namespace and address (`tests.multinode.netns`), so the rendered
ports stay as they are and every pod is reached at its own IP; the pod's /etc/hosts stands in
for cluster DNS (Service names -> pod IPs). From the container spec:

- the environment: `envFrom` ConfigMaps and Secrets, then `env` in order (`value` with $(VAR)
  references expanded, `valueFrom` fieldRef status.podIP / metadata.name, configMapKeyRef,
  secretKeyRef);
- `command` + `args` with $(VAR) expanded ($$ escapes), as the kubelet does;
- volumes: a claim is a directory shared by every pod mounting it, a Secret or ConfigMap a
  directory of its files; each mountPath (and each image path in `image_paths`) is rewritten to
  its host directory wherever it appears in the environment and the arguments;
- the probes' httpGet paths and ports, polled until they answer 200.

Only the image's entry points differ: `command[0]` is looked up in `commands` (python3 -> this
interpreter, kvtier -> this venv's script).
"""

from __future__ import annotations

import base64
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.multinode.netns import Network, Node, in_node

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
COMMANDS = {"python3": sys.executable, "kvtier": str(Path(sys.executable).with_name("kvtier"))}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, unknown left as is, $$ -> $."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REF.sub(sub, text)


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"{kind}/{name} is not among the rendered objects")


def _data(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data", {}))


class Pod:
    """One pod of a rendered Deployment, on its own emulated node."""

    def __init__(
        self,
        net: Network,
        node: Node,
        objects: list[dict[str, Any]],
        deployment: str,
        volumes: Path,
        image_paths: dict[str, str],
        temp_root: Path,
    ) -> None:
        """`temp_root`: where the pod's own temporary directory goes (a container's /tmp:
        vLLM's IPC sockets and files), kept short for socket paths; the caller removes it."""
        self.net, self.node, self.objects = net, node, objects
        self.spec = _find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        self.container: dict[str, Any] = self.spec["containers"][0]
        self.name = f"{deployment}-{node.index}"
        self.temp = temp_root / self.name
        self.temp.mkdir()
        self.paths = dict(image_paths)
        self._mount(volumes)
        self.env = self._environment()
        self.argv = self._command()

    def _mount(self, root: Path) -> None:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:  # ReadWriteMany: one directory for all pods
                host = root / "claims" / volume["persistentVolumeClaim"]["claimName"]
            else:
                host = root / self.name / mount["name"]
            host.mkdir(parents=True, exist_ok=True)
            for kind, key in (("secret", "secretName"), ("configMap", "name")):
                if kind in volume:
                    source = _find(self.objects, kind[0].upper() + kind[1:], volume[kind][key])
                    data = _data(source)
                    items = volume[kind].get("items") or [{"key": k, "path": k} for k in data]
                    for item in items:
                        (host / item["path"]).write_text(data[item["key"]])
            self.paths[mount["mountPath"]] = str(host)

    def _remap(self, text: str) -> str:
        for path, host in sorted(self.paths.items(), key=lambda p: -len(p[0])):
            text = re.sub(rf"{re.escape(path)}(?=/|$|\W)", host, text)
        return text

    def _environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if ref in source:
                    env.update(_data(_find(self.objects, kind, source[ref]["name"])))
        for entry in self.container.get("env", []):
            name = entry["name"]
            if "value" in entry:
                env[name] = expand(entry["value"], env)
                continue
            ref = entry["valueFrom"]
            if "fieldRef" in ref:
                field = ref["fieldRef"]["fieldPath"]
                env[name] = {"status.podIP": self.node.address, "metadata.name": self.name}[field]
                continue
            kind, key = (
                ("ConfigMap", "configMapKeyRef")
                if "configMapKeyRef" in ref
                else (
                    "Secret",
                    "secretKeyRef",
                )
            )
            try:
                env[name] = _data(_find(self.objects, kind, ref[key]["name"]))[ref[key]["key"]]
            except KeyError:
                if not ref[key].get("optional"):
                    raise
        return {k: self._remap(v) for k, v in env.items()}

    def _command(self) -> list[str]:
        argv = [*self.container["command"], *self.container.get("args", [])]
        argv = [self._remap(expand(a, self.env)) for a in argv]
        return [COMMANDS.get(argv[0], argv[0]), *argv[1:]]

    def start(self, log: Path) -> None:
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "TMPDIR": str(self.temp),
        }
        with open(log, "ab") as out:
            self.process = self.net.spawn(
                self.node, self.argv, env={**base, **self.env}, log=out, hosts=True
            )
        self.log = log

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        return int(ports[name_or_number])

    def url(self, port: str | int = "http") -> str:
        return f"http://{self.node.address}:{self.port(port)}"

    def wait_probe(self, probe: str, prober: Node, timeout_s: float) -> float:
        """Poll the container's `probe` (httpGet) from `prober` until 200; seconds taken."""
        spec = self.container[probe]["httpGet"]
        url = self.url(spec["port"]) + spec["path"]
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}); see {self.log}"
                )
            if in_node(prober, _status, url).result(10) == 200:
                return time.monotonic() - started
            time.sleep(1.0)
        raise TimeoutError(
            f"{self.name}: {probe} {url} not 200 after {timeout_s:.0f} s; see {self.log}"
        )


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None
