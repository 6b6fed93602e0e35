"""`kvtier l2 status|gc|verify` on a real directory and a real Valkey server."""

from __future__ import annotations

import argparse
import builtins
import errno
import json
import os
from pathlib import Path

import pytest
import valkey

from kvtier.cli import main
from kvtier.core.settings import parse_bytes
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings
from kvtier.tools.l2ops import cli
from kvtier.tools.l2ops.valkey_cluster import valkey_cluster
from kvtier.tools.l2ops.valkey_server import ValkeyServer
from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block, refuse


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvtier")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def stored_dir(tmp_path: Path, count: int) -> list[str]:
    tier = PosixTier(str(tmp_path), NAMESPACE, IDENTITY.manifest())
    paths = []
    for i in range(count):
        h, meta, payload = make_block(40, i, 8192)
        tier.put(h, meta, payload)
        paths.append(tier.path(h))
    return paths


def test_sizes_understand_binary_units() -> None:
    assert [parse_bytes(s) for s in ("123", "512M", "10GiB", "1.5k")] == [
        123,
        512 * 1024**2,
        10 * 1024**3,
        1536,
    ]
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


def test_status_shows_usage_and_gc_evicts_to_the_low_watermark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = stored_dir(tmp_path, 10)
    for i, path in enumerate(paths):
        os.utime(path, (1000 + i, 1000 + i))
    assert run("l2", "status", str(tmp_path), "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["blocks"], status["block_bytes"]) == (10, 10 * (4096 + 8192))
    assert status["janitor"] == "none" and status["last_pass"] is None
    capacity = str(12 * (4096 + 8192))  # 10 of 12 slots: below the high watermark
    assert (
        run(
            "l2",
            "gc",
            str(tmp_path),
            "--capacity",
            capacity,
            "--high",
            "0.9",
            "--low",
            "0.5",
            "--json",
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["trigger"] is None
    assert (
        run(
            "l2",
            "gc",
            str(tmp_path),
            "--capacity",
            capacity,
            "--high",
            "0.9",
            "--low",
            "0.5",
            "--to-low",
            "--json",
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["trigger"], report["evicted_blocks"]) == ("forced", 4)  # down to 6 slots
    assert [os.path.exists(p) for p in paths] == [False] * 4 + [True] * 6
    assert run("l2", "status", str(tmp_path), "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["blocks"] == 6 and status["last_pass"]["evicted_blocks"] == 4
    assert "expired" in status["janitor"]  # gc released the lease when done


def test_verify_finds_and_removes_a_corrupt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = stored_dir(tmp_path, 3)
    with open(paths[1], "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\x00garbage")
    assert run("l2", "verify", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert f"BAD {paths[1]}" in out and "checksum" in out
    assert run("l2", "verify", str(tmp_path), "--remove", "--json") == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1]) == {
        "checked": 3,
        "bad": 1,
        "removed": 1,
        "unreadable": 0,
    }
    assert not os.path.exists(paths[1]) and os.path.exists(paths[0])


def test_verify_removes_only_bad_blocks_never_one_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = stored_dir(tmp_path, 3)
    with open(paths[1], "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\x00garbage")
    refuse(monkeypatch, builtins, "open", paths[0], errno.EIO)
    assert run("l2", "verify", str(tmp_path), "--remove", "--json") == 1
    out, err = capsys.readouterr()
    assert f"cannot read {paths[0]}: Input/output error" in err
    assert json.loads(out.split("\n", 1)[1]) == {
        "checked": 2,
        "bad": 1,
        "removed": 1,
        "unreadable": 1,
    }
    assert os.path.exists(paths[0]) and not os.path.exists(paths[1])


def test_verify_fails_when_a_bad_block_cannot_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = stored_dir(tmp_path, 2)
    os.truncate(paths[1], 100)
    refuse(monkeypatch, os, "unlink", paths[1])
    assert run("l2", "verify", str(tmp_path), "--remove") == 1
    out = capsys.readouterr().out
    assert f"BAD {paths[1]}" in out and "not removed: Permission denied" in out


@pytest.mark.parametrize("action", ["status", "verify"])
def test_status_and_verify_fail_on_a_directory_they_cannot_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    action: str,
) -> None:
    paths = stored_dir(tmp_path, 1)
    refuse(monkeypatch, os, "scandir", str(tmp_path / NAMESPACE))
    assert run("l2", action, str(tmp_path), "--json") == 1
    assert f"cannot read {tmp_path / NAMESPACE}: Permission denied" in capsys.readouterr().err
    assert os.path.exists(paths[0])


def test_status_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("l2", "status", str(tmp_path)) == 0
    assert "janitor: none" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_gc_where_it_cannot_write_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refuse(monkeypatch, os, "mkdir", str(tmp_path / ".kvtier"))
    assert main(["l2", "gc", str(tmp_path), "--capacity", "1G"]) == 2
    assert f"{tmp_path / '.kvtier'}: Permission denied" in capsys.readouterr().err
    monkeypatch.undo()
    os.makedirs(tmp_path / ".kvtier" / "lease")
    monkeypatch.setattr(os, "link", _denied)
    assert main(["l2", "gc", str(tmp_path), "--capacity", "1G"]) == 2
    assert "lease: cannot take the janitor lease" in capsys.readouterr().err


def _denied(*args: object) -> None:
    raise PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.valkey
def test_status_and_verify_on_a_valkey_l2(
    valkey_server: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = ValkeyTier(ValkeyTierSettings(url=valkey_server.url), NAMESPACE, IDENTITY.manifest())
    hashes = []
    for i in range(4):
        h, meta, payload = make_block(41, i, 8192)
        tier.put(h, meta, payload)
        hashes.append(h)
    valkey.Valkey.from_url(valkey_server.url).setrange(
        f"{NAMESPACE}:{hashes[2].hex()}", 5000, b"\xff"
    )
    assert run("l2", "status", valkey_server.url, "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["policy"] == "allkeys-lru" and status["keys"] >= 5
    assert run("l2", "verify", valkey_server.url, "--remove") == 0
    out = capsys.readouterr().out
    assert f"BAD {NAMESPACE}:{hashes[2].hex()}" in out
    assert tier.contains_many(hashes) == [True, True, False, True]


@pytest.mark.valkey
def test_status_and_verify_cover_every_shard_of_a_valkey_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with valkey_cluster(3) as nodes:
        tier = ValkeyTier(ValkeyTierSettings(url=nodes[0].url), NAMESPACE, IDENTITY.manifest())
        blocks = [make_block(42, i, 8192) for i in range(12)]
        assert all(tier.put(*block).stored for block in blocks)
        bad = [f"{NAMESPACE}:{h.hex()}" for h, _, _ in blocks[:: len(blocks) // 3]]
        corrupted_on = set()
        for node in nodes:
            with valkey.Valkey.from_url(node.url) as admin:
                for key in set(bad) & {k.decode() for k in admin.keys(f"{NAMESPACE}:*")}:
                    admin.setrange(key, 5000, b"\xff")  # (on its own shard: no MOVED)
                    corrupted_on.add(node.port)
        assert len(corrupted_on) > 1
        assert run("l2", "status", nodes[1].url, "--json") == 0
        status = json.loads(capsys.readouterr().out)
        assert (status["servers"], status["keys"]) == (3, len(blocks) + 1)
        assert run("l2", "verify", nodes[1].url, "--remove") == 0
        out = capsys.readouterr().out
        assert all(f"BAD {key}" in out for key in bad)
        found = tier.contains_many([h for h, _, _ in blocks])
        assert found == [f"{NAMESPACE}:{h.hex()}" not in bad for h, _, _ in blocks]
        tier.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status", "{missing}"], "{missing}: no such L2 directory"),
        (["gc", "{missing}", "--capacity", "1G"], "{missing}: no such L2 directory"),
        (["verify", "{missing}"], "{missing}: no such L2 directory"),
        (["status", "{file}"], "{file}: not a directory"),
        (["gc", "{file}", "--capacity", "1G"], "{file}: not a directory"),
        (["verify", "{file}"], "{file}: not a directory"),
        (["gc", "redis://127.0.0.1:1/0", "--capacity", "1G"], "gc runs on an L2 directory"),
        (["status", "redis://:secret@127.0.0.1:1/0"], "redis://:***@127.0.0.1:1/0: Error"),
        (["verify", "redis://127.0.0.1:1/0"], "redis://127.0.0.1:1/0: Error"),
    ],
)
def test_a_missing_directory_a_file_or_an_unreachable_valkey_is_an_error_and_creates_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    missing, file = str(tmp_path / "missing"), tmp_path / "file"
    file.touch()
    assert main(["l2", *(a.format(missing=missing, file=file) for a in argv)]) == 2
    assert message.format(missing=missing, file=file) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [file]
