"""What LangChain's LLM and chat model adapters share: the server and generation settings they are built with
(``ServedModel``), and streaming a blocking generator to the event loop. This module knows nothing about prompts
or messages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Any, TypeVar

from langchain_core.runnables.config import run_in_executor
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Self  # typing.Self is 3.11+; langchain-core and pydantic require typing-extensions

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

# LangChain's generation setting -> pc-rag's SamplingParams field
SETTINGS = {"temperature": "temperature", "max_tokens": "max_new_tokens", "top_p": "top_p", "top_k": "top_k",
            "seed": "seed"}  # fmt: skip

T = TypeVar("T")


def sampling(adapter: Any, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams`` fields from per-call ``kwargs`` over the ``adapter``'s fields of the same name."""
    unknown = set(kwargs) - set(SETTINGS)
    if unknown:
        msg = (
            f"unknown generation settings {sorted(unknown)}; {type(adapter).__name__} takes {sorted(SETTINGS)} and stop"
        )
        raise PCRagError(msg)
    fields = {field: kwargs.get(name, getattr(adapter, name)) for name, field in SETTINGS.items()}
    return fields | {"stop": tuple(stop if stop is not None else adapter.stop or ())}


class ServedModel(BaseModel):
    """What both LangChain adapters are: a ``PromptServer`` and the generation settings per-call keyword
    arguments override. Mixed in before LangChain's ``LLM`` or ``BaseChatModel``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # the adapters set their own, forbidding extras

    server: PromptServer = Field(exclude=True, description="routes prompts to the store, PML engine or full prefill")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy")
    max_tokens: int = Field(default=256, ge=1, description="most new tokens per reply")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables the filter")
    seed: int | None = Field(default=None, description="seeds sampling (temperature > 0)")
    stop: list[str] | None = Field(default=None, description="default stop strings")

    @classmethod
    def from_store(cls, store: DocumentStore, mode: str | None = None, *, batched: bool = False,
                   **settings: Any) -> Self:  # fmt: skip
        """Serve module references to ``store``'s chunks with recovery ``mode`` (``None``: the store's), the KV of
        conversation prefixes kept for the next turn (``PrefixCache``); with ``batched``, ``batch`` and concurrent
        calls decode together in a ``Scheduler`` of their own."""
        scheduler = Scheduler(store.engine.lm) if batched else None
        server = PromptServer(store=store, mode=mode, scheduler=scheduler, prefix_cache=PrefixCache())
        return cls(server=server, **settings)

    @classmethod
    def from_prompt_cache(cls, prompt_cache: PromptCache, *, batched: bool = False, **settings: Any) -> Self:
        """Serve PML prompts with ``prompt_cache``'s schemas (other text by full prefill); ``batched`` as in
        ``from_store``."""
        scheduler = Scheduler(prompt_cache.lm) if batched else None
        server = PromptServer(prompt_cache=prompt_cache, scheduler=scheduler, prefix_cache=PrefixCache())
        return cls(server=server, **settings)

    @property
    def model_name(self) -> str:
        return self.server.model_name

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids under the served model's own tokenizer (LangChain's default would fetch GPT-2's)."""
        return self.server.lm.tokenizer(text, add_special_tokens=False)["input_ids"]


async def in_worker(chunks: Iterator[T]) -> AsyncIterator[T]:
    """``chunks`` advanced in a worker thread, one at a time, so the event loop is never blocked."""
    try:
        while (chunk := await run_in_executor(None, next, chunks, None)) is not None:
            yield chunk
    finally:
        with suppress(ValueError):  # cancelled mid-step: the step still runs in its worker, GC closes it after
            chunks.close()  # type: ignore[attr-defined]
