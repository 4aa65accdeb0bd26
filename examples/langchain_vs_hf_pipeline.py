"""The same LangChain RAG chain on HuggingFacePipeline and on PromptCacheLLM: time to first token, same model.

Both chains retrieve the same chunks with ``PromptModuleRetriever`` and render the same chat
prompt (system turn, LongBench preamble, passages, question). The HuggingFacePipeline chain puts
the chunk text into the prompt and prefills all of it; the PromptCacheLLM chain puts module
references there and splices the chunks' cached KV. TTFT is the chain's wall time with one new
token (retrieval included in both), median of ``--runs`` per question after a warm-up.

    python examples/langchain_vs_hf_pipeline.py --questions 8 --json examples/results/langchain_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_huggingface import HuggingFacePipeline
from transformers import pipeline

from pc_rag import load_model
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.integrations.langchain import PromptCacheLLM, PromptModuleRetriever, format_modules
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.store.document_store import DocumentStore, module_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mode", default="default", help="PromptCacheLLM recovery mode")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    questions = sample_questions()[: args.questions]
    engine = RagEngine(load_model(), RagPrompt.longbench())
    with tempfile.TemporaryDirectory() as tmp:
        store = DocumentStore.create(Path(tmp) / "store", engine)
        passages = {f"{t}\n{x}": {"title": t} for q in questions for t, x in q.passages}
        store.add_documents(list(passages.items()), progress=False)
        rows = compare(engine, store, [q.question for q in questions], args)
    cached = statistics.median(r["pc_rag_ms"] for r in rows)
    hf = statistics.median(r["hf_pipeline_ms"] for r in rows)
    same = sum(r["same_answer"] for r in rows)
    print(f"{'question':<52} {'HF pipeline':>12} {'PromptCacheLLM':>15} {'speedup':>8}")
    for r in rows:
        print(f"{r['question'][:52]:<52} {r['hf_pipeline_ms']:>10.0f}ms {r['pc_rag_ms']:>13.0f}ms "
              f"{r['hf_pipeline_ms'] / r['pc_rag_ms']:>7.1f}x")  # fmt: skip
    print(f"median TTFT: HF pipeline {hf:.0f} ms, PromptCacheLLM ({args.mode}) {cached:.0f} ms, {hf / cached:.1f}x; "
          f"identical 32-token answers: {same}/{len(rows)}")  # fmt: skip
    if args.json:
        summary = {"hf_pipeline_ttft_ms_median": hf, "pc_rag_ttft_ms_median": cached, "speedup": hf / cached,
                   "same_answers": same, "k": args.k, "mode": args.mode, "runs": args.runs}  # fmt: skip
        args.json.write_text(json.dumps({"summary": summary, "questions": rows}, indent=2) + "\n")


def compare(engine: RagEngine, store: DocumentStore, questions: list[str], args: argparse.Namespace) -> list[dict]:
    retriever = PromptModuleRetriever(store=store, k=args.k)
    w, p = engine.wrappers, engine.prompt
    escape = lambda text: text.replace("{", "{{").replace("}", "}}")  # noqa: E731
    head = escape(p.head(w))
    tail = escape(p.question_template.replace("{question}", "\x00")).replace("\x00", "{question}")
    tail += escape(w.close["user"] + w.generation_prompt)
    # the PromptCacheLLM adds the chat turns itself; the pipeline gets them as text
    cached_prompt = PromptTemplate.from_template(escape(p.preamble) + "{context}" + p.question_template)
    text_prompt = PromptTemplate.from_template(head + "{context}" + tail)

    def as_text(docs: list) -> str:
        return "".join(module_text(d.page_content) for d in docs)

    pipe = pipeline("text-generation", model=engine.lm.model, tokenizer=engine.lm.tokenizer)

    def hf_chain(new_tokens: int) -> Runnable:
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "return_full_text": False}
        llm = HuggingFacePipeline(pipeline=pipe, pipeline_kwargs=settings)
        return {"context": retriever | as_text, "question": RunnablePassthrough()} | text_prompt | llm

    def cached_chain(new_tokens: int) -> Runnable:
        llm = PromptCacheLLM.from_store(store, mode=args.mode, max_tokens=new_tokens)
        return {"context": retriever | format_modules, "question": RunnablePassthrough()} | cached_prompt | llm

    chains = {"hf_pipeline_ms": hf_chain(1), "pc_rag_ms": cached_chain(1)}
    for chain in chains.values():
        chain.invoke(questions[0])  # warm-up
    rows = []
    for question in questions:
        row: dict = {"question": question}
        for name, chain in chains.items():
            row[name] = statistics.median(_wall_ms(chain, question) for _ in range(args.runs))
        reply = hf_chain(32).invoke(question)  # some langchain-huggingface versions return the prompt too
        row["hf_answer"] = reply.rsplit(w.generation_prompt, 1)[-1].strip()
        row["pc_rag_answer"] = cached_chain(32).invoke(question).strip()
        row["same_answer"] = row["hf_answer"] == row["pc_rag_answer"]
        rows.append(row)
    return rows


def _wall_ms(chain: Runnable, question: str) -> float:
    start = time.perf_counter()
    chain.invoke(question)
    return (time.perf_counter() - start) * 1000


if __name__ == "__main__":
    main()
