"""Varied real English text for prompts, available offline and identical on every machine.

Benchmarks need prompts of exact token lengths whose content differs between documents (so
blocks don't collide by accident) and reads like real text (so tokenization is realistic). The
docstrings of the Python standard library are such a corpus: they ship with every interpreter.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Sequence
from functools import lru_cache

_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http",
    "inspect",
    "itertools",
    "json",
    "logging",
    "multiprocessing",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "unittest",
    "urllib",
    "uuid",
    "zipfile",
)


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """Every docstring paragraph of a fixed list of stdlib modules, in a fixed order."""
    found: list[str] = []
    for name in _MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        for _, member in sorted(vars(module).items()):
            if inspect.isclass(member) or inspect.isfunction(member):
                docs.append(inspect.getdoc(member) or "")
        for doc in docs:
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 80:
                    found.append(para)
    return tuple(dict.fromkeys(found))  # de-duplicated, order kept


class Corpus:
    """Draws documents of an exact token length from the stdlib text."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._paras = paragraphs()

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids)))  # type: ignore[attr-defined]

    def document(self, n_tokens: int, seed: int) -> str:
        """Text of about `n_tokens` tokens; distinct seeds give distinct documents."""
        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += self.encode(rng.choice(self._paras) + "\n\n")
        return self.decode(ids[:n_tokens])
