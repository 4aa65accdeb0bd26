"""The fixed text around retrieved documents: system turn, preamble, question template.

A RAG prompt is ``preamble (cached) + documents (modules) + question (computed)``,
rendered through the tokenizer's chat template with an explicit system message
(templates such as SmolLM2's insert a default one otherwise). This module knows
nothing about KV or retrieval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from pc_rag.chat import ChatWrappers

LONGBENCH_INSTRUCTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
)


@dataclass(frozen=True)
class RagPrompt:
    """``system`` and ``preamble`` precede the documents; ``question_template`` (with ``{question}``) follows."""

    system: str = "You are a helpful assistant."
    preamble: str = "Use the following documents to answer.\n\n"
    question_template: str = "Question: {question}\nAnswer:"
    passage_template: str = "{text}\n\n"

    @classmethod
    def longbench(cls) -> RagPrompt:
        """LongBench's multi-doc QA prompt (hotpotqa, 2wikimqa, musique), as one user turn."""
        return cls(
            system="You are a helpful assistant.",
            preamble=f"{LONGBENCH_INSTRUCTION}\n\nThe following are given passages.\n",
            question_template=f"{LONGBENCH_INSTRUCTION}\n\nQuestion: {{question}}\nAnswer:",
            passage_template="Passage {index}:\n{title}\n{text}\n\n",
        )

    def head(self, wrappers: ChatWrappers, preamble: str | None = None) -> str:
        """Everything before the first document: system turn, the opening of the user turn, the preamble."""
        return (
            wrappers.wrap("system", self.system)
            + wrappers.open["user"]
            + (self.preamble if preamble is None else preamble)
        )

    def conversation_head(
        self,
        wrappers: ChatWrappers,
        system: str | None,
        history: Sequence[tuple[str, str]],
        preamble: str | None = None,
    ) -> str:
        """``head`` after a conversation: its ``system`` turn (None: ours), then its earlier ``(role, text)``
        turns, then the opening of the last user turn and the preamble. The history comes before the documents so
        that it is the same prefix at every turn (its KV computed once); the documents of this turn follow it."""
        turns = "".join(wrappers.wrap(role, text) for role, text in history)
        opening = wrappers.wrap("system", self.system if system is None else system) + turns + wrappers.open["user"]
        return opening + (self.preamble if preamble is None else preamble)

    def tail(self, wrappers: ChatWrappers, question: str) -> str:
        """Everything after the last document: the question, the end of the user turn, the reply opener."""
        body = self.question_template.format(question=question)
        return body + wrappers.close["user"] + wrappers.generation_prompt

    def passage(self, index: int, title: str, text: str) -> str:
        """One document as it appears in the prompt (``index`` is 1-based)."""
        return self.passage_template.format(index=index, title=title, text=text)

    def digest(self) -> str:
        """Identity of the cached part: a store's chunks are only valid for the same head text."""
        return hashlib.sha256(f"{self.system}\x00{self.preamble}".encode()).hexdigest()[:16]
