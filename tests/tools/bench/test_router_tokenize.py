"""The router tokenization benchmark: its conversations, its rows, and its refusals of bad
options (`kvtier bench router-tokenize`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.bench.router_tokenize import TOOLS, conversation, tool_calls


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 121])
def test_conversations_are_agent_turns_the_template_renders(
    tokenizer: Tokenizer, size: int
) -> None:
    body = conversation(size)
    assert body == conversation(size)  # deterministic
    assert body["tools"] == TOOLS and body["model"]
    roles = [m["role"] for m in body["messages"]]
    assert roles == (["system", "user"] + ["assistant", "tool", "assistant"] * size)[:size]
    for message, answer in zip(body["messages"], body["messages"][1:], strict=False):
        for call in message.get("tool_calls", []):
            assert call["type"] == "function"
            assert json.loads(call["function"]["arguments"])
            assert (answer["role"], answer["tool_call_id"]) == ("tool", call["id"])
    assert all(10 <= len(m["content"]) <= 600 for m in body["messages"])
    assert tokenizer.prompt(body, chat=True).max_tokens > 0


def test_a_conversation_has_two_messages_at_least() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        conversation(1)


def test_rows_give_each_size_its_counts_tokens_and_spread(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    options = ["--messages", "2,7", "--requests", "2", "--runs", "2", "--json", str(out)]
    assert main(["bench", "router-tokenize", *options]) == 0
    rows = json.loads(out.read_text())
    assert [(r["messages"], r["tool_calls"]) for r in rows] == [(2, 0), (7, 2)]
    assert tool_calls(conversation(121)) == 40
    for row in rows:
        assert 0 < row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert (row["requests"], row["runs"]) == (2, 2)
    assert 0 < rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("--messages", "1"), ("--messages", "0"), ("--messages", "7,x"), ("--runs", "0")],
)
def test_bad_counts_are_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "router-tokenize", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: expected" in capsys.readouterr().err
