"""Request bodies as the router reads them: the nesting-depth check before decoding."""

from __future__ import annotations

import json

import pytest

from kvtier.router.openai_request import MAX_JSON_DEPTH, BadRequest, parse_body

MIB = 1 << 20


def body(**extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", **extra}).encode()


def nested(levels: int) -> object:
    """`levels` arrays, one inside the other."""
    doc: object = []
    for _ in range(levels - 1):
        doc = [doc]
    return doc


def assert_too_deep(raw: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_body(raw, chat=False)
    assert caught.value.status == 400
    assert f"nests deeper than {MAX_JSON_DEPTH} levels" in str(caught.value)


def test_a_body_nested_up_to_the_limit_is_accepted_and_one_level_more_is_a_400() -> None:
    assert parse_body(body(extra=nested(MAX_JSON_DEPTH - 1)), chat=False)["model"] == "m"
    assert_too_deep(body(extra=nested(MAX_JSON_DEPTH)))


@pytest.mark.parametrize(
    "prompt",
    [
        "[" * 1000,
        '"[' * 1000,  # escaped quotes inside the string do not end it
        "\\" * 7 + "[{" * 1000,  # nor does a run of (escaped) backslashes
        "\\" + '"' + "\\\\" + "[" * 1000,
    ],
)
def test_brackets_inside_strings_do_not_count(prompt: str) -> None:
    assert parse_body(body(prompt=prompt, extra=nested(MAX_JSON_DEPTH - 1)), chat=False)


@pytest.mark.timeout(60)  # a quadratic scan of these bodies would take hours
def test_mebibyte_bodies_of_escaped_quotes_are_judged_in_one_linear_pass() -> None:
    """A string that never ends, made of escaped quotes, after deep nesting: once a regex's
    worst case (each quote restarted a scan to the end, freezing the router's event loop)."""
    assert_too_deep(b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * (MIB // 2))
    legal = body(prompt='"[{\\' * (MIB // 4), extra=nested(MAX_JSON_DEPTH - 1))
    assert len(legal) > MIB and parse_body(legal, chat=False)["model"] == "m"
    with pytest.raises(BadRequest, match="not valid JSON"):  # shallow, the string unterminated
        parse_body(b'{"prompt": "' + b"[" * 100 + b'\\"' * (MIB // 2), chat=False)
