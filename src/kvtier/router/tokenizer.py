"""Prompt tokens and block hashes exactly as the replicas see them.

The router tokenizes with the model's own tokenizer and chat template (tools included), then
hashes full blocks with `kvtier.core.keys.block_hashes` at the engine's block size, the same code the
replicas' connector uses, so a prompt's blocks carry the same names on both sides. A mismatch
would not break a request (the router forwards the original body), only its routing.

Mirrors vLLM's OpenAI server: completions add special tokens (`add_special_tokens` default true),
chat renders the template with `add_generation_prompt` (default true) and encodes the text
without special tokens; content given as parts is joined text.

Called once per request on the router's event loop. A fast tokenizer needs about a millisecond
per thousand tokens, the whole routing budget, so text is encoded in chunks cut where a
pre-token always ends (a non-space character followed by a space or newline) and each chunk's
ids are cached (LRU): a long shared prefix (a system prompt, a document, a conversation so far)
is encoded once and only the new tail costs anything. For byte-level BPE tokenizers (GPT-2,
Llama 3, SmolLM) chunked encoding equals whole encoding; `ChunkedEncoder` checks that on sample
texts at load time and encodes whole prompts when a tokenizer does not pass.

Routing does not even encode that tail (`Tokenizer.prompt`): a tail of at most ~2 chunks holds
a few dozen tokens, which can only complete the prompt's last full block, so the router hashes
the blocks the cached chunks cover (exact, never a wrong name; usually one block fewer or none)
and bounds the tail's token count by its UTF-8 length (a byte-level token is at least one byte).
The tail is encoded only when that bound could break the context-length check, or when it is
long (text without whitespace to cut at). This halves the router's CPU per request.

The head (the text up to the last cut) of recent prompts is memoized too, with its ids and its
block names: a request repeating a known document or conversation skips the per-chunk lookups
and the hashing, the bulk of what is left. In the serving process that work costs several times
its tight-loop timing (likely cold CPU caches: the cores ran the client and the replicas in
between), so touching less per request matters.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtier.core.keys import BlockHash, block_hashes, extra_key

__all__ = ["ChunkedEncoder", "Prompt", "PromptError", "Tokenizer"]

K = TypeVar("K")
V = TypeVar("V")

HEAD_CHARS = 4_000_000
"""Characters of recent prompt heads memoized with their ids and again with their block names
(the ids memo takes up to ~11 bytes per character, the names memo ~1)."""

# A non-space followed by whitespace: byte-level BPE pre-tokens never span it.
_BOUNDARY = re.compile(r"(?<=\S)(?=\s)")
_SELF_CHECK = (
    "Hello world.\n\nThis is  a test\twith tabs\n   indented line\n\n\nend 12345 x",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n",
    "Ünïcödé — dashes, ‘quotes’, emoji 🙂 and 中文字符 mixed;  done.\r\n next\u00a0line",
    "def f(x):\n    return x ** 2  # comment\n\nprint(f(3))\n",
)


class PromptError(ValueError):
    """The request's prompt cannot be tokenized; the message says which field is wrong."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt encoded as far as routing needs: exact `ids`, then `tail` still as text."""

    ids: list[int]
    tail: str = ""
    head: str | None = None
    """The text `ids` encode (after any special tokens), when they came from text: the key of
    the prompt's memoized block names."""

    @property
    def max_tokens(self) -> int:
        """An upper bound of the prompt's length (byte-level tokens hold at least one byte)."""
        return len(self.ids) + len(self.tail.encode())

    @property
    def estimated_tokens(self) -> int:
        """The length to weigh the prompt by (about four bytes per token in the tail)."""
        return len(self.ids) + (len(self.tail.encode()) + 3) // 4


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


