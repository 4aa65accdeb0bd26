"""One entry point both framework adapters call: serve a prompt string by the cheapest correct path.

A PML ``<prompt …>`` goes to the Prompt Cache engine (its schema's modules are
reused); text with module references goes to the document store, which splices
the referenced chunks; any other text is served by full prefill through the
model's chat template, so the adapters are always correct LLMs. This module
knows nothing about LangChain or LlamaIndex.
"""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.generate import ReplyStream, SamplingParams
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.prompt import RagPrompt
from pc_rag.store.document_store import DocumentStore

SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


@dataclass
class PromptServer:
    """Serve prompt strings from ``store`` (module references), ``prompt_cache`` (PML) or full prefill."""

    store: DocumentStore | None = None
    prompt_cache: PromptCache | None = None
    mode: str | None = None  # recovery mode for module prompts; None: the store's default

    def __post_init__(self) -> None:
        if self.store is None and self.prompt_cache is None:
            msg = "PromptServer needs a DocumentStore, a PromptCache, or both"
            raise PCRagError(msg)

    @property
    def engine(self) -> RagEngine | None:
        return self.store.engine if self.store is not None else None

    @property
    def model_name(self) -> str:
        lm = self.store.engine.lm if self.store is not None else self.prompt_cache.lm  # type: ignore[union-attr]
        return lm.name

    def stream(self, prompt: str, **sampling: object) -> ReplyStream:
        """Text deltas of the reply to ``prompt``; ``sampling`` are ``SamplingParams`` fields."""
        unknown = set(sampling) - SAMPLING_FIELDS
        if unknown:
            msg = f"unknown generation settings {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}"
            raise PCRagError(msg)
        if prompt.lstrip().startswith("<prompt"):
            if self.prompt_cache is None:
                msg = "this is a PML prompt, but no PromptCache (schemas) was given to serve it"
                raise PCRagError(msg)
            return self.prompt_cache.stream(prompt, **sampling)
        if self.store is not None:
            return self.store.stream_prompt(prompt, self.mode, **sampling)
        cache = self.prompt_cache
        assert cache is not None
        return cache.stream_ids(cache.tokenize(_chat(cache, prompt)), **sampling)


def _chat(cache: PromptCache, text: str) -> str:
    """``text`` as one user turn after an explicit system turn (templates insert a default one otherwise)."""
    w = cache.wrappers
    return w.wrap("system", RagPrompt().system) + w.wrap("user", text) + w.generation_prompt
