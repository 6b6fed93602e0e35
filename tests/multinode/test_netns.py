"""The emulated nodes' network on failure paths: a network whose switch cannot be made, or
whose close is interrupted, leaves no namespace behind (a later network of the same process
reuses the names)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.multinode import netns
from tests.multinode.netns import Network, require


def namespaces() -> list[str]:
    """This process's namespaces (their names carry its pid)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    prefix = f"kvtmn{os.getpid()}-"
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith(prefix)]


@pytest.fixture(autouse=True)
def emulated_nodes() -> None:
    require()
    assert not namespaces()


def test_a_network_whose_switch_cannot_be_made_leaves_no_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = netns._ip

    def no_bridge(*args: str) -> None:
        if "bridge" in args:
            raise subprocess.CalledProcessError(2, ["ip", *args])
        real(*args)

    monkeypatch.setattr(netns, "_ip", no_bridge)
    with pytest.raises(subprocess.CalledProcessError):
        Network()
    assert not namespaces()


def test_an_interrupted_close_still_removes_the_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    net = Network()
    try:
        net.spawn(net.node("a"), ["sleep", "30"])
        real = netns.stop

        def interrupted(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
            real(proc, 1.0)
            raise KeyboardInterrupt  # a Ctrl-C during the grace wait

        monkeypatch.setattr(netns, "stop", interrupted)
        with pytest.raises(KeyboardInterrupt):
            net.close()
        assert not namespaces()
    finally:
        net._closed = False
        monkeypatch.undo()
        net.close()
