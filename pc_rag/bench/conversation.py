"""TTFT per turn of a 10-turn ``+rag`` conversation, with the history's KV reused (``PrefixCache``) and without.

The store holds the bundled HotpotQA sample's passages for ``questions`` questions; the conversation asks those
questions in turn under a system message, each turn after the whole history. The run without the cache goes
first; its replies are the assistant turns of both runs, so both serve the same prompts. Requests run alone (no
scheduler). ``python -m pc_rag.bench.conversation`` prints the table. This module knows nothing about HTTP.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import LoadedModel, load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

SYSTEM = "You are a helpful assistant. Answer briefly from the documents."


def run_conversation_bench(
    lm: LoadedModel, turns: int = 10, k: int = 3, new_tokens: int = 16
) -> list[dict[str, float]]:
    """Per turn: prompt tokens, TTFT (ms) without and with the prefix cache, and the cached tokens of each."""
    questions = sample_questions()[:turns]
    with tempfile.TemporaryDirectory(prefix="pc-rag-conversation-") as tmp:
        store = DocumentStore.create(Path(tmp) / "store", RagEngine(lm, RagPrompt.longbench()))
        docs = {f"{t}\n{x}": {"title": t} for q in questions for t, x in q.passages[:4]}
        store.add_documents(list(docs.items()))
        rows: list[dict[str, float]] = [{} for _ in questions]
        replies: list[str] = []
        for label, cache in (("plain", None), ("cached", PrefixCache())):
            server = PromptServer(store=store, prefix_cache=cache)
            history: list[tuple[str, str]] = []
            for i, q in enumerate(questions):
                history.append(("user", q.question))
                turn = list(history)
                answer = server.answer_chat(turn, SYSTEM, k, max_new_tokens=new_tokens)
                stats = answer.result.stats
                if cache is None:
                    replies.append(answer.text.strip() or "I do not know.")
                history.append(("assistant", replies[i]))
                rows[i] |= {
                    "turn": i + 1, "prompt_tokens": stats.cached_tokens + stats.computed_tokens,
                    f"{label}_ttft_ms": stats.ttft_ms, f"{label}_cached": stats.cached_tokens,
                }  # fmt: skip
        store.close()
    return rows


def format_conversation(rows: list[dict[str, float]]) -> str:
    lines = [f"{'turn':>4} {'prompt':>7} {'no cache ms':>12} {'cache ms':>9} {'cached tok (no/yes)':>20}"]
    for r in rows:
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['plain_ttft_ms']:>12.0f} {r['cached_ttft_ms']:>9.0f} "
            f"{int(r['plain_cached']):>9}/{int(r['cached_cached'])}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the rows, the machine and the commit here")
    args = parser.parse_args()
    result = run_conversation_bench(load_model(), args.turns)
    print(format_conversation(result))
    if args.json:
        from pc_rag.bench.answer_time import machine
        from pc_rag.bench.provenance import commit

        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": result}, indent=1) + "\n")
