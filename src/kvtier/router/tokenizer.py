"""Prompt tokens and block hashes exactly as the replicas see them.

The router tokenizes with the model's own tokenizer and chat template (tools included), then
hashes full blocks with `kvtier.core.keys.block_hashes` at the engine's block size, the same
code the replicas' connector uses, so a prompt's blocks carry the same hashes on both sides. A
mismatch would not break a request (the router forwards the original body), only its routing.
The extra key is the connector's too (`kvtier.vllm.compat.request_extra`): the cache salt, and
the LoRA adapter's name and path for a request to an adapter (its `model`, which vLLM takes as
the adapter's `lora_name`; the router tells adapters, and their paths, by their /v1/models
cards).

Mirrors vLLM 0.32's OpenAI server: completions add special tokens (`add_special_tokens` default
true); chat renders the template with the conversation and arguments vLLM hands it
(`kvtier.router.chat_request`; content as text or, for a template
looping over content parts, as parts, detected as vLLM detects it) and encodes the text without
special tokens (`add_special_tokens` default false).

Routing does not even encode a prompt's tail (`Tokenizer.prompt`): text is encoded in cached
chunks (`kvtier.router.chunked_encoder`), and a tail of at most ~2 chunks holds a few dozen
tokens, which can only complete the prompt's last full block. So the router hashes the blocks
the cached chunks cover (exact, never a wrong hash; usually one block fewer or none) and bounds
the tail's token count by its UTF-8 length (a byte-level token is at least one byte). The tail
is encoded only when that bound could break the context-length check, or when it is long (text
without whitespace to cut at). The block hashes of recent prompt heads are memoized too.

The cached chunks and heads are per tenant (`namespace`: the tenant's cache salt, None for the
shared namespace), so a cache hit, which answers sooner, never tells one tenant what another
sent (`kvtier.router.chunked_encoder`); the block-hash memo is keyed by the full cache salt.

Called once per request on the router's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kvtier.core.keys import BlockHash, block_hashes, extra_key
from kvtier.core.lru import Lru
from kvtier.router.chat_request import ChatOptions, chat_options, developer_as_system, messages
from kvtier.router.chat_template import names_developer_role, takes_content_parts
from kvtier.router.chunked_encoder import HEAD_CHARS, SELF_CHECK, ChunkedEncoder, Namespace
from kvtier.router.openai_request import BadRequest, Truncation, completion_prompt

__all__ = ["LoraAdapter", "Prompt", "Tokenizer"]

LoraAdapter = tuple[str, str]
"""A LoRA adapter as the replicas key its blocks: (name, path)."""


class Prompt(NamedTuple):
    """A prompt encoded as far as routing needs: exact `ids`, then `tail` still as text."""

    ids: tuple[int, ...]
    tail: str = ""
    head: str | None = None
    """The text `ids` encode (after any special tokens), when they came from text: the key of
    the prompt's memoized block hashes."""

    @property
    def max_tokens(self) -> int:
        """An upper bound of the prompt's length (byte-level tokens hold at least one byte)."""
        return len(self.ids) + len(self.tail.encode())

    @property
    def estimated_tokens(self) -> int:
        """The length to weigh the prompt by (about four bytes per token in the tail)."""
        return len(self.ids) + (len(self.tail.encode()) + 3) // 4


