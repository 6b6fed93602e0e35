"""Chat requests as vLLM 0.32's OpenAI server hands them to the chat template: the messages as
`parse_chat_messages` converts them (vllm/renderers/chat_utils.py), the template's arguments as
`ChatCompletionRequest.build_chat_params` and `OnlineRenderer.render_chat` merge them.

A field vLLM would refuse is a `BadRequest` naming it; what vLLM coerces (tool-call arguments
that are not a JSON object) is coerced the same way. Nothing here changes the request body.
Objects are JSON objects as `parse_body` decodes them (`dict`), checked as such: a check against
the `Mapping` ABC costs several times more, once per message field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvtier.router.openai_request import BadRequest

__all__ = ["ChatOptions", "chat_options", "developer_as_system", "messages"]

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
}
"""Content part types vLLM renders as text, and the field holding it (others: media, skipped)."""

_PART_FIELDS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
"""The fields vLLM's content part types declare; a text part handed over as a part keeps the
others (e.g. `cache_control`)."""

_BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's first system line: its `cch` changes on every request, so vLLM drops the line
from system messages (a prompt keeping it would miss the prefix cache from there on)."""

_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
"""The `reasoning_effort` values vLLM accepts."""


def _plain_text(part: object) -> object:
    """A part's text when it is plain text (a string or a "text" part), else None."""
    if isinstance(part, dict):
        return part.get("text") if part.get("type") == "text" else None
    return part


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System parts less Claude Code's billing header line (a part left empty goes)."""
    kept = []
    for part in parts:
        text = _plain_text(part)
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
        elif rest := text.partition("\n")[2]:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _parts(message: Mapping[str, Any], where: str) -> list[Any]:
    """A message's content as the parts vLLM reads: text is one text part, None none."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif not isinstance(content, list):
        raise BadRequest(400, f"{where}: content must be a string or a list of parts", where)
    return _without_billing_header(content) if message["role"] == "system" else content


def _part(part: object, where: str) -> dict[str, Any] | None:
    """A content part as vLLM hands it to a template taking parts: text parts as
    {"type": "text", "text"} with the part's undeclared fields, tool references as
    {"type": "tool_reference", "name"}; None for media, which the router does not render."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(
            400, f"{where}: each content part must be a string or an object with a type", where
        )
    kind = part["type"]
    field = _TEXT_PARTS.get(kind)
    if field is None:
        return None
    if not isinstance(part.get(field), str):
        raise BadRequest(400, f"{where}: a {kind} part needs a string '{field}'", where)
    if kind == "tool_reference":
        return {"type": kind, "name": part[field]}
    return {"type": "text", "text": part[field]} | {
        k: v for k, v in part.items() if k not in _PART_FIELDS
    }


def _text(part: Mapping[str, Any]) -> str:
    text: str = part["text"] if part["type"] == "text" else part["name"]
    return text


def _content(message: Mapping[str, Any], as_parts: bool, where: str) -> str | list[dict[str, Any]]:
    """The content vLLM hands over: the parts (`as_parts`), else the texts of the non-empty
    parts joined by newlines; a tool message's text parts, even empty ones, always as text."""
    content, role = message.get("content"), message["role"]
    if isinstance(content, str) and not (role == "system" and content.startswith(_BILLING_HEADER)):
        # the common case: what the general path below gives, without building a part
        return [{"type": "text", "text": content}] if as_parts and role != "tool" else content
    parts = [p for part in _parts(message, where) if (p := _part(part, where)) is not None]
    if not as_parts:
        return "\n".join(text for part in parts if (text := _text(part)))
    if role == "tool" and all(part["type"] == "text" for part in parts):
        return "\n".join(_text(part) for part in parts)
    return parts


