"""Prompt tokens and block hashes exactly as the replicas see them.

The router tokenizes with the model's own tokenizer and chat template (tools included), then
hashes full blocks with `kvtier.keys.block_hashes` at the engine's block size, the same code the
replicas' connector uses, so a prompt's blocks carry the same names on both sides. A mismatch
would not break a request (the router forwards the original body), only its routing.

Mirrors vLLM's OpenAI server: completions add special tokens (`add_special_tokens` default true),
chat renders the template with `add_generation_prompt` (default true) and encodes the text
without special tokens; content given as parts is joined text.

Called once per request on the router's event loop (a fast tokenizer takes about a millisecond
for 2k tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import BlockHash, block_hashes, extra_key

__all__ = ["PromptError", "Tokenized", "Tokenizer"]


class PromptError(ValueError):
    """The request's prompt cannot be tokenized; the message says which field is wrong."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Tokenized:
    prompt_tokens: int
    hashes: tuple[BlockHash, ...]


def _text_content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise PromptError(f"{where}: each content part must be an object with a type",
                                  where)
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise PromptError(f"{where}: a text part needs a string 'text'", where)
                texts.append(part["text"])
        return "\n".join(texts)
    raise PromptError(f"{where}: content must be a string or a list of parts", where)


def _messages(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise PromptError("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"{where}: must be an object with a string 'role'", where)
        normalized = dict(message)
        normalized["content"] = _text_content(message.get("content"), f"{where}.content")
        out.append(normalized)
    return out


def _is_tokens(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


class Tokenizer:
    """The model's tokenizer plus block hashing at `block_tokens` (the engine's block size)."""

    def __init__(self, model_dir: str, block_tokens: int) -> None:
        from transformers import AutoTokenizer  # heavy: only when a router starts

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.block_tokens = block_tokens

    def completion_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a completions request's (first) prompt."""
        prompt = body.get("prompt")
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return list(self._tok.encode(prompt, add_special_tokens=bool(add_special)))
        if _is_tokens(prompt):
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and prompt and (
                all(isinstance(p, str) for p in prompt) or all(_is_tokens(p) for p in prompt)):
            # a batch: routed and size-checked by its first prompt (replicas check the rest)
            return self.completion_tokens({**body, "prompt": prompt[0]})
        raise PromptError("'prompt' must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists", "prompt")

    def chat_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request rendered with the model's chat template."""
        messages = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, Mapping) for t in tools)):
            raise PromptError("'tools' must be a list of objects", "tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise PromptError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        try:
            text = self._tok.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                **kwargs)
        except Exception as exc:  # jinja raises many types; any is a bad request
            raise PromptError(f"chat template failed: {exc}", "messages") from exc
        add_special = bool(body.get("add_special_tokens", False))
        return list(self._tok.encode(text, add_special_tokens=add_special))

    def hash(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Tokenized:
        hashes = block_hashes(token_ids, self.block_tokens, extra_key(cache_salt=cache_salt))
        return Tokenized(len(token_ids), tuple(hashes))
