"""Generation settings reach the engine from every framework adapter, as per-call arguments and as fields.

Each property below fails if its setting is dropped on the way: a sampled reply differs from the greedy one
(temperature), a seed reproduces its reply and another seed does not (seed), ``top_k=1`` or a tiny ``top_p``
under a high temperature is greedy again (top_k, top_p), and a stop string cuts the reply before it (stop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import tiny_model

from pc_rag.engine import PromptCache
from pc_rag.integrations.langchain import ChatPromptCache
from pc_rag.integrations.langchain import PromptCacheLLM as LangChainLLM
from pc_rag.integrations.llama_index import PromptCacheLLM as LlamaIndexLLM

PROMPT = "Name a river in Europe."
NEW = 24  # enough tokens that two samplings, or a sampling and the greedy reply, differ on the tiny model
HOT = {"temperature": 1.5, "top_k": 0}


def _langchain_llm(cache: PromptCache, settings: dict[str, Any], call: dict[str, Any]) -> str:
    return LangChainLLM.from_prompt_cache(cache, max_tokens=NEW, **settings).invoke(PROMPT, **call)


def _langchain_chat(cache: PromptCache, settings: dict[str, Any], call: dict[str, Any]) -> str:
    reply = ChatPromptCache.from_prompt_cache(cache, max_tokens=NEW, **settings).invoke(PROMPT, **call)
    assert isinstance(reply.content, str)
    return reply.content


def _llama_index_llm(cache: PromptCache, settings: dict[str, Any], call: dict[str, Any]) -> str:
    return LlamaIndexLLM.from_prompt_cache(cache, max_new_tokens=NEW, **settings).complete(PROMPT, **call).text


ADAPTERS = {"langchain-llm": _langchain_llm, "langchain-chat": _langchain_chat, "llama-index": _llama_index_llm}
Reply = Callable[..., str]


@pytest.fixture(scope="module")
def cache(tokenizer) -> PromptCache:
    return PromptCache(tiny_model("llama", tokenizer))


@pytest.fixture(params=[(name, via) for name in ADAPTERS for via in ("call", "field")], ids="-".join)
def reply(request: pytest.FixtureRequest, cache: PromptCache) -> Reply:
    """The adapter's reply to ``PROMPT`` under ``settings``, given per call or as the adapter's fields."""
    name, via = request.param
    adapter = ADAPTERS[name]

    def answer(**settings: Any) -> str:
        return adapter(cache, {}, settings) if via == "call" else adapter(cache, settings, {})

    return answer


def test_temperature_samples_and_the_seed_reproduces(reply: Reply) -> None:
    greedy = reply()
    sampled = reply(**HOT, seed=1)
    assert sampled != greedy
    assert reply(**HOT, seed=1) == sampled
    assert reply(**HOT, seed=2) != sampled


def test_top_k_and_top_p_arrive(reply: Reply) -> None:
    greedy = reply()
    assert reply(**HOT, seed=1) != greedy  # so the two lines below are not greedy by chance
    assert reply(temperature=1.5, top_k=1, seed=1) == greedy
    assert reply(**HOT, top_p=1e-6, seed=1) == greedy


def test_stop_cuts_the_reply_before_it(reply: Reply) -> None:
    text = reply()
    # three characters from the third on, none a replacement character (a token that ends inside a UTF-8 sequence)
    stop = next(text[i : i + 3] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 3])
    stopped = reply(stop=[stop])
    assert stopped == text[: text.index(stop)] and stop not in stopped
