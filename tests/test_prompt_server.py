"""The adapters' shared entry point picks the right path for PML, module-reference and plain prompts."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.rag.markers import module_ref
from pc_rag.server.prompt_server import PromptServer

SCHEMA = '<schema name="s"><module name="doc">The sky is blue.</module></schema>'


@pytest.fixture(scope="module")
def server(tokenizer) -> PromptServer:
    cache = PromptCache(tiny_model("llama", tokenizer))
    cache.add_schema(SCHEMA)
    return PromptServer(prompt_cache=cache)


def test_pml_prompt_reuses_the_schema_modules(server: PromptServer) -> None:
    stream = server.stream('<prompt schema="s"><doc/>What color?</prompt>', max_new_tokens=3)
    text = "".join(stream)
    assert text == stream.result.text and stream.result.stats.cached_tokens > 0


def test_plain_text_is_served_by_full_prefill(server: PromptServer) -> None:
    stream = server.stream("What color is the sky?", max_new_tokens=3)
    list(stream)
    assert stream.result.stats.cached_tokens == 0 and stream.result.stats.new_tokens == 3


def test_bad_settings_and_missing_backends_are_named(server: PromptServer) -> None:
    with pytest.raises(PCRagError, match="unknown generation settings"):
        server.stream("hi", max_tokens=3)
    with pytest.raises(PCRagError, match="needs a DocumentStore, a PromptCache"):
        PromptServer()
    with pytest.raises(PCRagError, match="answering a question needs a document store"):
        server.answer("What color is the sky?")


def test_pml_served_by_full_prefill_is_the_same_tokens(server: PromptServer) -> None:
    prompt = '<prompt schema="s"><doc/>What color?</prompt>'
    full = server.stream(prompt, full=True, max_new_tokens=3)
    text = "".join(full)
    cache = server.prompt_cache
    assert text == cache.generate_full(prompt, max_new_tokens=3).text and full.result.stats.cached_tokens == 0


def test_conversations_are_rendered_with_an_explicit_system_turn(server: PromptServer) -> None:
    turns = [("user", "Hi"), ("assistant", "Hello."), ("user", "What color is the sky?")]
    stream = server.stream_chat(turns, "Be brief.", max_new_tokens=3)
    text = "".join(stream)
    cache = server.prompt_cache
    w = cache.wrappers
    rendered = w.wrap("system", "Be brief.") + "".join(w.wrap(r, c) for r, c in turns) + w.generation_prompt
    assert text == cache.generate_ids(cache.tokenize(rendered), max_new_tokens=3).text
    lone = server.stream_chat([("user", "What color is the sky?")], max_new_tokens=3)
    assert "".join(lone) == "".join(server.stream("What color is the sky?", max_new_tokens=3))


def test_bad_conversations_are_refused(server: PromptServer) -> None:
    with pytest.raises(PCRagError, match="chat roles \\['tool'\\]"):
        server.stream_chat([("tool", "x")])
    with pytest.raises(PCRagError, match="spliced from a document store, and this server has none"):
        server.stream_chat([("user", f"see {module_ref('ab', 1)}")], "Other system.")


def test_pml_is_parsed_only_when_the_caller_asked_for_it(tmp_path, tokenizer) -> None:
    from test_document_store import make_store

    from pc_rag.rag import RagEngine, RagPrompt

    store = make_store(tmp_path, RagEngine(tiny_model("llama", tokenizer), RagPrompt()))
    question = '<prompt schema="s"><doc/>What color?</prompt>'  # user text that looks like PML
    stream = PromptServer(store=store).stream(question, max_new_tokens=2)
    list(stream)  # a plain question: served by full prefill, no PMLError, no schema lookup
    assert stream.result.stats.cached_tokens == 0 and stream.result.stats.new_tokens == 2
