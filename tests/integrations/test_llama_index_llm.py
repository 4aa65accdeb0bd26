"""``PromptCacheLLM`` on a tiny model: completion, streaming, settings, chat through the model's template, errors.

Properties: streaming and non-streaming replies agree; per-call settings bound
the reply; chat equals full prefill of the tokenizer's own chat template with an
explicit system turn; a lone user turn equals the completion of its text.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import tiny_model
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from pydantic import ValidationError

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.integrations.llama_index import PromptCacheLLM
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.generate import GenerationResult
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore

NEW = 4
PROMPT = "Name a river in Europe."


pytestmark = pytest.mark.usefixtures("no_network")  # LlamaIndex must not fetch anything


@pytest.fixture(scope="module")
def store(tokenizer, tmp_path_factory) -> DocumentStore:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt(), canonical_gap=16)
    ones = as_embedder(lambda texts: np.ones((len(texts), 4), dtype=np.float32), name="test-ones")
    store = DocumentStore.create(tmp_path_factory.mktemp("li-llm") / "store", engine, embedder=ones, mode="prefix")
    store.add_documents(["The Danube flows into the Black Sea.", "The Rhine flows into the North Sea."], progress=False)
    return store


@pytest.fixture(scope="module")
def llm(store: DocumentStore) -> PromptCacheLLM:
    return PromptCacheLLM.from_store(store, max_new_tokens=NEW)


def module_prompt(store: DocumentStore) -> str:
    refs = "".join(store.module_ref(h) for h in store.search("river", k=2))
    return store.engine.prompt.preamble + refs + "Question: Where does the Danube flow?\nAnswer:"


def test_metadata_describes_the_model(llm: PromptCacheLLM, store: DocumentStore) -> None:
    meta = llm.metadata
    assert meta.context_window == store.engine.lm.max_positions and meta.num_output == NEW
    assert meta.model_name == store.engine.lm.name and meta.is_chat_model  # predict() goes through the template


@pytest.mark.parametrize("cached", [False, True])
def test_complete_and_stream_complete_agree(llm: PromptCacheLLM, store: DocumentStore, cached: bool) -> None:
    prompt = module_prompt(store) if cached else PROMPT
    reply = llm.complete(prompt)
    assert isinstance(reply.raw, GenerationResult) and reply.additional_kwargs["new_tokens"] == NEW
    assert (reply.additional_kwargs["cached_tokens"] > 0) == cached
    assert reply.additional_kwargs["ttft_ms"] == llm.last_stats.ttft_ms
    parts = list(llm.stream_complete(prompt))
    deltas = [p.delta for p in parts]
    assert "".join(deltas) == reply.text and parts[-1].delta == "" and parts[-2].text == reply.text
    assert parts[-1].additional_kwargs["cached_tokens"] == reply.additional_kwargs["cached_tokens"]


def test_settings_bound_the_reply(store: DocumentStore) -> None:
    llm = PromptCacheLLM.from_store(store, max_new_tokens=6)
    text = llm.complete(PROMPT).text
    assert llm.complete(PROMPT, max_new_tokens=2).additional_kwargs["new_tokens"] == 2
    stop = text.strip()[-2:]
    assert llm.complete(PROMPT, stop=[stop]).text == text[: text.index(stop)]
    assert (
        PromptCacheLLM.from_store(store, max_new_tokens=6, stop=[stop]).complete(PROMPT).text
        == text[: text.index(stop)]
    )


def test_bad_settings_are_refused(store: DocumentStore, llm: PromptCacheLLM) -> None:
    with pytest.raises(ValidationError):
        PromptCacheLLM.from_store(store, temperature=-1.0)
    with pytest.raises(ValidationError):
        PromptCacheLLM.from_store(store, max_new_tokens=0)
    with pytest.raises(PCRagError, match="unknown generation settings"):
        llm.complete(PROMPT, max_tokens=3)


def test_lone_user_turn_is_the_completion(llm: PromptCacheLLM, store: DocumentStore) -> None:
    system = ChatMessage(role=MessageRole.SYSTEM, content=store.engine.prompt.system)
    for prompt in (PROMPT, module_prompt(store)):
        reply = llm.complete(prompt)
        for messages in ([ChatMessage(role=MessageRole.USER, content=prompt)], [system, ChatMessage(content=prompt)]):
            chat = llm.chat(messages)
            assert chat.message.content == reply.text
            assert chat.additional_kwargs["cached_tokens"] == reply.additional_kwargs["cached_tokens"]


@pytest.mark.parametrize("system", [None, "Answer in one word."])
def test_chat_renders_the_model_template_with_an_explicit_system(
    llm: PromptCacheLLM, store: DocumentStore, system: str | None
) -> None:
    turns = [("user", "Hi!"), ("assistant", "Hello."), ("user", PROMPT)]
    messages = [ChatMessage(role=role, content=text) for role, text in turns]
    if system is not None:
        messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=system))
    chat = llm.chat(messages)
    explicit = [{"role": "system", "content": system or store.engine.prompt.system}]
    explicit += [{"role": r, "content": t} for r, t in turns]
    tokenizer = store.engine.lm.tokenizer
    text = tokenizer.apply_chat_template(explicit, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = PromptCache(store.engine.lm).generate_ids(ids, max_new_tokens=NEW)
    assert chat.message.content == expected.text
    stats = chat.additional_kwargs  # a prefix another test's conversation computed may be read from the cache
    assert stats["computed_tokens"] + stats["cached_tokens"] == len(ids)


def test_system_prompt_field_is_the_system_turn(store: DocumentStore) -> None:
    messages = [ChatMessage(content="Hi!"), ChatMessage(role=MessageRole.ASSISTANT, content="Hello.")]
    messages.append(ChatMessage(content=PROMPT))
    with_field = PromptCacheLLM.from_store(store, max_new_tokens=NEW, system_prompt="Answer in one word.")
    explicit = [ChatMessage(role=MessageRole.SYSTEM, content="Answer in one word."), *messages]
    plain = PromptCacheLLM.from_store(store, max_new_tokens=NEW)
    assert with_field.chat(messages).message.content == plain.chat(explicit).message.content


def test_stream_chat_agrees_with_chat(llm: PromptCacheLLM) -> None:
    messages = [ChatMessage(content="Hi!"), ChatMessage(role=MessageRole.ASSISTANT, content="Hello.")]
    messages.append(ChatMessage(content=PROMPT))
    chat = llm.chat(messages)
    parts = list(llm.stream_chat(messages))
    assert "".join(p.delta for p in parts) == chat.message.content == parts[-1].message.content
    assert parts[-1].additional_kwargs["new_tokens"] == NEW


def test_chat_errors_are_named(llm: PromptCacheLLM, store: DocumentStore) -> None:
    with pytest.raises(PCRagError, match="chat role 'tool'"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="42")])


def test_module_references_after_a_history_are_spliced_not_sent_as_text(
    llm: PromptCacheLLM, store: DocumentStore
) -> None:
    history = [ChatMessage(content="Hi!"), ChatMessage(role=MessageRole.ASSISTANT, content="Hello.")]
    prompt = module_prompt(store)
    reply = llm.chat([*history, ChatMessage(content=prompt)])
    chunk_tokens = sum(len(c.token_ids) for c in store.prompt_chunks(prompt)[1])
    assert reply.additional_kwargs["cached_tokens"] >= chunk_tokens > 0  # spliced from the store, not read as tags


def test_prompt_cache_llm_serves_pml(store: DocumentStore) -> None:
    cache = PromptCache(store.engine.lm)
    cache.add_schema('<schema name="s"><module name="doc">The sky is blue.</module></schema>')
    llm = PromptCacheLLM.from_prompt_cache(cache, max_new_tokens=NEW)
    reply = llm.complete('<prompt schema="s"><doc/>What color?</prompt>')
    assert reply.additional_kwargs["cached_tokens"] > 0
    assert llm.chat([ChatMessage(content=PROMPT)]).message.content == llm.complete(PROMPT).text


def test_async_completion(llm: PromptCacheLLM) -> None:
    async def run() -> tuple[str, str]:
        reply = await llm.acomplete(PROMPT)
        deltas = [part.delta async for part in await llm.astream_complete(PROMPT)]
        return reply.text, "".join(deltas)

    text, streamed = asyncio.run(run())
    assert text == streamed == llm.complete(PROMPT).text


def test_async_completion_and_chat_leave_the_event_loop_free(llm: PromptCacheLLM) -> None:
    import asyncio

    from llama_index.core.llms import ChatMessage

    async def run() -> tuple[str, str, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        beat = asyncio.create_task(ticker())
        done = await llm.acomplete("Where is the tower?")
        chat = await llm.achat([ChatMessage(role="user", content="Where is the tower?")])
        beat.cancel()
        return done.text, chat.message.content, ticks

    text, chat, ticks = asyncio.run(run())
    assert text == llm.complete("Where is the tower?").text
    assert chat == llm.chat([ChatMessage(role="user", content="Where is the tower?")]).message.content
    assert ticks > 10  # the loop ran while the model decoded
