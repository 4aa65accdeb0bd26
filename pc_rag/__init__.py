"""pc-rag: Prompt Cache for retrieval-augmented QA with a local LLM."""

from pc_rag.engine import EncodedSchema, PromptCache, ReplyStream
from pc_rag.errors import (
    ContextLengthError,
    ModelLoadError,
    PCRagError,
    PMLError,
    UnsupportedModelError,
)
from pc_rag.generate import GenerationResult, GenerationStats, SamplingParams
from pc_rag.model import DEFAULT_MODEL, LoadedModel, load_model

__all__ = [
    "DEFAULT_MODEL",
    "ContextLengthError",
    "EncodedSchema",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelLoadError",
    "PCRagError",
    "PMLError",
    "PromptCache",
    "ReplyStream",
    "SamplingParams",
    "UnsupportedModelError",
    "load_model",
]
