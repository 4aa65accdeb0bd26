"""llama.cpp's rows of ``bench peers --answers``, timed in a process of its own.

llama.cpp and torch each keep a thread pool; in one process the idle pool of one competes with the other's
parallel regions, and a 2-core machine shows it (llama.cpp's 1K prefill took 3.5x longer beside torch). So the
parent sends the prompts (token ids) to ``python -m pc_rag.bench.llama_cpp_answers`` on stdin, after its own rows
are done, and reads the rows back as JSON. Rows: full prefill, the prefix cache warm (the documents evaluated by
an earlier request) and prompt-lookup decoding (``LlamaPromptLookupDecoding``) on the warm prefix.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import asdict
from functools import partial
from typing import Any

from pc_rag.bench.answer_rows import MAX_TOKENS, Answer, AnswerRow, line, measure

LLAMA_CPP_ROWS = ("llama.cpp full prefill", "llama.cpp, prefix cache warm", "llama.cpp, prompt lookup (warm)")


def unavailable(gguf: str | None) -> str | None:
    """Why llama.cpp's rows cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
    if gguf is None:
        return "the model was not loaded from a GGUF file"
    return None


def llama_cpp_rows(job: dict[str, Any]) -> list[AnswerRow]:
    """Run ``job`` in a child process; its progress lines reach this process's stderr as they are timed.

    ``job``: ``gguf``, ``threads``, ``context``, ``runs``, ``stop_ids`` and ``works``, a list of
    ``{question, ids, documents}``.
    """
    child = subprocess.run(
        [sys.executable, "-m", "pc_rag.bench.llama_cpp_answers"],
        input=json.dumps(job), stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    if child.returncode != 0:
        reason = f"the llama.cpp process failed (exit {child.returncode}; its error is printed above)"
        return [AnswerRow(name, 0, "", note=reason) for name in LLAMA_CPP_ROWS]
    return [AnswerRow(**row) for row in json.loads(child.stdout)]


def _run(job: dict[str, Any]) -> list[AnswerRow]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = job["threads"]
    settings = {"n_ctx": job["context"], "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    plain = Llama(model_path=job["gguf"], **settings)
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
    lookup = Llama(model_path=job["gguf"], draft_model=draft, logits_all=True, **settings)  # verify reads all rows
    stops = frozenset(job["stop_ids"]) | {plain.token_eos()}

    def answer(llm: Llama, prompt: list[int], limit: int = MAX_TOKENS) -> Answer:
        start = time.perf_counter()
        first, ids = 0.0, []
        for token in llm.generate(prompt, temp=0.0):
            if not ids:
                first = (time.perf_counter() - start) * 1000
            if token in stops:
                break
            ids.append(token)
            if len(ids) == limit:
                break
        return Answer(first, (time.perf_counter() - start) * 1000, ids, None)  # llama.cpp does not say

    def cold(ids: list[int]) -> Answer:
        plain.reset()  # forget every cached token: a full prefill
        return answer(plain, ids)

    def warm(llm: Llama, ids: list[int], documents: int) -> Answer:
        # an earlier request held the same preamble and documents (another question); generate() reuses the
        # longest common prefix of its context, so only the question is computed, as in our cached path
        llm.reset()
        answer(llm, ids[:documents], limit=1)
        return answer(llm, ids)

    rows: list[AnswerRow] = []
    cold_name, warm_name, lookup_name = LLAMA_CPP_ROWS
    for work in job["works"]:
        ids, documents, question = work["ids"], work["documents"], work["question"]
        runs = {
            cold_name: partial(cold, ids),
            warm_name: partial(warm, plain, ids, documents),
            lookup_name: partial(warm, lookup, ids, documents),
        }
        done: dict[str, AnswerRow] = {}
        for name, run in runs.items():
            row = measure(name, run, len(ids), question, job["runs"])
            row.threads = threads
            if name == lookup_name and row.note == "" and done[warm_name].note == "":
                row.same_as_plain = row.token_ids == done[warm_name].token_ids
            done[name] = row
            rows.append(row)
            print(line(row), file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    print(json.dumps([asdict(r) for r in _run(json.load(sys.stdin))]))
