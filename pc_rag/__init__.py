"""pc-rag: Prompt Cache for retrieval-augmented QA with a local LLM.

Exports are lazy: ``import pc_rag.store`` (or any light submodule) loads neither the engines nor the serving
stack; each name below loads its module on first use.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "DEFAULT_MODEL": "pc_rag.model",
    "LoadedModel": "pc_rag.model",
    "load_model": "pc_rag.model",
    "ContextLengthError": "pc_rag.errors",
    "ModelLoadError": "pc_rag.errors",
    "PCRagError": "pc_rag.errors",
    "PMLError": "pc_rag.errors",
    "UnsupportedModelError": "pc_rag.errors",
    "GenerationResult": "pc_rag.runtime.generate",
    "GenerationStats": "pc_rag.runtime.generate",
    "ReplyStream": "pc_rag.runtime.generate",
    "SamplingParams": "pc_rag.runtime.generate",
    "EncodedSchema": "pc_rag.engine",
    "PromptCache": "pc_rag.engine",
    "RagEngine": "pc_rag.rag.engine",
    "RagPrompt": "pc_rag.rag.prompt",
    "DocumentStore": "pc_rag.store.document_store",
    "Answer": "pc_rag.server.prompt_server",
    "PromptServer": "pc_rag.server.prompt_server",
    "Scheduler": "pc_rag.runtime.scheduler",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
