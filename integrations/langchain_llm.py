"""LangChain LLM over a ``PromptServer``: prompts with module references are answered from cached KV.

``PromptCacheLLM`` is a text-completion ``LLM``. A prompt carrying module
references (from ``format_modules``) is served by splicing the referenced
chunks; a PML ``<prompt>`` by the Prompt Cache engine; any other text by full
prefill as one user turn. Generation stats (TTFT, cached and computed tokens) are
in each generation's ``generation_info`` and in ``last_stats``. This module
knows nothing about retrieval or how prompts are routed: that is the server's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from dataclasses import asdict
from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models.llms import LLM
    from langchain_core.outputs import Generation, GenerationChunk, LLMResult
    from langchain_core.runnables.config import run_in_executor
    from pydantic import ConfigDict, PrivateAttr
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LangChain adapter needs langchain-core: `pip install pc-rag[langchain]`"
    raise ImportError(msg) from e

from pc_rag.integrations._langchain_shared import SETTINGS, ServedModel, in_worker, sampling
from pc_rag.runtime.generate import GenerationResult, GenerationStats

__all__ = ["PromptCacheLLM"]


class PromptCacheLLM(ServedModel, LLM):
    """A local model that reuses prompt modules' KV; greedy by default.

    Per-call keyword arguments override the fields of the same name; ``stop``
    strings end the reply (and are excluded from it). Built with ``batched=True`` (a
    ``Scheduler``), ``batch``, ``abatch`` and parallel chains decode together, one
    forward per token for all; otherwise each reply is decoded on its own.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # LangChain's base would ignore extras

    _last_stats: GenerationStats | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"model_name": self.model_name, "mode": self.server.mode}
        store = self.server.store
        if store is not None:
            identity = store.manifest.identity
            params |= {"store_id": store.store_id, "store_identity": asdict(identity) if identity else None}
        return params | {name: getattr(self, name) for name in (*SETTINGS, "stop")}

    @property
    def last_stats(self) -> GenerationStats | None:
        """Stats of the last reply this LLM finished (under concurrency, read ``generation_info`` instead)."""
        return self._last_stats

    def _chunks(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Iterator[GenerationChunk]:
        """Text deltas, then an empty chunk whose ``generation_info`` holds the stats."""
        stream = self.server.stream(prompt, **sampling(self, stop, kwargs))
        yield from (GenerationChunk(text=delta) for delta in stream)
        assert stream.result is not None, "a reply stream ends with its result"
        self._last_stats = stream.result.stats
        yield GenerationChunk(text="", generation_info=_info(stream.result))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        with closing(self._chunks(prompt, stop, kwargs)) as chunks:
            for chunk in chunks:
                if run_manager is not None and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Decode in a worker thread, one delta at a time, so the event loop is never blocked."""
        async for chunk in in_worker(self._chunks(prompt, stop, kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return _join(self._stream(prompt, stop, run_manager, **kwargs)).text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.server.scheduler is None or len(prompts) == 1:
            generations = [[_join(self._stream(p, stop, run_manager, **kwargs))] for p in prompts]
            return LLMResult(generations=generations, llm_output=self._llm_output())
        settings = sampling(self, stop, kwargs)
        streams = [self.server.stream(p, **settings) for p in prompts]  # all submitted: they decode together
        generations = []
        for stream in streams:
            text = "".join(stream)
            assert stream.result is not None, "a reply stream ends with its result"
            self._last_stats = stream.result.stats
            generations.append([Generation(text=text, generation_info=_info(stream.result))])
        return LLMResult(generations=generations, llm_output=self._llm_output())

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.server.scheduler is not None and len(prompts) > 1:  # decoded together, off the event loop
            return await run_in_executor(None, self._generate, prompts, stop, None, **kwargs)
        generations = []
        for prompt in prompts:
            chunks = [c async for c in self._astream(prompt, stop, run_manager, **kwargs)]
            generations.append([_join(iter(chunks))])
        return LLMResult(generations=generations, llm_output=self._llm_output())

    def _llm_output(self) -> dict[str, Any]:
        store = self.server.store
        return {"model_name": self.model_name, "store_id": store.store_id if store is not None else None}


def _info(result: GenerationResult) -> dict[str, Any]:
    return asdict(result.stats)  # ttft_ms, total_ms, cached_tokens, computed_tokens, new_tokens


def _join(chunks: Iterator[GenerationChunk]) -> Generation:
    text, info = [], None
    for chunk in chunks:
        text.append(chunk.text)
        info = chunk.generation_info or info
    return Generation(text="".join(text), generation_info=info)
