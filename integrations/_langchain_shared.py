"""What LangChain's LLM and chat model adapters share: their generation settings, the server they build, and
streaming a blocking generator to the event loop. This module knows nothing about prompts or messages."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Any, TypeVar

from langchain_core.runnables.config import run_in_executor

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.serving.prompt_server import PromptServer
from pc_rag.serving.scheduler import Scheduler
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


def store_server(store: DocumentStore, mode: str | None, batched: bool) -> PromptServer:
    """A server of ``store``'s module references; with ``batched``, concurrent calls decode together in a
    ``Scheduler`` of its own."""
    return PromptServer(store=store, mode=mode, scheduler=Scheduler(store.engine.lm) if batched else None)


def prompt_cache_server(prompt_cache: PromptCache, batched: bool) -> PromptServer:
    """A server of ``prompt_cache``'s PML prompts (other text by full prefill); ``batched`` as ``store_server``."""
    return PromptServer(prompt_cache=prompt_cache, scheduler=Scheduler(prompt_cache.lm) if batched else None)


def token_ids(server: PromptServer, text: str) -> list[int]:
    """Token ids under the served model's own tokenizer (LangChain's default would fetch GPT-2's)."""
    return server.lm.tokenizer(text, add_special_tokens=False)["input_ids"]


async def in_worker(chunks: Iterator[T]) -> AsyncIterator[T]:
    """``chunks`` advanced in a worker thread, one at a time, so the event loop is never blocked."""
    try:
        while (chunk := await run_in_executor(None, next, chunks, None)) is not None:
            yield chunk
    finally:
        with suppress(ValueError):  # cancelled mid-step: the step still runs in its worker, GC closes it after
            chunks.close()  # type: ignore[attr-defined]
