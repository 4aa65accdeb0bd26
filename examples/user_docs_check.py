"""A new user's first store: 8 short made-up documents, 8 questions, every candidate mode against full prefill.

Issue 32: on a store of short invented documents whose vocabulary overlaps (two towers, two units, the
people who built them), the default mode answered "Professor Ilsa Wenhart" where the documents, and full
prefill, say "Mirela Vantok". This script builds such a store the way ``pc-rag index`` does (LongBench
prompt, MiniLM retrieval, one chunk per document), asks each question as ``pc-rag ask -k 3`` does, and
counts per mode the answers identical to full prefill's and the answers that contain the documents' fact.
It measures no time; the eval runs in ``examples/results`` give speed. This script knows nothing about how
a mode recovers: it calls ``PromptServer.answer`` and ``answer_full``.

    OMP_NUM_THREADS=1 python examples/user_docs_check.py --json examples/results/user_docs_modes.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pc_rag.cli.store_commands import engine_for
from pc_rag.model import DEFAULT_MODEL, load_model
from pc_rag.rag.modes import resolve_mode
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

DOCS = {
    "zorblax.txt": "The Zorblax Tower stands on the northern bank of the river Pell in the city of Ostrava Nine. "
    "It was designed by the architect Mirela Vantok and finished in 1887. The tower is 214 meters tall and is "
    "built from grey basalt.",
    "quenfield.txt": "The Quenfield Spire is a tower in the harbor town of Lune. Professor Ilsa Wenhart designed "
    "the spire in 1902, and it was opened by Mayor Tobin Crale. The spire is 96 meters tall and is made of red "
    "brick.",
    "trune.txt": "In the Pell Valley measuring system, one trune equals 40 pips. Traders used the trune to weigh "
    "grain, and a sack of grain held 12 trunes.",
    "vorn.txt": "The vorn is a unit of time used by the river boatmen of Ostrava Nine. One vorn equals 31 hours. "
    "A trip by boat from Ostrava Nine to Lune took three vorns.",
    "vantok.txt": "Mirela Vantok was born in Lune in 1851. Before she became an architect she worked as a grain "
    "trader, weighing sacks in trunes. She studied under Aldo Wenhart, the father of Professor Ilsa Wenhart.",
    "wenhart.txt": "Professor Ilsa Wenhart taught engineering at the Lune Academy for thirty years. She wrote a "
    "book about towers called The Leaning Stone in 1910. She never built anything in Ostrava Nine.",
    "lanterns.txt": "The Festival of Lanterns in Ostrava Nine is held every spring at the foot of the Zorblax "
    "Tower. It was founded in 1890 by the boatman Pavel Oduro. Each lantern must weigh exactly one trune.",
    "kelvet.txt": "Kelvet is a drink brewed in Lune from blue barley. One cup of kelvet costs 3 pips. The brewer "
    "Ossian Marr invented kelvet in 1875, and Mayor Tobin Crale made it the town's official drink.",
}
QUESTIONS = [  # (question, the fact the right answer contains, lower case)
    ("Who designed the Zorblax Tower?", "vantok"),
    ("What does one trune equal?", "40 pips"),
    ("How long is one vorn?", "31 hours"),
    ("How tall is the Quenfield Spire?", "96"),
    ("Who founded the Festival of Lanterns?", "oduro"),
    ("Who invented kelvet?", "marr"),
    ("What is the Zorblax Tower built from?", "basalt"),
    ("Where did Professor Ilsa Wenhart teach?", "lune academy"),
]
MODES = ["naive", "prefix", "fast", "edge", "selective:0.1", "default", "query:0.05+adapter"]


def run(model: str, modes: list[str], k: int, max_new_tokens: int) -> dict[str, object]:
    lm = load_model(model)
    engine = engine_for(lm)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="pc-rag-user-docs-") as tmp:
        servers = {}  # one store per chunk encoding: naive encodes chunks alone, every other mode after the preamble
        for conditioned, mode in ((True, "prefix"), (False, "naive")):
            store = DocumentStore.create(Path(tmp) / mode, engine, mode=mode)
            store.add_documents([(text, {"source": name}) for name, text in DOCS.items()], progress=False)
            servers[conditioned] = PromptServer(store=store)
        for question, fact in QUESTIONS:
            full = servers[True].answer_full(question, k=k, max_new_tokens=max_new_tokens)
            expected = full.text.strip()
            row: dict[str, object] = {
                "question": question, "fact": fact, "sources": [h.metadata["source"] for h in full.sources],
                "full": {"answer": expected, "correct": fact in expected.lower()},
            }  # fmt: skip
            for mode in modes:
                server = servers[resolve_mode(mode).conditioned]
                answer = server.answer(question, k=k, mode=mode, max_new_tokens=max_new_tokens).text.strip()
                row[mode] = {"answer": answer, "correct": fact in answer.lower(), "identical": answer == expected}
            rows.append(row)
            print(f"{question}\n  full: {row['full']['answer']!r}")  # type: ignore[index]
            for mode in modes:
                print(f"  {mode}: {row[mode]['answer']!r}")  # type: ignore[index]
        for server in servers.values():
            server.store.close()  # type: ignore[union-attr]
    summary = {
        mode: {
            "n": len(rows),
            "identical_to_full": sum(r[mode]["identical"] for r in rows),  # type: ignore[index]
            "correct": sum(r[mode]["correct"] for r in rows),  # type: ignore[index]
        }
        for mode in modes
    }
    right = sum(r["full"]["correct"] for r in rows)  # type: ignore[index]
    summary["full"] = {"n": len(rows), "identical_to_full": len(rows), "correct": right}
    config = {"model": model, "fingerprint": lm.fingerprint(), "k": k, "max_new_tokens": max_new_tokens,
              "documents": DOCS, "modes": modes}  # fmt: skip
    return {"config": config, "summary": summary, "questions": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated recovery modes")
    parser.add_argument("-k", type=int, default=3, help="chunks retrieved per question (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="write config, per-mode counts and answers here")
    args = parser.parse_args()
    result = run(args.model, args.modes.split(","), args.k, args.max_new_tokens)
    for mode, counts in result["summary"].items():  # type: ignore[union-attr]
        print(f"{mode:>20}: {counts['identical_to_full']}/{counts['n']} identical to full, {counts['correct']} right")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
