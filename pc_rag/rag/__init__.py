"""Retrieval-augmented answering from chunk modules: prompt, recovery modes, engine."""

from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.rag.modes import MODES, RecoveryMode
from pc_rag.rag.prompt import RagPrompt

__all__ = ["MODES", "Chunk", "RagEngine", "RagPrompt", "RecoveryMode"]