class _Lru(Generic[K, V]):
    """A dict holding its most recently used entries up to a budget of summed entry costs
    (1 per entry by default; the key's length for memoized heads, so long prompts cannot pile
    up memory)."""

    def __init__(self, budget: int, cost: Callable[[K], int] = lambda key: 1) -> None:
        self.budget = budget
        self._cost = cost
        self._spent = 0
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Store and return `value` (an entry over the whole budget is returned, not stored)."""
        cost = self._cost(key)
        if cost > self.budget or key in self._items:
            return value
        self._items[key] = value
        self._spent += cost
        while self._spent > self.budget:
            old, _ = self._items.popitem(last=False)
            self._spent -= self._cost(old)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._spent = 0


class ChunkedEncoder:
    """Encodes text chunk by chunk with an LRU cache of chunk ids (see the module docstring).

    `encode` is the tokenizer's own encode without special tokens; chunks are at least
    `min_chars` long, cut at the first pre-token boundary after that, so two prompts sharing a
    prefix cut it identically.
    """

    def __init__(self, encode: Callable[[str], list[int]], min_chars: int = 256,
                 max_chunks: int = 4096, max_head_chars: int = HEAD_CHARS) -> None:
        self._encode = encode
        self.min_chars = min_chars
        self._chunks = _Lru[str, list[int]](max_chunks)
        self._heads = _Lru[str, list[int]](max_head_chars, len)
        """Ids of whole heads (text up to the last cut) of recent prompts."""
        self.exact = all(self._joined(t, 1) == encode(t) for t in _SELF_CHECK)
        self._chunks.clear()

    def __call__(self, text: str) -> list[int]:
        if not self.exact or len(text) < 2 * self.min_chars:
            return self._encode(text)
        return self._joined(text, self.min_chars)

    def _joined(self, text: str, min_chars: int) -> list[int]:
        ids, tail = self._chunked(text, min_chars)
        return ids + self.encode_tail(tail)

    def encode_tail(self, tail: str) -> list[int]:
        """Ids of a tail `split` left unencoded."""
        return self._encode(tail) if tail else []

    def split(self, text: str) -> tuple[list[int], str, str]:
        """Ids of `text` up to its last chunk cut, that text (the head), and the rest (the
        tail) unencoded."""
        if not self.exact or len(text) < 2 * self.min_chars:
            return self._encode(text), text, ""
        cuts = self._cuts(text, self.min_chars)
        end = cuts[-1] if cuts else 0
        tail = text[end:]
        if len(tail) > 2 * self.min_chars:  # few places to cut: routing needs its blocks
            return self._chunk_ids(text, cuts) + self._encode(tail), text, ""
        head = text[:end]
        ids = self._heads.get(head)
        if ids is None:
            ids = self._heads.put(head, self._chunk_ids(head, cuts))
        return list(ids), head, tail

    def _chunked(self, text: str, min_chars: int) -> tuple[list[int], str]:
        cuts = self._cuts(text, min_chars)
        return self._chunk_ids(text, cuts), text[cuts[-1] if cuts else 0:]

    @staticmethod
    def _cuts(text: str, min_chars: int) -> list[int]:
        cuts = []
        start = 0
        while (cut := _BOUNDARY.search(text, start + min_chars)) is not None:
            start = cut.start()
            cuts.append(start)
        return cuts

    def _chunk_ids(self, text: str, cuts: list[int]) -> list[int]:
        """Ids of `text` up to its last cut, chunk by chunk (the tail after it is usually new:
        not worth caching)."""
        ids: list[int] = []
        start = 0
        for cut in cuts:
            ids += self._chunk(text[start:cut])
            start = cut
        return ids

    def _chunk(self, chunk: str) -> list[int]:
        ids = self._chunks.get(chunk)
        if ids is None:
            ids = self._chunks.put(chunk, self._encode(chunk))
        return ids


class Tokenizer:
    """The model's tokenizer plus block hashing at `block_tokens` (the engine's block size)."""

    def __init__(self, model_dir: str, block_tokens: int) -> None:
        from transformers import AutoTokenizer  # heavy: only when a router starts

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.block_tokens = block_tokens
        self._encode = ChunkedEncoder(self._plain_encoder())
        self._names = _Lru[tuple[str, str | None, int], tuple[BlockHash, ...]](
            HEAD_CHARS, lambda key: len(key[0]))
        """Block names of recent prompt heads, by (head, cache salt, ids count)."""
        # special tokens (BOS) are prepended by most tokenizers; others are encoded whole
        self._specials = list(self._tok.encode("", add_special_tokens=True))
        probe = _SELF_CHECK[0]
        self._specials_lead = list(self._tok.encode(probe, add_special_tokens=True)) == \
            self._specials + self._encode(probe)

    def _plain_encoder(self) -> Callable[[str], list[int]]:
        """Encoding without special tokens; the Rust backend's own `encode` when it agrees with
        the wrapper: the wrapper goes through `encode_batch`, whose thread pool spins after
        every call and costs the router more CPU than the encoding itself."""
        def wrapped(text: str) -> list[int]:
            return list(self._tok.encode(text, add_special_tokens=False))

        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return wrapped

        def direct(text: str) -> list[int]:
            return list(backend.encode(text, add_special_tokens=False).ids)

        return direct if all(direct(t) == wrapped(t) for t in _SELF_CHECK) else wrapped

    def _split(self, text: str, add_special_tokens: bool) -> Prompt:
        if not add_special_tokens or self._specials_lead:
            ids, head, tail = self._encode.split(text)
            return Prompt(self._specials + ids if add_special_tokens else ids, tail, head)
        return Prompt(list(self._tok.encode(text, add_special_tokens=True)))

    def prompt(self, body: Mapping[str, Any], chat: bool) -> Prompt:
        """A request's prompt encoded as far as routing needs (see the module docstring)."""
        if chat:
            return self._split(self.chat_text(body), bool(body.get("add_special_tokens", False)))
        prompt = self.completion_prompt(body)
        if isinstance(prompt, list):
            return Prompt(prompt)
        return self._split(prompt, bool(body.get("add_special_tokens", True)))

    def tokens(self, prompt: Prompt) -> list[int]:
        """The prompt's exact token ids, as the engine computes them (encodes the tail)."""
        return prompt.ids + self._encode.encode_tail(prompt.tail)

    def completion_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a completions request's (first) prompt."""
        return self.tokens(self.prompt(body, chat=False))

    def completion_prompt(self, body: Mapping[str, Any]) -> str | list[int]:
        """A completions request's (first) prompt, as text or token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if _is_tokens(prompt):
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and prompt and (
                all(isinstance(p, str) for p in prompt) or all(_is_tokens(p) for p in prompt)):
            # a batch: routed and size-checked by its first prompt (replicas check the rest)
            return self.completion_prompt({**body, "prompt": prompt[0]})
        raise PromptError("'prompt' must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists", "prompt")

    def chat_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request rendered with the model's chat template."""
        return self.tokens(self.prompt(body, chat=True))

    def chat_text(self, body: Mapping[str, Any]) -> str:
        """A chat request rendered with the model's chat template."""
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
        if not isinstance(text, str):
            raise PromptError("chat template did not render text", "messages")
        return text

    def hash(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[BlockHash, ...]:
        """Names of the full blocks of `token_ids`, as the replicas' connector names them."""
        return tuple(block_hashes(token_ids, self.block_tokens,
                                  extra_key(cache_salt=cache_salt)))

    def block_names(self, prompt: Prompt, cache_salt: str | None = None) -> tuple[BlockHash, ...]:
        """`hash(prompt.ids)`, memoized by the prompt's head. The ids count in the key tells a
        head encoded with leading special tokens from the same head without them."""
        if prompt.head is None:
            return self.hash(prompt.ids, cache_salt)
        key = (prompt.head, cache_salt, len(prompt.ids))
        names = self._names.get(key)
        if names is None:
            names = self._names.put(key, self.hash(prompt.ids, cache_salt))
        return names
