"""Chunk orders on hand-checked lists, against LlamaIndex's LongContextReorder, and through the store's answers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_document_store import make_store

from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.order import ORDERS, reorder
from pc_rag.server.prompt_server import PromptServer

QUESTION = "Which mountain is the highest of Japan?"


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


@pytest.mark.parametrize(
    ("order", "n", "expected"),
    [
        ("best-first", 5, [1, 2, 3, 4, 5]),
        ("best-last", 5, [5, 4, 3, 2, 1]),
        ("lost-in-the-middle", 5, [1, 3, 5, 4, 2]),  # odd count: the best first, the second best last
        ("lost-in-the-middle", 4, [2, 4, 3, 1]),  # even count: the best last, the second best first
        ("lost-in-the-middle", 10, [2, 4, 6, 8, 10, 9, 7, 5, 3, 1]),
        ("lost-in-the-middle", 1, [1]),
        ("best-last", 0, []),
    ],
)
def test_orders_lay_out_ranks(order: str, n: int, expected: list[int]) -> None:
    ranked = list(range(1, n + 1))
    assert reorder(ranked, order) == expected
    assert ranked == list(range(1, n + 1))  # the ranking itself is left alone


@pytest.mark.parametrize("n", [1, 2, 5, 6, 10])
def test_lost_in_the_middle_is_llama_index_long_context_reorder(n: int) -> None:
    postprocessor = pytest.importorskip("llama_index.core.postprocessor")
    from llama_index.core.schema import NodeWithScore, TextNode

    ranked = [NodeWithScore(node=TextNode(id_=str(rank), text=str(rank)), score=1.0 / rank) for rank in range(1, n + 1)]
    theirs = postprocessor.LongContextReorder().postprocess_nodes(ranked)
    assert [x.node.node_id for x in reorder(ranked, "lost-in-the-middle")] == [x.node.node_id for x in theirs]


def test_unknown_order_is_refused_with_the_known_names() -> None:
    with pytest.raises(PCRagError, match="unknown chunk order 'worst-first'; known orders: best-first, best-last"):
        reorder([1, 2], "worst-first")


@pytest.mark.parametrize("order", ORDERS)
def test_store_answers_from_chunks_laid_out_in_the_order(tmp_path, engine: RagEngine, order: str) -> None:
    store = make_store(tmp_path, engine, mode="prefix")
    ranked = store.search(QUESTION, k=3)
    assert len(ranked) == 3 and store.search(QUESTION, k=3, order=order) == reorder(ranked, order)
    server = PromptServer(store=store)
    answer = server.answer(QUESTION, k=3, order=order, max_new_tokens=2)
    full = server.answer_full(QUESTION, k=3, order=order, max_new_tokens=2)
    # sources are listed best first whatever the layout (as `ask` and /v1/rag show them)
    assert list(answer.sources) == list(full.sources) == ranked
    assert [h.score for h in answer.sources] == sorted((h.score for h in ranked), reverse=True)
    direct = engine.answer_full(store.chunks(reorder(ranked, order)), QUESTION, max_new_tokens=2)
    torch.testing.assert_close(full.result.first_logits, direct.first_logits)
    if order != "best-first":  # the layout reaches the model: another order reads differently
        first = server.answer_full(QUESTION, k=3, order="best-first", max_new_tokens=2).result.first_logits
        assert not torch.allclose(full.result.first_logits, first)
