"""Router-side tokenization: chunked, cached encoding equals the tokenizer's own; chat prompts
equal vLLM's own rendering."""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.keys import block_hashes, extra_key
from kvtier.core.lru import Lru
from kvtier.router.chat_template import takes_content_parts
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


def test_cached_chunks_and_heads_are_per_namespace(
    tokenizer: Tokenizer, whole: Callable[[str], list[int]]
) -> None:
    """A cache hit answers sooner than a miss: one tenant's texts must never be another's hits
    (a timing oracle), while a tenant's own repeat, and the shared namespace's, still hit."""
    encoder = ChunkedEncoder(whole, min_chars=100)
    text = Corpus(tokenizer.hf).document(800, 3) + "\nQuestion: which one?"
    split = encoder.split(text, "t-alpha")
    chunks = encoder.encoded_chunks  # the head's chunks, all new
    assert chunks > 1
    assert encoder.split(text, "t-alpha") == split and encoder.encoded_chunks == chunks
    assert encoder.split(text, "t-bravo") == split  # another tenant: every chunk afresh
    assert encoder.encoded_chunks == 2 * chunks
    assert encoder.split(text, None) == split  # the shared namespace is a namespace too
    assert encoder.encoded_chunks == 3 * chunks
    assert encoder.split(text) == split and encoder.encoded_chunks == 3 * chunks
    # chunk by chunk (`__call__`), not only through the heads' memo
    assert encoder(text, "t-charlie") == whole(text) and encoder.encoded_chunks == 4 * chunks
    assert encoder(text, "t-charlie") == whole(text) and encoder(text, "t-alpha") == whole(text)
    assert encoder.encoded_chunks == 4 * chunks


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


def test_a_lora_adapters_blocks_are_hashed_and_memoized_apart_from_the_base_models(
    tokenizer: Tokenizer,
) -> None:
    tok = tokenizer
    head = Corpus(tok.hf).document(1200, 9)
    prompt = tok.prompt({"prompt": head + "\nQuestion: lora?"}, chat=False)
    sql = ("sql", "/adapters/sql")
    adapter = tok.block_hashes(prompt, 16, "salt", lora=sql)  # memoized first
    extra = extra_key(lora="sql", lora_path="/adapters/sql", cache_salt="salt")
    assert adapter == tuple(block_hashes(prompt.ids, 16, extra))
    assert tok.block_hashes(prompt, 16, "salt") == tuple(
        block_hashes(prompt.ids, 16, extra_key(cache_salt="salt"))
    )
    others = [("sql2", "/adapters/sql"), ("sql", "/adapters/sql-v2")]  # another name, new weights
    assert all(
        tok.block_hashes(prompt, 16, lora=sql) != tok.block_hashes(prompt, 16, lora=o)
        for o in others
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


# --- The chat prompt as vLLM 0.32's OpenAI server renders it: its own code, in-process ---

AGENT_TEMPLATE = r"""
{%- set ns = namespace(system='You are a coding agent.') -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content -%}
{%- endif -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.system is string %}{{ ns.system }}
{%- else %}{{ ns.system | map(attribute='text') | join('') }}{% endif -%}
{%- if tools %}{{ '\n\n# Tools' }}
  {%- for tool in tools %}{{ '\n' ~ tool | tojson }}{% endfor -%}
{%- endif -%}
{%- if documents %}{{ '\n\n# Documents' }}
  {%- for doc in documents %}{{ '\n[' ~ loop.index ~ '] ' ~ doc | tojson }}{% endfor -%}
{%- endif -%}
{%- if reasoning_effort is defined %}{{ '\nEffort: ' ~ reasoning_effort | tojson }}{% endif -%}
{%- if enable_thinking is defined %}{{ '\nThinking: ' ~ enable_thinking | tojson }}{% endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
  {%- if not (loop.first and message.role == 'system') -%}
    {{- '<|im_start|>' ~ ('system' if message.role == 'DEVELOPER_ROLE' else message.role) -}}
    {%- for key in ['name', 'tool_call_id', 'task', 'tools'] -%}
      {%- if message[key] is defined %}{{ ' ' ~ key ~ '=' ~ message[key] | tojson }}{% endif -%}
    {%- endfor -%}
    {{- '\n' -}}
    {%- if message.reasoning_content is defined -%}
      {{- '<think>' ~ message.reasoning_content ~ '|' ~ message.reasoning ~ '</think>\n' -}}
    {%- endif -%}
    CONTENT
    {%- for call in message.tool_calls or [] -%}
      {{- '\n[TOOL_CALL]' ~ call.function | tojson ~ ' id=' ~ call.id -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""
"""A Qwen-/Mistral-like agent template (written for these tests): tools, documents, reasoning,
tool calls (the function object as JSON, Mistral-style, its arguments a mapping), names and
tool call ids."""

CONTENT_AS_TEXT = "{{- message.content -}}"
CONTENT_AS_PARTS = """\
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}{{ part | tojson }}{% endfor %}{% endif -%}"""

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": True,  # as the OpenAI Agents SDK sends its function tools
    },
}
RUN_SHELL = {  # no description, an unknown field (as some gateways add), deferred loading
    "type": "function",
    "defer_loading": True,
    "cache_control": {"type": "ephemeral"},
    "function": {"name": "run_shell", "parameters": {"type": "object", "properties": {}}},
}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call as a client sends it back (arguments as a JSON string)."""
    return {
        "type": "function",
        "id": call_id,
        "function": {"name": name, "arguments": arguments},
    }


