"""A RAG query laid out as a union-free schema prompt: the same positions a PML prompt of that shape gets."""

from __future__ import annotations

import pytest

from pc_rag.errors import PCRagError
from pc_rag.layout import layout_schema
from pc_rag.plan import plan_prompt
from pc_rag.pml.parser import parse_prompt, parse_schema
from pc_rag.rag import RagEngine
from pc_rag.rag.chunk import Chunk
from pc_rag.rag.query_layout import layout_query

HEAD = ("Answer from the passages.\n", [1, 2, 3])
CHUNKS = [("Paris is in France.\n", [4, 5, 6, 7]), ("Rome is in Italy.\n", [8, 9]), ("Oslo.\n", [10])]
QUESTION = ("Which city is in Italy?", [11, 12, 13])


def test_chunks_follow_the_preamble_each_in_its_own_slot_and_the_question_after_them() -> None:
    query = layout_query(HEAD, CHUNKS, QUESTION)
    assert query.head == 3
    assert query.slots() == [(3, 4), (7, 2), (9, 1)]
    assert query.chunks_end == 10
    assert query.plan.new_positions == (10, 11, 12) and query.plan.next_position == 13
    assert query.full_ids() == list(range(1, 14))
    assert all(query.layout.spans[n].union is None for n in query.chunks)


def test_it_is_the_plan_of_the_equivalent_pml_prompt() -> None:
    """The same schema written in PML and tokenized by the same table gets the same spans and plan."""
    table = dict([HEAD, *CHUNKS, QUESTION])
    modules = "".join(f"<module name='chunk{i}'>{text}</module>" for i, (text, _) in enumerate(CHUNKS))
    schema = parse_schema(f"<schema name='rag-query'>{HEAD[0]}{modules}</schema>")
    imports = "".join(f"<chunk{i}/>" for i in range(len(CHUNKS)))
    prompt = parse_prompt(f"<prompt schema='rag-query'>{imports}{QUESTION[0]}</prompt>")
    layout = layout_schema(schema, lambda t: list(table[t]), lambda: None)
    plan = plan_prompt(prompt, layout, lambda t: list(table[t]), None, add_generation_prompt=False)
    query = layout_query(HEAD, CHUNKS, QUESTION)
    assert [(s.token_ids, s.positions) for s in layout.spans.values()] == [
        (s.token_ids, s.positions) for s in query.layout.spans.values()
    ]
    assert plan == query.plan


def test_a_chunk_whose_kv_and_ids_disagree_is_refused(tokenizer) -> None:
    from conftest import tiny_model

    engine = RagEngine(tiny_model("llama", tokenizer))
    chunk = engine.encode(["Paris is in France."])[0]
    with pytest.raises(PCRagError, match="KV holds"):
        Chunk(chunk.text, chunk.token_ids[:-1], chunk.kv, chunk.conditioned)