class Tokenizer:
    """The model's tokenizer and chat template, with chunked encoding and block hashing."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy: only when a router starts

        self.hf = AutoTokenizer.from_pretrained(model_dir)
        """The Hugging Face tokenizer itself."""
        self.encoder = ChunkedEncoder(self._plain_encoder())
        self._hashes: Lru[
            tuple[str, str | None, LoraAdapter | None, int, int], tuple[BlockHash, ...]
        ] = Lru(HEAD_CHARS, lambda key, _: len(key[0]))
        """Block hashes of recent prompt heads, by (head, cache salt, LoRA adapter, ids count,
        block size)."""
        # special tokens (BOS) are prepended by most tokenizers; others are encoded whole
        self._specials = tuple(self.hf.encode("", add_special_tokens=True))
        probe = SELF_CHECK[0]
        led = tuple(self.hf.encode(probe, add_special_tokens=True))
        self._specials_lead = led == self._specials + tuple(self.encoder(probe))

    def _plain_encoder(self) -> Callable[[str], list[int]]:
        """Encoding without special tokens; the Rust backend's own `encode` when it agrees with
        the wrapper: the wrapper goes through `encode_batch`, whose thread pool spins after
        every call and costs the router more CPU than the encoding itself."""

        def wrapped(text: str) -> list[int]:
            return list(self.hf.encode(text, add_special_tokens=False))

        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return wrapped

        def direct(text: str) -> list[int]:
            return list(backend.encode(text, add_special_tokens=False).ids)

        return direct if all(direct(t) == wrapped(t) for t in SELF_CHECK) else wrapped

    def _split(self, text: str, add_special_tokens: bool, namespace: Namespace) -> Prompt:
        if not add_special_tokens or self._specials_lead:
            ids, head, tail = self.encoder.split(text, namespace)
            return Prompt(self._specials + ids if add_special_tokens else ids, tail, head)
        return Prompt(tuple(self.hf.encode(text, add_special_tokens=True)))

    def prompt(self, body: Mapping[str, Any], chat: bool, namespace: Namespace = None) -> Prompt:
        """A request's prompt encoded as far as routing needs (see the module docstring), with
        the chunk caches of `namespace` (the tenant's cache salt; None: the shared one); raises
        `BadRequest` for a prompt that cannot be tokenized."""
        if chat:
            options = chat_options(body)
            text = self._chat_text(body, options)
            return self._split(text, options.add_special_tokens, namespace)
        prompt = completion_prompt(body)
        if isinstance(prompt, list):
            return Prompt(tuple(prompt))
        return self._split(prompt, bool(body.get("add_special_tokens", True)), namespace)

    def truncated(self, prompt: Prompt, truncation: Truncation, context: int | None) -> Prompt:
        """`prompt` as vLLM truncates it (`truncate_prompt_tokens` kept, -1: `context` less
        one): exact ids, no tail. Unchanged when -1 meets an unknown `context`."""
        keep = truncation.keep if truncation.keep >= 0 else None if context is None else context - 1
        if keep is None:
            return prompt
        ids = self.tokens(prompt)
        if keep >= len(ids):
            return Prompt(tuple(ids))
        return Prompt(tuple(ids[len(ids) - keep :] if truncation.side == "left" else ids[:keep]))

    def tokens(self, prompt: Prompt) -> list[int]:
        """The prompt's exact token ids, as the engine computes them (encodes the tail)."""
        return [*prompt.ids, *self.encoder.encode_tail(prompt.tail)]

    def request_tokens(
        self, body: Mapping[str, Any], chat: bool, namespace: Namespace = None
    ) -> list[int]:
        """The exact token ids of a request's (first) prompt."""
        return self.tokens(self.prompt(body, chat, namespace))

    def chat_text(self, body: Mapping[str, Any]) -> str:
        """A chat request rendered with the model's chat template, as vLLM renders it; raises
        `BadRequest` naming a field vLLM would refuse or when the template fails."""
        return self._chat_text(body, chat_options(body))

    def _chat_text(self, body: Mapping[str, Any], options: ChatOptions) -> str:
        kwargs = options.template_kwargs
        try:  # the tokenizer's "tool_use" template, if it has one, for a request with tools
            template: str = self.hf.get_chat_template(None, kwargs.get("tools"))
        except ValueError as exc:  # the tokenizer has no chat template
            raise BadRequest(400, f"chat template failed: {exc}", "messages") from exc
        conversation = messages(body, as_parts=takes_content_parts(template))
        if not names_developer_role(template):
            conversation = developer_as_system(conversation)
        rendering = {"chat_template": template, "tokenize": False, "return_dict": False}
        try:
            text = self.hf.apply_chat_template(conversation, **{**kwargs, **rendering})
        except Exception as exc:  # jinja raises many types; any is a bad request
            raise BadRequest(400, f"chat template failed: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise BadRequest(400, "chat template did not render text", "messages")
        return text

    @staticmethod
    def hash_ids(
        token_ids: Sequence[int],
        block_tokens: int,
        cache_salt: str | None = None,
        lora: LoraAdapter | None = None,
    ) -> tuple[BlockHash, ...]:
        """Hashes of the full blocks of `token_ids`, as the replicas' connector names them for a
        request with that salt and LoRA adapter (`kvtier.vllm.compat.request_extra`)."""
        name, path = lora or (None, None)
        extra = extra_key(lora=name, lora_path=path, cache_salt=cache_salt)
        return tuple(block_hashes(token_ids, block_tokens, extra))

    def block_hashes(
        self,
        prompt: Prompt,
        block_tokens: int,
        cache_salt: str | None = None,
        lora: LoraAdapter | None = None,
    ) -> tuple[BlockHash, ...]:
        """`hash_ids(prompt.ids)`, memoized by the prompt's head. The ids count in the key tells
        a head encoded with leading special tokens from the same head without them."""
        if prompt.head is None:
            return self.hash_ids(prompt.ids, block_tokens, cache_salt, lora)
        key = (prompt.head, cache_salt, lora, len(prompt.ids), block_tokens)
        hashes = self._hashes.get(key)
        if hashes is None:
            hashes = self._hashes.put(
                key, self.hash_ids(prompt.ids, block_tokens, cache_salt, lora)
            )
        return hashes
