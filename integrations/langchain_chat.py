"""LangChain chat model over a ``PromptServer``: conversations through the model's chat template, modules reused.

``ChatPromptCache`` is a ``BaseChatModel``. Module references (from ``format_modules``) in any message, the
system message included, are answered from the chunks' cached KV; the conversation is rendered with the
tokenizer's chat template, its history's KV kept from turn to turn (``PrefixCache``: ``cache_read`` in the usage
metadata counts it). Replies stream, carry usage metadata
(prompt tokens cached and computed), and, when the model is built with ``batched=True``, concurrent calls
(``batch``, ``abatch``, parallel chains) decode together in one ``Scheduler``. Tool calling and structured output
are not built. This module knows nothing about retrieval or how prompts are routed: that is the server's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import closing
from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from pydantic import ConfigDict, Field
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LangChain chat model needs langchain-core: `pip install pc-rag[langchain]`"
    raise ImportError(msg) from e

from pc_rag.errors import PCRagError
from pc_rag.integrations._langchain_shared import SETTINGS, ServedModel, in_worker, sampling
from pc_rag.runtime.generate import GenerationResult

__all__ = ["ChatPromptCache"]


class ChatPromptCache(ServedModel, BaseChatModel):
    """A local instruct model as a LangChain chat model that reuses prompt modules' KV; greedy by default."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # LangChain's base would ignore extras

    streaming: bool = Field(default=False, description="report each token to callbacks during invoke, too")

    @property
    def _llm_type(self) -> str:
        return "pc-rag-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params = {"model_name": self.model_name, "mode": self.server.mode}
        return params | {name: getattr(self, name) for name in (*SETTINGS, "stop")}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "pc-rag"
        params["ls_model_name"] = self.model_name
        return params

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[ChatGenerationChunk]:
        """Text deltas, then an empty chunk with the usage and the stats."""
        system, turns = _conversation(messages)
        settings = sampling(self, stop, kwargs)
        stream = self.server.stream_chat(turns, system, **settings)
        yield from (ChatGenerationChunk(message=AIMessageChunk(content=delta)) for delta in stream)
        assert stream.result is not None, "a reply stream ends with its result"
        result = stream.result
        last = AIMessageChunk(
            content="",
            usage_metadata=_usage(result),
            response_metadata=self._metadata(result, settings),
            chunk_position="last",
        )
        yield ChatGenerationChunk(message=last, generation_info=_info(result))

    def _metadata(self, result: GenerationResult, sampling: dict[str, Any]) -> dict[str, Any]:
        finish = "length" if result.stats.new_tokens >= sampling["max_new_tokens"] else "stop"
        return {"model_name": self.model_name, "model_provider": "pc-rag", "finish_reason": finish}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        text, last = [], None
        with closing(self._chunks(messages, stop, kwargs)) as chunks:
            for chunk in chunks:
                if self.streaming and run_manager is not None and chunk.message.content:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                text.append(chunk.message.content)
                last = chunk
        assert last is not None
        message = AIMessage(
            content="".join(text),  # type: ignore[arg-type]
            usage_metadata=last.message.usage_metadata,  # type: ignore[attr-defined]
            response_metadata=last.message.response_metadata,
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=last.generation_info)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with closing(self._chunks(messages, stop, kwargs)) as chunks:
            for chunk in chunks:
                if run_manager is not None and chunk.message.content:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Decode in a worker thread, one delta at a time, so the event loop is never blocked."""
        async for chunk in in_worker(self._chunks(messages, stop, kwargs)):
            if run_manager is not None and chunk.message.content:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _conversation(messages: Sequence[BaseMessage]) -> tuple[str | None, list[tuple[str, str]]]:
    """(system prompt or None, the turns after it) of a LangChain conversation; leading system messages are joined
    into one system prompt, later ones are system turns where they stand."""
    leading = 0
    while leading < len(messages) and isinstance(messages[leading], SystemMessage):
        leading += 1
    system = "\n\n".join(_text(m) for m in messages[:leading]) if leading else None
    messages = messages[leading:]
    turns = []
    for message in messages:
        if isinstance(message, HumanMessage):
            turns.append(("user", _text(message)))
        elif isinstance(message, AIMessage):
            turns.append(("assistant", _text(message)))
        elif isinstance(message, SystemMessage):
            turns.append(("system", _text(message)))
        else:
            msg = f"{type(message).__name__} is not supported here: use System, Human and AI messages"
            raise PCRagError(msg)
    if not turns or turns[-1][0] != "user":
        raise PCRagError("the conversation must end with a user (Human) message")
    return system, turns


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = [p if isinstance(p, str) else p.get("text") if p.get("type") == "text" else None for p in message.content]
    if any(p is None for p in parts):
        raise PCRagError("only text content is supported (no images, audio or files)")
    return "".join(parts)  # type: ignore[arg-type]


def _usage(result: GenerationResult) -> UsageMetadata:
    stats = result.stats
    prompt = stats.cached_tokens + stats.computed_tokens
    return UsageMetadata(
        input_tokens=prompt, output_tokens=stats.new_tokens, total_tokens=prompt + stats.new_tokens,
        input_token_details={"cache_read": stats.cached_tokens},
    )  # fmt: skip


def _info(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {"ttft_ms": stats.ttft_ms, "total_ms": stats.total_ms, "cached_tokens": stats.cached_tokens,
            "computed_tokens": stats.computed_tokens, "new_tokens": stats.new_tokens}  # fmt: skip
