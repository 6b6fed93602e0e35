import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
import kvtier.cli
from kvtier.cli import build_parser, main

COMMANDS = {
    ("demo",),
    ("model", "prepare"),
    ("serve",),
    ("router",),
    ("sim",),
    ("plan",),
    ("sim-trace",),
    ("up",),
    ("down",),
    ("status",),
    ("deploy", "render"),
    ("l2", "status"),
    ("l2", "gc"),
    ("l2", "verify"),
    ("bench", "store"),
    ("bench", "transfer"),
    ("bench", "tiers"),
    ("bench", "tiers-chart"),
    ("bench", "router"),
    ("bench", "router-saturation"),
    ("bench", "router-tokenize"),
    ("bench", "chat"),
    ("bench", "trace"),
    ("bench", "rag"),
    ("bench", "chaos"),
}
"""Every command a user can run, as `kvtier --help` and its subcommands list them."""


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """`parser` and every subcommand parser under it, by command."""
    yield path, parser
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()  # an alias maps to its command's own parser
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from parsers(sub, (*path, name))


def leaf_commands(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """The runnable commands under `parser`: those without subcommands."""
    return {
        path
        for path, sub in parsers(parser)
        if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
    }


def test_help_lists_every_command_and_every_command_has_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert leaf_commands(parser) == COMMANDS
    top = parser.format_help()
    for name in {c[0] for c in COMMANDS}:
        assert f"    {name}" in top
    for command in sorted(COMMANDS):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: kvtier {' '.join(command)}")
        description = text.split("\n\n")[1]
        assert not description.startswith("options:")  # a description says what it does,
        assert description.rstrip().endswith((".", ")"))  # in whole sentences


def test_unknown_command_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "no-such-command"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_kvtier_errors_become_a_named_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["model", "prepare", "--dir", str(blocker / "model")])
    assert code == 2
    assert "kvtier: error: cannot write the model under" in capsys.readouterr().err


def test_public_surface_is_pinned() -> None:
    assert kvtier.__all__ == sorted(kvtier.__all__)
    assert set(kvtier.__all__) == {
        "BlockHash",
        "BlockMeta",
        "CodecError",
        "ConfigError",
        "KvtierError",
        "LoadedBlock",
        "ModelError",
        "ModelIdentity",
        "Namespace",
        "RoutingError",
        "StoreSettings",
        "StoreStats",
        "Tier",
        "TierError",
        "TieredStore",
        "block_hashes",
        "root_hash",
    }
    assert all(getattr(kvtier, name) is not None for name in kvtier.__all__)


def test_sigterm_stops_what_the_command_started_and_exits_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cleaned: list[bool] = []

    def command(args: argparse.Namespace) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # `kill PID`, a CI timeout, a pod stopping
            time.sleep(30)
            return 0
        finally:
            cleaned.append(True)  # where a fleet, a mount or a namespace is stopped

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=command)
    monkeypatch.setattr(kvtier.cli, "build_parser", lambda: parser)
    before = signal.getsignal(signal.SIGTERM)
    assert main([]) == 143
    assert cleaned == [True]
    assert "terminated" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_main_runs_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvtier status` and others are called from worker threads (asyncio.to_thread), where
    no signal handler can be installed."""
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=lambda args: 7)
    monkeypatch.setattr(kvtier.cli, "build_parser", lambda: parser)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main([])))
    thread.start()
    thread.join(30)
    assert result == [7]


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text of `action` as `--help` prints it (%(default)s filled in)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def test_every_option_says_what_it_is() -> None:
    """Not only "(default N)": a help text that says what the option does."""
    missing = [
        f"kvtier {' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
        and not re.sub(r"\(default[^)]*\)", "", expanded_help(parser, action)).strip()
    ]
    assert missing == []
