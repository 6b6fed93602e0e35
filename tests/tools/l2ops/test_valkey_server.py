"""A Valkey server whose start fails or is interrupted leaves nothing behind: no process, no
temporary data dir (its owner never got the object that would stop it)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import valkey

from kvtier.core.errors import TierError
from kvtier.tools.l2ops.valkey_server import ValkeyServer, ValkeyServerSpec, start_valkey
from tests.helpers.procs import running

pytestmark = pytest.mark.valkey


def test_a_start_interrupted_while_it_waits_kills_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = ValkeyServer(ValkeyServerSpec())
    started: list[int] = []

    def interrupted(_client: object) -> bool:
        assert server.pid is not None
        started.append(server.pid)
        raise KeyboardInterrupt  # a Ctrl-C while start() waits for the first PING

    monkeypatch.setattr(valkey.Valkey, "ping", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
        assert started and not running(started[0])
        assert server.pid is None
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["start_valkey", "with"])
def test_a_failed_start_leaves_no_temporary_data_dir(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = ValkeyServerSpec(binary="/bin/false", start_timeout_s=1.0)  # exits at once
    with pytest.raises(TierError, match="did not start"):
        if how == "start_valkey":
            start_valkey(spec)
        else:
            with ValkeyServer(spec):
                pass
    assert os.listdir(tmp_path) == []
