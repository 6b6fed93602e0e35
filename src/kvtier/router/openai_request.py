"""OpenAI request bodies as the router reads them: JSON, field types, prompts and messages.

Every check of a client's request lives here, and every failure is a `BadRequest` that the app
answers with its status and an OpenAI error body `{"error": {"message", "type", "param",
"code"}}`. The router only reads what routing needs and forwards the original bytes; the
replicas check the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import msgspec
import numpy as np
from numpy.typing import NDArray

__all__ = [
    "BadRequest",
    "Truncation",
    "completion_prompt",
    "parse_body",
    "requested_tokens",
    "requested_truncation",
]

# field -> (accepted types, description) for the OpenAI fields the router reads or checks
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "stream": ((bool,), "a boolean"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "user": ((str,), "a string"),
    "cache_salt": ((str,), "a string"),
    "stop": ((str, list), "a string or a list of strings"),
}

_COUNTS = frozenset({"max_tokens", "max_completion_tokens", "n"})
"""Fields that must be at least 1."""

_decode_json = msgspec.json.Decoder().decode  # much faster than json.loads on long prompts

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (OpenAI bodies, tool schemas
included, stay far below; the decoder itself would give up near Python's recursion limit)."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a prompt may hold (ids are hashed as unsigned 32-bit integers)."""


def _outside_strings(codes: NDArray[np.uint8]) -> NDArray[np.bool_]:
    """True on the bytes outside JSON strings (exact for valid JSON): a quote opens or closes a
    string unless an odd run of backslashes precedes it. Linear: a fixed number of passes."""
    quotes = codes == 0x22
    backslashes = np.zeros(codes.size + 2, dtype=bool)
    backslashes[1:-1] = codes == 0x5C
    edges = np.flatnonzero(backslashes[1:] != backslashes[:-1])  # run starts, ends, alternating
    starts, ends = edges[::2], edges[1::2]
    escaped = ends[(ends - starts) % 2 == 1]  # the byte after an odd run of backslashes
    quotes[escaped[escaped < codes.size]] = False
    odd: NDArray[np.uint8] = np.bitwise_xor.accumulate(quotes.view(np.uint8))  # quotes so far
    return ~odd.astype(bool)


def _too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `raw` nests arrays/objects deeper than `limit`; linear at C speed: almost every
    body has fewer brackets than `limit` at all, the rest are scanned once outside strings."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    codes = np.frombuffer(raw, dtype=np.uint8)
    outside = codes[_outside_strings(codes)]
    opens = (outside == 0x5B) | (outside == 0x7B)  # [ {
    closes = (outside == 0x5D) | (outside == 0x7D)  # ] }
    steps = opens.view(np.int8) - closes.view(np.int8)
    depth = np.cumsum(steps[steps != 0], dtype=np.int64)
    return bool(depth.size) and int(depth.max()) > limit


class BadRequest(Exception):
    """Answered `status` with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def parse_body(raw: bytes, *, chat: bool) -> dict[str, Any]:
    """The request's JSON object, with the fields the router reads type-checked."""
    if _too_deep(raw):
        raise BadRequest(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = _decode_json(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    for field, value in body.items():  # a body has few fields: fewer than _TYPES
        spec = _TYPES.get(field)
        if spec is None or value is None:
            continue
        types, what = spec
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise BadRequest(400, f"'{field}' must be {what}", field)
        if field in _COUNTS and cast(int, value) < 1:  # an int: checked just above
            raise BadRequest(400, f"'{field}' must be at least 1", field)
    if body.get("model") is None:
        raise BadRequest(400, "'model' is required", "model")
    field = "messages" if chat else "prompt"
    if field not in body:
        raise BadRequest(400, f"'{field}' is required", field)
    return body


class Truncation(NamedTuple):
    """A request's `truncate_prompt_tokens` and `truncation_side`, as vLLM applies them."""

    keep: int
    """Prompt tokens kept; -1: the model's context length less one."""
    side: str
    """"left" keeps the last tokens (vLLM's default for generation), "right" the first."""


def requested_truncation(body: Mapping[str, Any]) -> Truncation | None:
    """The prompt truncation the request asks vLLM for (None: none); 400 for a bad value."""
    keep = body.get("truncate_prompt_tokens")
    if keep is None:
        return None
    if type(keep) is not int or keep < -1:
        raise BadRequest(
            400, "'truncate_prompt_tokens' must be an integer >= -1", "truncate_prompt_tokens"
        )
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise BadRequest(400, "'truncation_side' must be 'left' or 'right'", "truncation_side")
    return Truncation(keep, side)


def requested_tokens(body: Mapping[str, Any], *, chat: bool) -> int:
    """Completion tokens the request asks for (0 when it leaves it to the server)."""
    wanted = body.get("max_completion_tokens") if chat else None
    return int(wanted or body.get("max_tokens") or 0)


def _is_tokens(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
        )
    )


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completions request's (first) prompt, as text or token ids; a batch is routed and
    size-checked by its first prompt (the replicas check the rest)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if _is_tokens(prompt):
        return list(prompt)  # type: ignore[arg-type]
    if (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(_is_tokens(p) for p in prompt))
    ):
        return completion_prompt({"prompt": prompt[0]})
    raise BadRequest(
        400,
        "'prompt' must be a string, a list of strings, a list of token ids "
        "or a list of token-id lists",
        "prompt",
    )
