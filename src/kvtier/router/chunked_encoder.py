"""Chunked encoding: text encoded piece by piece, each piece's token ids cached.

Encoding a long prompt whole would take most of the router's time budget, so the router
encodes text in chunks cut where a pre-token always ends (a non-space character followed by a
space or newline) and caches each chunk's ids (LRU): a long shared prefix (a system prompt,
a document, a conversation so far) is encoded once and only the new tail costs anything. For
byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) chunked encoding equals whole encoding;
`ChunkedEncoder` checks that on sample texts at construction and encodes whole texts when a
tokenizer does not pass.

`split` leaves the tail (the text after the last cut, usually new) unencoded for routing, and
memoizes the head's ids, so a request repeating a known document or conversation skips even the
per-chunk lookups. Used on the router's event loop only (not thread-safe).

Both caches are keyed by a namespace as well as the text: the tenant's cache salt, or None for
the shared namespace (no API keys, keys without a tenant, shared tenants). A hit answers faster
than a miss, so a cache shared across tenants would tell one tenant whether another recently
sent a text (a request failing right after tokenizing answered in ~1 ms for a known text,
~24 ms for a new one); per namespace, a tenant only ever hits its own texts. One budget bounds
all namespaces together (memory as before), least recently used first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvtier.core.lru import Lru

__all__ = ["HEAD_CHARS", "SELF_CHECK", "ChunkedEncoder", "Namespace"]

Namespace = str | None
"""Whose cached texts a lookup may hit: a tenant's cache salt, None for the shared namespace."""

HEAD_CHARS = 4_000_000
"""Characters of recent prompt heads memoized with their ids (and, by the tokenizer, with their
block hashes)."""

# A non-space followed by whitespace: byte-level BPE pre-tokens never span it. Whitespace is
# Unicode's White_Space set, as the pre-tokenizers' \s; Python's \s also takes U+001C-U+001F,
# which a pre-token may hold.
_SPACE = "\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_BOUNDARY = re.compile(f"(?<=[^{_SPACE}])(?=[{_SPACE}])")
SELF_CHECK = (
    "Hello world.\n\nThis is  a test\twith tabs\n   indented line\n\n\nend 12345 x",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n",
    "Ünïcödé — dashes, ‘quotes’, emoji 🙂 and 中文字符 mixed;  done.\r\n next\u00a0line",
    "def f(x):\n    return x ** 2  # comment\n\nprint(f(3))\n",
    "separators!\x1d!inside\x1c words \x1f and\x1e between",
)
"""Texts on which chunked encoding must equal whole encoding for a tokenizer to be chunked."""


class ChunkedEncoder:
    """Encodes text chunk by chunk with an LRU cache of chunk ids (see the module docstring).

    `encode` is the tokenizer's own encode without special tokens; chunks are at least
    `min_chars` long, cut at the first pre-token boundary after that, so two prompts sharing a
    prefix cut it identically. Cached ids are per `namespace` (see the module docstring).
    """

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        min_chars: int = 256,
        max_chunks: int = 4096,
        max_head_chars: int = HEAD_CHARS,
    ) -> None:
        self._encode = encode
        self.min_chars = min_chars
        self._chunks: Lru[tuple[Namespace, str], list[int]] = Lru(max_chunks)
        """Ids of chunks, by (namespace, chunk)."""
        self._heads: Lru[tuple[Namespace, str], tuple[int, ...]] = Lru(
            max_head_chars, lambda key, _: len(key[1])
        )
        """Ids of whole heads (text up to the last cut) of recent prompts, by (namespace,
        head)."""
        self.encoded_chunks = 0
        """Chunks encoded so far (cache misses), for tests and tuning."""
        self.exact = all(self._joined(t, 1, None) == encode(t) for t in SELF_CHECK)
        self._chunks.clear()
        self.encoded_chunks = 0

    def __call__(self, text: str, namespace: Namespace = None) -> list[int]:
        if not self.exact or len(text) < 2 * self.min_chars:
            return self._encode(text)
        return self._joined(text, self.min_chars, namespace)

    def _joined(self, text: str, min_chars: int, namespace: Namespace) -> list[int]:
        ids, tail = self._chunked(text, min_chars, namespace)
        return ids + self.encode_tail(tail)

    def encode_tail(self, tail: str) -> list[int]:
        """Ids of a tail `split` left unencoded."""
        return self._encode(tail) if tail else []

    def split(self, text: str, namespace: Namespace = None) -> tuple[tuple[int, ...], str, str]:
        """Ids of `text` up to its last chunk cut, that text (the head), and the rest (the
        tail) unencoded. The ids of a memoized head are the memo's own (immutable) tuple."""
        if not self.exact or len(text) < 2 * self.min_chars:
            return tuple(self._encode(text)), text, ""
        cuts = self._cuts(text, self.min_chars)
        end = cuts[-1] if cuts else 0
        tail = text[end:]
        if len(tail) > 2 * self.min_chars:  # few places to cut: routing needs its blocks
            return (*self._chunk_ids(text, cuts, namespace), *self._encode(tail)), text, ""
        head = text[:end]
        key = (namespace, head)
        ids = self._heads.get(key)
        if ids is None:
            ids = self._heads.put(key, tuple(self._chunk_ids(head, cuts, namespace)))
        return ids, head, tail

    def _chunked(self, text: str, min_chars: int, namespace: Namespace) -> tuple[list[int], str]:
        cuts = self._cuts(text, min_chars)
        return self._chunk_ids(text, cuts, namespace), text[cuts[-1] if cuts else 0 :]

    @staticmethod
    def _cuts(text: str, min_chars: int) -> list[int]:
        cuts = []
        start = 0
        while (cut := _BOUNDARY.search(text, start + min_chars)) is not None:
            start = cut.start()
            cuts.append(start)
        return cuts

    def _chunk_ids(self, text: str, cuts: list[int], namespace: Namespace) -> list[int]:
        """Ids of `text` up to its last cut, chunk by chunk (the tail after it is usually new:
        not worth caching)."""
        ids: list[int] = []
        start = 0
        for cut in cuts:
            ids += self._chunk(text[start:cut], namespace)
            start = cut
        return ids

    def _chunk(self, chunk: str, namespace: Namespace) -> list[int]:
        key = (namespace, chunk)
        ids = self._chunks.get(key)
        if ids is None:
            self.encoded_chunks += 1
            ids = self._chunks.put(key, self._encode(chunk))
        return ids