AGENT_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent. Use the tools."},
    {"role": "user", "content": "Why does the build fail?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            tool_call("call_1", "read_file", '{"path": "Makefile"}'),
            tool_call("call_2", "run_shell", '{"command": "make 2>&1 | tail", "timeout": 30}'),
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "all:\n\tcc main.c"},
    {"role": "tool", "tool_call_id": "call_2", "content": "main.c:3: error: expected ';'"},
    {"role": "assistant", "content": "A semicolon is missing on line 3 of main.c."},
    {"role": "user", "content": "Fix it."},
]

CHAT_CASES: dict[str, dict[str, Any]] = {
    # tools as vLLM's request model dumps them: description/parameters null when left out,
    # strict and defer_loading only when given, unknown fields dropped
    "tools": {"messages": AGENT_TURNS[:2], "tools": [READ_FILE, RUN_SHELL]},
    # assistant tool calls: JSON-string arguments decoded to mappings
    "tool-calls": {"messages": AGENT_TURNS, "tools": [READ_FILE, RUN_SHELL]},
    # arguments vLLM coerces to {} rather than failing every later turn
    "tool-call-arguments-coerced": {
        "messages": [
            AGENT_TURNS[1],
            {
                "role": "assistant",
                "content": "Trying.",
                "tool_calls": [
                    tool_call("a", "run_shell", '{"command": "ls"'),  # cut off
                    tool_call("b", "run_shell", "[1, 2]"),  # not an object
                    tool_call("c", "run_shell", ""),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "?"},
            {"role": "assistant", "content": "Done.", "tool_calls": []},  # empty: dropped
        ]
    },
    # reasoning in the history: `reasoning` or the older `reasoning_content`, both given to
    # the template under both names; dropped from other roles
    "reasoning-history": {
        "messages": [
            {"role": "user", "content": "2+2?", "reasoning_content": "not mine"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning": "Add again.", "tool_calls": None},
            {"role": "user", "content": "Thanks."},
        ]
    },
    # request fields vLLM passes to the template, merged with chat_template_kwargs (the request
    # fields win; None and "auto" values are dropped)
    "template-arguments": {
        "messages": [{"role": "user", "content": "Summarize the documents."}],
        "reasoning_effort": "low",
        "documents": [{"title": "README", "text": "kvtier caches KV blocks."}],
        "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": None},
    },
    # chat_template_kwargs' own "tools" win over the request's (and go to the template as sent)
    "thinking-off": {
        "messages": [{"role": "user", "content": "Quick answer."}],
        "tools": [READ_FILE],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"documents": "auto", "tools": [RUN_SHELL["function"]]},
    },
    # developer messages: system messages for a template that does not name the role, merged
    # with the other system messages into one first message
    "developer": {
        "messages": [
            {"role": "developer", "content": "Answer tersely.", "name": "policy"},
            AGENT_TURNS[1],
            {"role": "assistant", "content": "Which build?"},
            {"role": "developer", "content": [{"type": "text", "text": "Prefer make."}]},
            {"role": "user", "content": "The C one."},
        ]
    },
    # Claude-Code-like traffic through the OpenAI API: the billing header line in the system
    # prompt (vLLM drops it), parts with cache_control, tool results as parts
    "claude-code": {
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f2"},
                    {
                        "type": "text",
                        "text": "You are Claude Code.",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "List the files.",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Listing."}],
                "tool_calls": [tool_call("toolu_1", "run_shell", '{"command": "ls"}')],
            },
            {
                "role": "tool",
                "tool_call_id": "toolu_1",
                "content": [{"type": "text", "text": "Makefile"}, {"type": "text", "text": ""}],
            },
        ],
        "tools": [RUN_SHELL],
    },
    # content parts vLLM renders as text: plain strings, empty parts (dropped when joined),
    # output_text, refusal, thinking and tool_reference parts
    "content-parts": {
        "messages": [
            {"role": "user", "content": ["Look:", {"type": "text", "text": ""}, "twice"]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Hmm."},
                    {"type": "output_text", "text": "Seen."},
                    {"type": "refusal", "refusal": "No more."},
                ],
            },
            {"role": "user", "content": [{"type": "tool_reference", "name": "run_shell"}]},
        ]
    },
    # names (and tasks) on any role, tool_call_id on tool messages only, other fields dropped
    "names": {
        "messages": [
            {"role": "user", "content": "Hi.", "name": "alice", "tool_call_id": "x", "task": "t"},
            {"role": "assistant", "content": "Hello.", "name": "bot", "refusal": None},
            {"role": "tool", "content": "ok", "tool_call_id": "t1", "name": "run_shell"},
        ]
    },
}

