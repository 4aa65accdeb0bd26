"""On the real SmolLM2: sixteen requests decoded together answer exactly as each does alone, and so do +rag answers
in the default mode ``fast`` (the packaged splice adapter applied in the batched steps)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pc_rag.engine import PromptCache
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.generate import collect
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore

pytestmark = pytest.mark.real_model

SCHEMA = """<schema name="guide"><system>You are a concise travel guide. Answer from the notes.</system>
<module name="paris">The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It was built
from 1887 to 1889 and is 330 metres tall. The Louvre is the world's most visited museum.</module>
<module name="japan">Mount Fuji is the highest mountain in Japan at 3,776 metres. It is an active volcano on
Honshu, about 100 kilometres south-west of Tokyo.</module></schema>"""
QUESTIONS = ["How tall is the Eiffel Tower?", "When was the tower built?", "How high is Mount Fuji?",
             "Is Fuji a volcano?", "Where is Mount Fuji?", "What is the Louvre?", "Where is the Eiffel Tower?",
             "Which is higher, the tower or Fuji?"]  # fmt: skip


def test_sixteen_requests_together_answer_as_alone(smollm2: LoadedModel) -> None:
    pc = PromptCache(smollm2)
    pc.add_schema(SCHEMA)
    prompts = [f'<prompt schema="guide"><paris/><japan/><user>{q}</user></prompt>' for q in QUESTIONS * 2]
    alone = [pc.generate(p, max_new_tokens=12).token_ids for p in prompts]
    scheduler = Scheduler(pc.lm, max_batch=16)
    try:
        with ThreadPoolExecutor(max_workers=16) as threads:
            together = list(
                threads.map(lambda p: collect(scheduler.submit(pc.request(p, max_new_tokens=12))).token_ids, prompts)
            )
    finally:
        scheduler.close()
    assert together == alone


def test_default_mode_rag_answers_decode_together_as_alone(smollm2: LoadedModel, tmp_path) -> None:
    import numpy as np

    sample = sample_questions()[:4]
    engine = RagEngine(smollm2, RagPrompt())
    assert engine.default_mode == "fast"
    embed = as_embedder(lambda texts: np.ones((len(texts), 8), dtype=np.float32), name="constant")
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embed)
    store.add_documents([f"{title}: {text}" for q in sample for title, text in q.passages[:1]], progress=False)
    server = PromptServer(store=store)
    questions = [q.question for q in sample]
    alone = [server.answer(q, k=2, max_new_tokens=8).result.token_ids for q in questions]
    requests = [server.rag_request(q, k=2, max_new_tokens=8)[1] for q in questions]
    scheduler = Scheduler(smollm2, max_batch=4)
    try:
        handles = scheduler.call(lambda: [scheduler.submit(r) for r in requests])  # admitted in one round
        together = [collect(h).token_ids for h in handles]
    finally:
        scheduler.close()
    assert scheduler.served == {"batched": len(questions)} and scheduler.widest_step == len(questions)
    assert together == alone


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_a_request_prefilled_with_fifteen_others_gets_the_bits_it_gets_alone(dtype: str) -> None:
    """Sixteen prompts of 64-127 new tokens, as ``bench serve`` sends: one GEMM over all their rows gave every one
    of them other logits than alone on a 2-core Xeon, in int4 (the dense bfloat16 copy) and in float32."""
    import torch

    from pc_rag.kv import allocate
    from pc_rag.model import load_model
    from pc_rag.runtime.batch_prefill import BatchPrefill, PrefillJob

    lm = load_model(dtype=dtype)

    def jobs() -> list[PrefillJob]:
        g = torch.Generator().manual_seed(0)
        made = []
        for i in range(16):
            cached, new = 200, 64 + 4 * i + i % 3
            buffer = allocate(lm.model, cached + new + 8)
            for kv in (buffer.keys, buffer.values):
                kv[..., :cached, :] = torch.randn(kv[..., :cached, :].shape, generator=g).to(kv.dtype)
            ids = torch.randint(0, 40000, (new,), generator=g).tolist()
            made.append(PrefillJob(buffer, cached, ids, list(range(cached, cached + new))))
        return made

    prefill = BatchPrefill.of(lm.model)
    assert prefill is not None
    together = prefill(jobs())
    for i, job in enumerate(jobs()):
        assert torch.equal(prefill([job])[0], together[i]), f"request {i}"