def _fields_first(fields: Mapping[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
    """`fields` with the `first` keys present leading, in that order: the key order vLLM's
    request model gives an object it validates, seen by a template dumping it as JSON."""
    return {**{key: fields[key] for key in first if key in fields}, **fields}


def _arguments(text: str) -> dict[str, Any]:
    """Tool-call arguments as vLLM hands them to the template: the JSON object; {} for an empty
    string, invalid JSON or JSON other than an object (vLLM coerces them rather than failing
    the conversation's every later turn)."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _tool_call(call: object, where: str) -> dict[str, Any]:
    """An assistant's tool call as vLLM hands it over, its `function.arguments` decoded."""
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(call, dict)
        or not isinstance(function, dict)
        or call.get("type", "function") != "function"
    ):
        raise BadRequest(400, f"'{where}' must be a function tool call", where)
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        field = f"{where}.function.arguments"
        raise BadRequest(400, f"'{field}' must be a string", field)
    decoded = _fields_first({**function, "arguments": _arguments(arguments)}, ("arguments", "name"))
    return _fields_first({**call, "function": decoded}, ("id", "function", "type"))


def _assistant_fields(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An assistant message's `tool_calls` (left out when empty) and its reasoning (`reasoning`,
    else the older `reasoning_content`), which vLLM hands over under both names."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        where = f"{where}.tool_calls"
        if not isinstance(calls, list):
            raise BadRequest(400, f"'{where}' must be a list", where)
        if calls:
            fields["tool_calls"] = [_tool_call(c, f"{where}[{i}]") for i, c in enumerate(calls)]
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if reasoning is not None:
        fields["reasoning"] = fields["reasoning_content"] = reasoning
    return fields


def _message(message: object, as_parts: bool, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(400, f"{where}: must be an object with a string 'role'", where)
    role = message["role"]
    out = {"role": role, "content": _content(message, as_parts, f"{where}.content")}
    if role == "assistant":
        out.update(_assistant_fields(message, where))
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def messages(body: Mapping[str, Any], *, as_parts: bool) -> list[dict[str, Any]]:
    """The chat messages as vLLM 0.32 hands them to the chat template (`parse_chat_messages`):
    each with its role and content (`as_parts`: a list of text parts, for a template that loops
    over parts, vLLM's "openai" content format; else the texts of the non-empty parts joined by
    newlines; media left out), an assistant's `tool_calls` (arguments decoded) and reasoning, a
    tool message's `tool_call_id`, `name` and `task`, and a developer message's `tools`; other
    fields are dropped. New objects: the body is left as it is."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest(400, "'messages' must be a non-empty list", "messages")
    return [_message(message, as_parts, f"messages[{i}]") for i, message in enumerate(raw)]


def _system_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if "text" in part)


def developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`conversation` as vLLM renders it with a template that does not name the developer role:
    developer messages become system messages (less their `tools`); when a system message then
    follows another message, all system messages merge into a first one, their texts joined by
    blank lines (vLLM's `_convert_developer_to_system`, `_consolidate_system_messages`).
    Unchanged without developer messages."""
    if all(m["role"] != "developer" for m in conversation):
        return conversation
    converted = [
        {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
        if m["role"] == "developer"
        else m
        for m in conversation
    ]
    if all(i == 0 for i, m in enumerate(converted) if m["role"] == "system"):
        return converted
    texts = [t for m in converted if m["role"] == "system" and (t := _system_text(m["content"]))]
    rest = [m for m in converted if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged onto `base`, less its None and "auto" values (vLLM's `merge_kwargs`)."""
    return {**base, **{k: v for k, v in over.items() if v is not None and v != "auto"}}


def _set(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _tool(tool: object, where: str) -> dict[str, Any]:
    """A tool as vLLM's request model dumps it: `description` and `parameters` always (None when
    left out), `strict` and `defer_loading` when set (a tool's `defer_loading` also on its
    function, unless that sets its own), unknown fields dropped."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or tool.get("type", "function") != "function"
    ):
        raise BadRequest(400, f"'{where}' must be a function tool with a string name", where)
    defer, own_defer = tool.get("defer_loading"), function.get("defer_loading")
    optional = {"strict": function.get("strict"), "defer_loading": own_defer}
    if own_defer is None:
        optional["defer_loading"] = defer
    dumped = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        **_set(optional),
    }
    return {"type": "function", "function": dumped, **_set({"defer_loading": defer})}


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:  # vLLM refuses an empty list too
        raise BadRequest(400, "'tools' must be a non-empty list of tools", "tools")
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _template_kwargs(body: Mapping[str, Any]) -> Mapping[str, Any]:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if "chat_template" in kwargs:  # a client's own Jinja template would run in the router
        raise BadRequest(
            400, "a chat template given in the request is not accepted", "chat_template_kwargs"
        )
    return kwargs


def _request_kwargs(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields vLLM passes to the template over `kwargs` (`build_chat_params`)."""
    documents, effort = body.get("documents"), body.get("reasoning_effort")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise BadRequest(400, "'documents' must be a list of objects", "documents")
    if effort is not None and not (isinstance(effort, str) and effort in _REASONING_EFFORTS):
        raise BadRequest(
            400,
            f"'reasoning_effort' must be one of {sorted(_REASONING_EFFORTS)}",
            "reasoning_effort",
        )
    fields = {
        "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
        "continue_final_message": bool(body.get("continue_final_message", False)),
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = effort != "none"
    return fields


class ChatOptions(msgspec.Struct, frozen=True):
    """How vLLM renders a chat request with the model's template."""

    template_kwargs: dict[str, Any]
    """The template's arguments as vLLM merges them, each source over the one before: `tools`
    (as its request model dumps them), `chat_template_kwargs`, then the request's
    `add_generation_prompt`, `continue_final_message`, `documents` and `reasoning_effort` (with
    `enable_thinking`: effort not "none", unless the kwargs name it); None and "auto" values
    are left out (vLLM's `merge_kwargs`)."""
    add_special_tokens: bool


def chat_options(body: Mapping[str, Any]) -> ChatOptions:
    """How vLLM renders the chat request; raises `BadRequest` naming a field vLLM would refuse."""
    kwargs = _template_kwargs(body)
    tools = _tools(body)
    request = _merged(kwargs, _request_kwargs(body, kwargs))
    return ChatOptions(
        template_kwargs=_merged({} if tools is None else {"tools": tools}, request),
        add_special_tokens=bool(body.get("add_special_tokens", False)),
    )
