"""Router-side tokenization: chunked, cached encoding equals the tokenizer's own."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.core.lru import Lru
from kvtier.router.chunked_encoder import ChunkedEncoder
from kvtier.router.openai_request import BadRequest, Truncation
from kvtier.router.tokenizer import Prompt, Tokenizer
from kvtier.tools.bench.corpus import Corpus


@pytest.fixture(scope="module")
def whole(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    """The tokenizer's own encoding of a whole text, without special tokens."""
    return lambda text: list(tokenizer.hf.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("seed", range(6))
def test_chunked_encoding_equals_whole_encoding_on_real_text(
    seed: int, tokenizer: Tokenizer, whole: Callable[[str], list[int]]
) -> None:
    corpus = Corpus(tokenizer.hf)
    text = corpus.document(1500, seed) + "\n\nQuestion:   what   now?\t\n  "
    encoder = ChunkedEncoder(whole, min_chars=64)
    assert encoder.exact
    assert encoder(text) == whole(text)
    assert encoder(text) == whole(text)  # again, from the cache


def test_a_shared_prefix_is_encoded_once_and_only_new_tails_cost(
    tokenizer: Tokenizer, whole: Callable[[str], list[int]]
) -> None:
    calls: list[str] = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return whole(text)

    encoder = ChunkedEncoder(counting, min_chars=100)
    calls.clear()  # the self-check's calls
    prefix = Corpus(tokenizer.hf).document(800, 1)
    encoder(prefix + " first question?")
    first_calls = len(calls)
    calls.clear()
    assert encoder(prefix + " second question?") == whole(prefix + " second question?")
    assert len(calls) == 1 and first_calls > 1  # only the tail was encoded


@pytest.mark.parametrize("chat", [False, True])
def test_routing_leaves_only_the_tail_unencoded_and_names_blocks_exactly(
    chat: bool, tokenizer: Tokenizer
) -> None:
    tok = tokenizer
    text = Corpus(tok.hf).document(1200, 7) + "\nQuestion: which item comes next?"
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    exact = tok.request_tokens(body, chat)
    prompt = tok.prompt(body, chat)
    assert 0 < len(prompt.tail) <= 2 * 256 and tuple(exact[: len(prompt.ids)]) == prompt.ids
    assert tok.tokens(prompt) == exact and len(exact) <= prompt.max_tokens
    assert abs(prompt.estimated_tokens - len(exact)) <= 20
    full, routed = tok.hash_ids(exact, 16), tok.hash_ids(prompt.ids, 16)
    assert routed == full[: len(routed)] and len(routed) == len(prompt.ids) // 16


def test_a_repeated_head_skips_the_chunks_and_hashes_its_blocks_as_hashing_does(
    tokenizer: Tokenizer,
) -> None:
    tok = tokenizer
    document = Corpus(tok.hf).document(1200, 8)
    first = tok.prompt({"prompt": document + "\nQuestion: one?"}, chat=False)
    encoded = tok.encoder.encoded_chunks
    repeat = tok.prompt({"prompt": document + "\nQuestion: two?"}, chat=False)
    assert repeat.head == first.head and repeat.ids == first.ids
    assert tok.encoder.encoded_chunks == encoded  # no chunk was encoded again
    assert repeat.ids is first.ids  # the memo's own ids, immutable: shared, never copied
    for salt in (None, "tenant-a"):
        assert tok.block_hashes(first, 16, salt) == tok.hash_ids(first.ids, 16, salt)
        assert tok.block_hashes(first, 16, salt) == tok.block_hashes(
            tok.prompt({"prompt": document + "\nQuestion: four?"}, chat=False), 16, salt
        )
    assert tok.block_hashes(first, 16) != tok.block_hashes(first, 16, "tenant-a")
    assert tok.block_hashes(first, 32) == tok.hash_ids(first.ids, 32)  # the block size counts
    # the same head after a leading special token (a BOS; this tokenizer adds none itself)
    with_bos = Prompt((1, *first.ids), first.tail, first.head)
    assert (
        tok.block_hashes(with_bos, 16)
        == tok.hash_ids(with_bos.ids, 16)
        != tok.block_hashes(first, 16)
    )


def test_memo_keeps_recent_entries_within_its_cost_budget() -> None:
    memo: Lru[str, int] = Lru(10, lambda key, _: len(key))
    memo.put("aaaa", 1)
    memo.put("bbbb", 2)
    assert memo.get("aaaa") == 1  # now the most recent
    memo.put("cccc", 3)  # over budget: the least recent ("bbbb") goes
    assert memo.get("bbbb") is None and memo.get("aaaa") == 1 and memo.get("cccc") == 3
    assert memo.put("x" * 11, 4) == 4 and memo.get("x" * 11) is None  # larger than the budget


def test_text_with_nowhere_to_cut_is_encoded_whole_for_routing(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    body = {"prompt": "word " + "x" * 3000}
    prompt = tok.prompt(body, chat=False)
    assert prompt.tail == "" and list(prompt.ids) == tok.request_tokens(body, chat=False)


def test_a_tokenizer_failing_the_self_check_is_used_whole() -> None:
    def marked(text: str) -> list[int]:  # SentencePiece-like: a marker at every start
        return [1] + [ord(c) for c in text]

    encoder = ChunkedEncoder(marked, min_chars=4)
    assert not encoder.exact
    text = "some words here and there " * 20
    assert encoder(text) == marked(text)


def test_chat_tokens_render_tools_and_text_parts(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    plain = tok.request_tokens({"messages": [{"role": "user", "content": "a\nb"}]}, chat=True)
    parts = tok.request_tokens(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {}},
                        {"type": "text", "text": "b"},
                    ],
                }
            ]
        },
        chat=True,
    )
    assert parts == plain
    as_input_output = tok.request_tokens(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "output_text", "text": "b"},
                    ],
                }
            ]
        },
        chat=True,
    )
    assert as_input_output == plain  # the Responses API's part types are text to vLLM too
    with pytest.raises(BadRequest) as err:
        tok.request_tokens({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, chat=True)
    assert (err.value.status, err.value.param) == (400, "messages[0].content")


def test_completion_prompt_forms(tokenizer: Tokenizer) -> None:
    tok = tokenizer
    assert tok.request_tokens({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert tok.request_tokens({"prompt": [[5, 6], [7]]}, chat=False) == [5, 6]
    assert tok.request_tokens({"prompt": ["hello", "x"]}, chat=False) == tok.request_tokens(
        {"prompt": "hello"}, chat=False
    )
    for bad in ([], [True], [-1], [[1], "x"], {"a": 1}):
        with pytest.raises(BadRequest):
            tok.request_tokens({"prompt": bad}, chat=False)


def test_information_separators_are_no_place_to_cut(
    tokenizer: Tokenizer, whole: Callable[[str], list[int]]
) -> None:
    """U+001C-U+001F are whitespace to Python's \\s, not to the pre-tokenizer: a cut before one
    would split a pre-token and name blocks the engine never computes."""
    text = "z" * 300 + "!\x1d!" + " tail words" * 60
    assert tokenizer.encoder.exact
    assert tokenizer.tokens(tokenizer.prompt({"prompt": text}, chat=False)) == whole(text)


def test_chat_template_kwargs_repeating_a_request_field_are_overridden_by_it(
    tokenizer: Tokenizer,
) -> None:
    """As in vLLM: the request's own fields win over the same keys in chat_template_kwargs."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = tokenizer.request_tokens(chat, chat=True)
    for key, value in (("add_generation_prompt", False), ("continue_final_message", True)):
        body = {**chat, "chat_template_kwargs": {key: value}}
        assert tokenizer.request_tokens(body, chat=True) == plain


@pytest.mark.parametrize(
    ("keep", "side", "context", "expected"),
    [
        (3, "left", None, [7, 8, 9]),
        (3, "right", None, [5, 6, 7]),
        (10, "left", None, [5, 6, 7, 8, 9]),
        (0, "left", None, []),
        (-1, "left", 4, [7, 8, 9]),  # the context length less one
        (-1, "left", None, [5, 6, 7, 8, 9]),  # no context length known: left as is
    ],
)
def test_truncation_keeps_what_vllm_keeps(
    tokenizer: Tokenizer, keep: int, side: str, context: int | None, expected: list[int]
) -> None:
    prompt = tokenizer.prompt({"prompt": [5, 6, 7, 8, 9]}, chat=False)
    cut = tokenizer.truncated(prompt, Truncation(keep, side), context)
    assert tokenizer.tokens(cut) == expected
