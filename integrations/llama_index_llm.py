"""LlamaIndex LLM over a ``PromptServer``: prompts with module references are answered from cached KV.

``PromptCacheLLM`` is a completion ``CustomLLM``. A completion prompt is one
user turn: carrying module references (see ``PromptCacheQueryEngine``) it is
served by splicing the referenced chunks, a PML ``<prompt>`` by the Prompt Cache
engine, other text by full prefill. Chat renders the conversation through the
model's own chat template with an explicit system turn (templates such as
SmolLM2's insert a default one otherwise); a lone user turn under the server's
system prompt goes through the server, so it may carry module references too.
Stats (TTFT, cached and computed tokens) are in each response's
``additional_kwargs`` and in ``last_stats``. This module knows nothing about
retrieval or how prompts are routed: that is the server's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LlamaIndex adapter needs llama-index-core: `pip install pc-rag[llamaindex]`"
    raise ImportError(msg) from e

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.runtime.generate import GenerationResult, GenerationStats, ReplyStream
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.server.prompt_server import SAMPLING_FIELDS, PromptServer
from pc_rag.store.document_store import DocumentStore

__all__ = ["PromptCacheLLM"]

# LlamaIndex roles -> chat template roles
_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.CHATBOT: "assistant",
}


class PromptCacheLLM(CustomLLM):
    """A local model that reuses prompt modules' KV; greedy by default.

    Per-call keyword arguments (``SamplingParams`` fields: ``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``speculative``) override the fields
    of the same name for one call. ``system_prompt`` is chat's system turn when the
    conversation has none (LlamaIndex's ``predict`` prepends it to completion prompts
    as text). Calls run one after another on one model.
    """

    max_new_tokens: int = Field(default=256, ge=1, description="Most new tokens per reply (LlamaIndex's num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(default=0, ge=0, description="Sample among the k most likely tokens; 0 disables it.")
    seed: int | None = Field(default=None, description="Seeds sampling (temperature > 0).")
    stop: list[str] = Field(default_factory=list, description="Stop strings; they end the reply and are excluded.")
    speculative: bool | None = Field(
        default=None,
        description="Verify drafts looked up in the prompt with each decode step (docs/decoding.md); None: on where"
        " it measured faster (int8 and int4 models).",
    )

    _server: PromptServer = PrivateAttr()
    _last_stats: GenerationStats | None = PrivateAttr(default=None)

    def __init__(self, server: PromptServer, **settings: Any) -> None:
        super().__init__(**settings)
        self._server = server

    @classmethod
    def from_store(cls, store: DocumentStore, mode: str | None = None, **settings: Any) -> PromptCacheLLM:
        """Serve module references to ``store``'s chunks with recovery ``mode`` (``None``: the store's)."""
        return cls(PromptServer(store=store, mode=mode, prefix_cache=PrefixCache()), **settings)

    @classmethod
    def from_prompt_cache(cls, prompt_cache: PromptCache, **settings: Any) -> PromptCacheLLM:
        """Serve PML prompts with ``prompt_cache``'s schemas (other text by full prefill)."""
        return cls(PromptServer(prompt_cache=prompt_cache, prefix_cache=PrefixCache()), **settings)

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    @property
    def server(self) -> PromptServer:
        return self._server

    @property
    def store(self) -> DocumentStore | None:
        return self._server.store

    @property
    def last_stats(self) -> GenerationStats | None:
        """Stats of the last reply this LLM finished."""
        return self._last_stats

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._server.lm.max_positions,
            num_output=self.max_new_tokens,
            model_name=self._server.model_name,
            is_chat_model=True,  # predict() then sends messages to chat(), rendered by the chat template: as
            # a completion model LlamaIndex would flatten them to "user: ..." text, which the model imitates
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Reply to ``prompt`` served as one user turn (``completion_to_prompt`` first unless ``formatted``)."""
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """``complete`` in a worker thread: the event loop keeps running, and with a scheduler behind the server
        concurrent calls decode together."""
        return await asyncio.to_thread(self._complete, prompt, formatted, kwargs)

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        result = self._finish(self._completion_stream(prompt, formatted, kwargs))
        return CompletionResponse(text=result.text, raw=result, additional_kwargs=asdict(result.stats))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Text deltas, then an empty delta whose ``additional_kwargs`` hold the stats."""
        stream = self._completion_stream(prompt, formatted, kwargs)

        def responses() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            result = self._finish(stream)
            yield CompletionResponse(text=result.text, delta="", raw=result, additional_kwargs=asdict(result.stats))

        return responses()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Reply to a conversation rendered through the model's chat template."""
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """``chat`` in a worker thread (see ``acomplete``)."""
        return await asyncio.to_thread(self._chat, messages, kwargs)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        result = self._finish(self._chat_stream(messages, self._sampling(kwargs)))
        message = ChatMessage(role=MessageRole.ASSISTANT, content=result.text)
        return ChatResponse(message=message, raw=result, additional_kwargs=asdict(result.stats))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Chat deltas, then an empty delta whose ``additional_kwargs`` hold the stats."""
        stream = self._chat_stream(messages, self._sampling(kwargs))

        def responses() -> ChatResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            result = self._finish(stream)
            message = ChatMessage(role=MessageRole.ASSISTANT, content=result.text)
            yield ChatResponse(message=message, delta="", raw=result, additional_kwargs=asdict(result.stats))

        return responses()

    def _completion_stream(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> ReplyStream:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return self._server.stream(prompt, **self._sampling(kwargs))

    def _chat_stream(self, messages: Sequence[ChatMessage], sampling: dict[str, Any]) -> ReplyStream:
        """The conversation's own system turn, else ``system_prompt``, else the server's."""
        turns = [(_role(m), m.content or "") for m in messages]
        system = self.system_prompt or None
        if turns and turns[0][0] == "system":
            system = turns.pop(0)[1]
        return self._server.stream_chat(turns, system, **sampling)

    def _sampling(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            msg = f"unknown generation settings {sorted(unknown)}; PromptCacheLLM takes {sorted(SAMPLING_FIELDS)}"
            raise PCRagError(msg)
        sampling = {name: kwargs.get(name, getattr(self, name)) for name in SAMPLING_FIELDS}
        return sampling | {"stop": tuple(sampling["stop"] or ())}

    def _finish(self, stream: ReplyStream) -> GenerationResult:
        """Run ``stream`` to its end (if it is not there yet); remember its stats."""
        for _ in stream:
            pass
        assert stream.result is not None, "a reply stream ends with its result"
        self._last_stats = stream.result.stats
        return stream.result


def _role(message: ChatMessage) -> str:
    role = _ROLES.get(message.role)
    if role is None:
        msg = f"chat role {message.role.value!r} is not supported; use system, user or assistant messages"
        raise PCRagError(msg)
    return role
