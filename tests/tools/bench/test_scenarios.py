import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvtier.core.errors import ConfigError
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.bench.scenarios import (
    ChatShape,
    RagShape,
    TraceShape,
    chat_sessions,
    rag_sessions,
    trace_sessions,
)
from kvtier.tools.bench.workload import _Seen
from kvtier.tools.embedded_model import resolve_model


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(AutoTokenizer.from_pretrained(resolve_model(None)))


def test_documents_are_deterministic_and_distinct(corpus: Corpus) -> None:
    assert corpus.document(200, seed=1) == corpus.document(200, seed=1)
    assert corpus.document(200, seed=1) != corpus.document(200, seed=2)
    assert abs(len(corpus.encode(corpus.document(500, seed=3))) - 500) <= 25


def test_chat_sessions_share_the_system_prompt_and_differ_per_user(corpus: Corpus) -> None:
    sessions = chat_sessions(corpus, ChatShape(users=3, rounds=2))
    assert len({s.system for s in sessions}) == 1
    assert len({s.turns[0].content for s in sessions}) == 3
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions)
    assert sessions == chat_sessions(corpus, ChatShape(users=3, rounds=2))


def test_each_user_opens_with_a_document_of_their_own(corpus: Corpus) -> None:
    sessions = chat_sessions(corpus, ChatShape(users=2, rounds=2, document_tokens=400))
    first, later = (
        len(corpus.encode(s.turns[r].content or "")) for r in (0, 1) for s in sessions[:1]
    )
    assert first - later >= 350
    docs = {(s.turns[0].content or "").split("\n\n")[0] for s in sessions}
    assert len(docs) == 2
    plain = chat_sessions(corpus, ChatShape(users=2, rounds=2, document_tokens=0))
    assert not (plain[0].turns[0].content or "").startswith("My document")


def test_rag_questions_reuse_a_few_documents(corpus: Corpus) -> None:
    sessions = rag_sessions(corpus, RagShape(documents=2, document_tokens=300, questions=6))
    docs = {str(s.turns[0].content).split("\n\nQuestion:")[0] for s in sessions}
    assert len(docs) == 2


def test_trace_keeps_the_prefix_structure(corpus: Corpus, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 4000, "input_length": 1024, "output_length": 5, "hash_ids": [4, 5]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    shape = TraceShape(tokens_per_block=64, time_scale=0.5)
    a, b, c = (s.turns[0].prompt_ids for s in trace_sessions(corpus, trace, shape))
    assert (len(a), len(b), len(c)) == (128, 192, 128)
    assert b[:128] == a and c[:64] != a[:64]
    assert [s.start_s for s in trace_sessions(corpus, trace, shape)] == [0.0, 1.0, 2.0]


def test_unreadable_trace_is_a_config_error(corpus: Corpus, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable Mooncake JSONL trace"):
        trace_sessions(corpus, bad, TraceShape())


def test_reusable_tokens_are_full_blocks_already_sent() -> None:
    seen = _Seen(block_tokens=4)
    assert seen.reusable(list(range(10))) == 0  # nothing sent before
    assert seen.reusable(list(range(10))) == 8  # 2 full blocks; the last token is computed
    assert seen.reusable(list(range(9))) == 8
    assert seen.reusable([99] + list(range(1, 10))) == 0  # first block differs: chain breaks
