"""The bundled HotpotQA sample (see ``pc_rag/data/README.md``): questions with their passages.

This module knows nothing about models; it only reads the packaged JSONL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files


@dataclass(frozen=True)
class SampleQuestion:
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[tuple[str, str], ...]  # (title, text)


def sample_questions() -> list[SampleQuestion]:
    """All questions of the bundled sample, in file order."""
    text = files("pc_rag").joinpath("data/hotpotqa_sample.jsonl").read_text(encoding="utf-8")
    out = []
    for line in text.splitlines():
        row = json.loads(line)
        passages = tuple((p["title"], p["text"]) for p in row["passages"])
        out.append(SampleQuestion(row["id"], row["question"], tuple(row["answers"]), passages))
    return out
