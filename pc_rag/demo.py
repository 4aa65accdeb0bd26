"""``pc-rag demo``: answer sample HotpotQA questions from cached passage modules, next to full prefill.

Until the document store exists, each question's own passages form one schema
(a module per passage, encoded once); the demo prints each answer with its TTFT
cached and by full prefill of the same tokens. It knows nothing about retrieval.
"""

from __future__ import annotations

from pc_rag.engine import PromptCache
from pc_rag.pml.builder import PromptBuilder, SchemaBuilder
from pc_rag.sample import sample_questions

SYSTEM = "You are a helpful assistant. Answer from the passages in a few words."


def run_demo(pc: PromptCache, count: int) -> None:
    """Print ``count`` sample questions answered cached and by full prefill, with TTFT of each."""
    print(f"{'question':<60} {'cached ms':>9} {'full ms':>8}  answer (cached | full)")
    for i, q in enumerate(sample_questions()[:count]):
        builder = SchemaBuilder(f"q{i}").system(SYSTEM)
        prompt = PromptBuilder(f"q{i}")
        for j, (title, text) in enumerate(q.passages):
            builder.module(f"p{j}", f"Passage {j + 1}:\n{title}\n{text}\n\n")
            prompt.use(f"p{j}")
        pc.add_schema(builder.build())
        prompt.user(f"Question: {q.question}")
        cached = pc.generate(prompt.build(), max_new_tokens=24)
        full = pc.generate_full(prompt.build(), max_new_tokens=24)
        print(f"{q.question[:60]:<60} {cached.stats.ttft_ms:>9.0f} {full.stats.ttft_ms:>8.0f}  "
              f"{cached.text.strip()!r} | {full.text.strip()!r}  (gold: {q.answers[0]!r})")  # fmt: skip
        del pc.schemas[f"q{i}"]
