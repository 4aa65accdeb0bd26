"""A base model without a chat template (the bundled Gemma 3 270M) gets a plain-text RAG prompt, and its replies end
at a line break unless the caller sets stop texts; PML role tags still need a template."""

from __future__ import annotations

import copy

import pytest

from pc_rag.chat import ChatWrappers, chat_wrappers
from pc_rag.errors import PMLError
from pc_rag.rag import RagEngine, RagPrompt


@pytest.fixture(scope="module")
def base_engine(tokenizer) -> RagEngine:
    from conftest import tiny_model

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return RagEngine(tiny_model("gemma3", plain), RagPrompt.longbench())


def test_the_prompt_is_plain_text_ending_in_answer(base_engine) -> None:
    assert base_engine.wrappers == ChatWrappers.plain()
    assert base_engine.head_text.startswith("You are a helpful assistant.\n\nAnswer the question")
    chunks = base_engine.encode(["Passage 1:\nParis\nThe Eiffel Tower is in Paris.\n\n"], "prefix")
    text = base_engine.lm.tokenizer.decode(base_engine.full_ids(chunks, "Where?"))
    assert text.endswith("Question: Where?\nAnswer:") and "<|im_start|>" not in text


def test_replies_stop_at_a_line_break_unless_told_otherwise(base_engine) -> None:
    chunks = base_engine.encode(["The Eiffel Tower is in Paris."], "prefix")
    assert base_engine.request(chunks, "Where?", "prefix").params.stop == ("\n",)
    assert base_engine.request(chunks, "Where?", "prefix", stop=("X",)).params.stop == ("X",)
    assert base_engine.request_around("x", chunks, "Where?", None).params.stop == ("\n",)
    assert base_engine.request_full(chunks, "Where?").params.stop == ("\n",)  # `ask --full` ends there too


def test_a_stores_full_prefill_answer_ends_at_a_line_break_too(base_engine, tmp_path) -> None:
    from test_document_store import embedder

    from pc_rag.server.prompt_server import PromptServer
    from pc_rag.store.document_store import DocumentStore

    with DocumentStore.create(tmp_path / "s", base_engine, embedder=embedder()) as store:
        store.add_documents([("The Eiffel Tower is in Paris.", {})], progress=False)
        _, request, _ = PromptServer(store=store).rag_request("Where?", k=1, full=True)
        assert request.params.stop == ("\n",)


def test_pml_role_tags_still_need_a_chat_template(tokenizer) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(PMLError, match="no chat template"):
        chat_wrappers(plain)
