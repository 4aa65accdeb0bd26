"""On the real SmolLM2: sixteen requests decoded together answer exactly as each does alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pc_rag.engine import PromptCache
from pc_rag.model import LoadedModel
from pc_rag.runtime.generate import collect
from pc_rag.runtime.scheduler import Scheduler

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