AGENT_TEMPLATES = {
    # content as parts (vLLM's "openai" content format); no developer role
    "agent-parts": AGENT_TEMPLATE.replace("CONTENT", CONTENT_AS_PARTS),
    # content as text (vLLM's "string" format); names the developer role
    "agent-text": AGENT_TEMPLATE.replace("CONTENT", CONTENT_AS_TEXT).replace(
        "DEVELOPER_ROLE", "developer"
    ),
}


@pytest.fixture(scope="module")
def chat_models(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tokenizer directories by name: the embedded model (SmolLM2's template: text only, no
    tools) and copies of its tokenizer with the agent templates."""
    dirs = {"smollm": model_dir}
    for name, template in AGENT_TEMPLATES.items():
        path = tmp_path_factory.mktemp(name)
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(model_dir) / file, path / file)
        (path / "chat_template.jinja").write_text(template)
        dirs[name] = str(path)
    return dirs


class VllmChat:
    """vLLM's own chat preprocessing for a tokenizer directory, as its OpenAI server runs it
    (`ChatCompletionRequest` validation, then `OnlineRenderer.render_chat`), with no engine."""

    def __init__(self, model_dir: str) -> None:
        from kvtier.vllm.launch import patch_vllm_cpu

        patch_vllm_cpu()
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import renderer_from_config

        config = ModelConfig(model=model_dir, tokenizer=model_dir)
        self.renderer = OnlineRenderer(
            config,
            renderer_from_config(VllmConfig(model_config=config)),
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            enable_auto_tools=True,  # tool_choice "auto" (the default with tools) is accepted
        )

    def tokens(self, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids; raises what vLLM raises for a request it refuses."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(**copy.deepcopy({"model": "m", **body}))
        rendered = asyncio.run(self.renderer.render_chat(request))
        if not isinstance(rendered, tuple):
            raise ValueError(rendered)  # an ErrorResponse
        _, (prompt,) = rendered
        return list(prompt["prompt_token_ids"])  # type: ignore[typeddict-item]  # decoder-only


@pytest.fixture(scope="module")
def vllm_chat(chat_models: dict[str, str]) -> dict[str, VllmChat]:
    return {name: VllmChat(path) for name, path in chat_models.items()}


@pytest.fixture(scope="module")
def router_chat(chat_models: dict[str, str]) -> dict[str, Tokenizer]:
    return {name: Tokenizer(path) for name, path in chat_models.items()}


CHAT_MATRIX = [
    (case, model)
    for case in CHAT_CASES
    for model in ("smollm", *AGENT_TEMPLATES)
    if model != "smollm" or case in {"developer", "claude-code", "content-parts"}
]
"""(case, model) pairs where the case changes the prompt (SmolLM2's template renders text only)."""


@pytest.mark.parametrize(("case", "model"), CHAT_MATRIX)
def test_chat_tokens_equal_vllms_for_agent_traffic(
    case: str, model: str, vllm_chat: dict[str, VllmChat], router_chat: dict[str, Tokenizer]
) -> None:
    body = CHAT_CASES[case]
    pristine = copy.deepcopy(body)
    expected = vllm_chat[model].tokens(body)
    assert router_chat[model].request_tokens(body, chat=True) == expected
    assert body == pristine  # the router leaves the request as it came


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0]"),
        ({"reasoning_effort": "maximal"}, "reasoning_effort"),
        ({"documents": "README"}, "documents"),
        (
            {
                "messages": [
                    AGENT_TURNS[1],
                    {"role": "assistant", "tool_calls": tool_call("x", "f", "")},
                ]
            },
            "messages[1].tool_calls",
        ),
        (
            {
                "messages": [
                    AGENT_TURNS[1],
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "id": "x", "function": {"name": "f"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    AGENT_TURNS[1],
                    {"role": "assistant", "tool_calls": [tool_call("x", "f", {"a": 1})]},  # type: ignore[arg-type]
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    AGENT_TURNS[1],
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "custom", "id": "x", "custom": {"name": "f"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_chat_requests_vllm_refuses_are_a_400_naming_the_field(
    body: dict[str, Any], param: str, vllm_chat: dict[str, VllmChat], tokenizer: Tokenizer
) -> None:
    request = {"messages": AGENT_TURNS[:2], **body}
    with pytest.raises(Exception):  # noqa: B017 (pydantic's or vLLM's own validation error)
        vllm_chat["smollm"].tokens(request)
    with pytest.raises(BadRequest) as err:
        tokenizer.request_tokens(request, chat=True)
    assert (err.value.status, err.value.param) == (400, param)


DETECTION_TEMPLATES = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% for c in m.tool_calls %}{{ c.id }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% set turns = messages[1:] %}{% for m in turns %}"
    "{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}"
    "{% endfor %}",
    "{% for m in messages %}{% set content = m.content %}"
    "{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(x, c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(1, c=m.content) }}{% endfor %}",
    "{% macro show(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}"
    "{{ show([1]) }}",
    "{% for a, b in messages %}{{ a }}{% endfor %}{% for p in content %}{% endfor %}",
    "{% for m in messages %}{{ m.content }",  # not a template: vLLM's default
    *AGENT_TEMPLATES.values(),
]


@pytest.mark.parametrize("template", DETECTION_TEMPLATES)
def test_content_format_is_detected_as_vllm_detects_it(template: str) -> None:
    """Whether a template gets message content as a list of parts (vLLM's "openai" format) or
    as text, decided from the template's syntax tree as vLLM decides it."""
    from kvtier.vllm.launch import patch_vllm_cpu

    patch_vllm_cpu()
    from vllm.renderers.hf import _detect_content_format

    vllm_format = _detect_content_format(template, default="string")
    assert takes_content_parts(template) == (vllm_format == "openai")
