"""Emulated nodes on one machine: Linux network namespaces on a private bridge.

    with Network() as net:
        router = net.node("router")                  # 10.231.0.1, its own network stack
        a = net.node("a")                            # 10.231.0.2 ...
        net.hosts(router, {"kvtier-replicas": [a.address]})   # its /etc/hosts
        proc = net.spawn(a, ["python", "-m", "http.server"])  # runs inside a's namespace
        net.link(a, up=False)                        # a's cable pulled

A switch namespace holds a bridge; each node is a namespace with one veth to it, addressed in
10.231.0.0/24 (a private subnet nothing else here uses; only addresses made here are ever
targeted). Processes run with `nsenter --net` (the machine's mounts stay visible: a FUSE mount
made for a node is seen by its engine) or, for a node with a hosts file, `ip netns exec`
(which binds /etc/netns/NAME/hosts over /etc/hosts for that process). `in_node` runs Python
code (an HTTP client) in a thread that has joined a node's namespace.

Everything is removed on `close()`, also at interpreter exit and for namespaces left by a run
that was killed (their names carry the owning pid). Needs root and the `ip` tool.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Self, TypeVar

import pytest

from kvtier.core.errors import run_every

T = TypeVar("T")
SUBNET = "10.231.0"
CLONE_NEWNET = 0x40000000
_PREFIX = "kvtmn"


def available() -> bool:
    return (
        os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("nsenter") is not None
    )


def require() -> None:
    if not available():
        pytest.skip("emulated nodes need root, `ip` and `nsenter`")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def sweep_stale() -> None:
    """Remove namespaces (and hosts dirs) left by earlier runs whose process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    for line in listed.stdout.splitlines():
        match = re.match(rf"^({_PREFIX}(\d+)-\S+)", line)
        if match and not Path(f"/proc/{match.group(2)}").exists():
            subprocess.run(["ip", "netns", "del", match.group(1)], capture_output=True, timeout=20)
            shutil.rmtree(f"/etc/netns/{match.group(1)}", ignore_errors=True)


@dataclass
class Node:
    name: str
    """Namespace name."""
    address: str
    index: int
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def netns(self) -> str:
        return f"/run/netns/{self.name}"


class Network:
    """The switch and the nodes (see the module docstring)."""

    def __init__(self) -> None:
        require()
        sweep_stale()
        self.tag = f"{_PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.nodes: list[Node] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._switch()
        except BaseException:
            self.close()  # the caller gets no network to close: a later one reuses the names
            raise

    def _switch(self) -> None:
        """The switch namespace and its bridge."""
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def node(self, name: str) -> Node:
        """A new node, cabled to the switch, at the next address of the subnet."""
        index = len(self.nodes) + 1
        node = Node(f"{self.tag}-{name}", f"{SUBNET}.{index}", index)
        _ip("netns", "add", node.name)
        self.nodes.append(node)
        port, peer = self._veth(node)
        _ip("link", "add", port, "netns", self.switch, "type", "veth", "peer", "name", peer,
            "netns", node.name)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", node.name, "link", "set", "lo", "up")
        _ip("-n", node.name, "link", "set", peer, "name", "eth0")
        _ip("-n", node.name, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _ip("-n", node.name, "link", "set", "eth0", "up")
        return node

    def _veth(self, node: Node) -> tuple[str, str]:
        return f"v{os.getpid()}s{node.index}", f"v{os.getpid()}n{node.index}"

    def link(self, node: Node, up: bool) -> None:
        """Plug or pull the node's cable (its switch port goes down: no packet in or out)."""
        _ip("-n", self.switch, "link", "set", self._veth(node)[0], "up" if up else "down")

    def hosts(self, node: Node, names: Mapping[str, Sequence[str]]) -> None:
        """The node's /etc/hosts (for processes started with `hosts=True`), rewritten in
        place: a running process's bind mount sees the new content."""
        folder = Path("/etc/netns") / node.name
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{address} {name}" for name, addresses in names.items() for address in addresses]
        with open(folder / "hosts", "w") as f:  # same inode: no rename
            f.write("\n".join(lines) + "\n")
        (folder / "host.conf").write_text("multi on\n")

    def spawn(
        self,
        node: Node,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log: IO[bytes] | int = subprocess.DEVNULL,
        hosts: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Run `cmd` inside the node's network namespace (in a session of its own)."""
        prefix = ["ip", "netns", "exec", node.name] if hosts else ["nsenter", f"--net={node.netns}"]
        proc = subprocess.Popen(
            [*prefix, *cmd],
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        node.processes.append(proc)
        return proc

    def close(self) -> None:
        """Stop every process the nodes run, then remove the namespaces and hosts files, each
        even when a step before it failed or was interrupted; the first exception met is
        raised once all have run (close is once: a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        procs = [proc for node in self.nodes for proc in node.processes]
        run_every([*(partial(stop, proc) for proc in procs), self._remove_namespaces])

    def _remove_namespaces(self) -> None:
        """Delete the nodes' and the switch's namespaces (their veths go with them) and hosts
        files; a namespace never made is skipped."""
        for name in [n.name for n in self.nodes] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass


_libc = ctypes.CDLL(None, use_errno=True)


def in_node(node: Node, fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run `fn(*args)` in a new thread inside the node's network namespace (its sockets are the
    node's); the calling thread stays where it is."""
    future: Future[T] = Future()

    def body() -> None:
        try:
            fd = os.open(node.netns, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    threading.Thread(target=body, daemon=True, name=f"in-{node.name}").start()
    return future
