"""Load multi-document QA examples from JSONL: our format or LongBench's, detected per line.

Our format: ``{"id", "dataset", "question", "answers", "passages": [{"title", "text", "is_supporting"}]}``.
LongBench's: ``{"_id", "input", "context", "answers", "dataset"?}`` with ``context`` made of
``Passage N:\\n{title}\\n{text}`` pieces. This module knows nothing about models, prompts or scoring.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pc_rag.errors import EvalError

_PASSAGE_HEADER = re.compile(r"^Passage \d+:[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Passage:
    """One candidate passage; ``is_supporting`` is None when the source does not say."""

    title: str
    text: str
    is_supporting: bool | None = None


@dataclass(frozen=True)
class Example:
    """One question with its gold answers and its own passages, in source order."""

    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]


def load_datasets(paths: Iterable[str | Path], limit: int | Sequence[int] | None = None) -> list[Example]:
    """Examples of every file in ``paths``, in order; ``limit`` keeps the first N of each file (or N_i of file i)."""
    paths = list(paths)
    limits = list(limit) if isinstance(limit, Sequence) else [limit] * len(paths)
    if len(limits) != len(paths):
        msg = f"{len(limits)} limits for {len(paths)} dataset files: give one limit, or one per --dataset"
        raise EvalError(msg)
    return [example for path, n in zip(paths, limits, strict=True) for example in load_examples(path, n)]


def load_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """The examples of one JSONL file (blank lines skipped); the dataset name defaults to the file stem.

    Raises ``EvalError`` naming the file and line for a missing file, invalid JSON, missing
    fields, or an id that repeats within a dataset (results are keyed by dataset and id).
    """
    path = Path(path)
    if not path.is_file():
        msg = f"dataset file not found: {path}"
        raise EvalError(msg)
    if limit is not None and limit < 1:
        msg = f"--limit must be >= 1, got {limit}"
        raise EvalError(msg)
    examples: list[Example] = []
    seen: set[tuple[str, str]] = set()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                msg = f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
                raise EvalError(msg) from e
            example = parse_example(obj, default_dataset=path.stem, where=where)
            key = (example.dataset, example.id)
            if key in seen:
                msg = f"{where}: id {example.id!r} repeats in dataset {example.dataset!r}; ids must be unique"
                raise EvalError(msg)
            seen.add(key)
            examples.append(example)
    return examples


def parse_example(obj: Any, default_dataset: str, where: str = "<input>") -> Example:
    """One parsed JSON line in either format (``passages`` → ours, ``context`` + ``input`` → LongBench)."""
    if not isinstance(obj, dict):
        msg = f"{where}: expected a JSON object, got {type(obj).__name__}"
        raise EvalError(msg)
    if "passages" in obj:
        _require(obj, ("id", "question", "answers"), where)
        if not isinstance(obj["passages"], list):
            msg = f"{where}: 'passages' must be a list of objects"
            raise EvalError(msg)
        passages = tuple(_parse_passage(p, where) for p in obj["passages"])
        question, example_id = obj["question"], obj["id"]
    elif "context" in obj and "input" in obj:
        _require(obj, ("_id", "answers"), where)
        passages = tuple(split_longbench_context(str(obj["context"])))
        if not passages:
            msg = f"{where}: LongBench context has no 'Passage N:' header; is this a multi-doc QA task?"
            raise EvalError(msg)
        question, example_id = obj["input"], obj["_id"]
    else:
        msg = (
            f"{where}: unknown format (keys {sorted(obj)}); expected 'id', 'question', 'answers', 'passages' "
            "or LongBench's '_id', 'input', 'context', 'answers'"
        )
        raise EvalError(msg)
    answers = obj["answers"]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        msg = f"{where}: 'answers' must be a list of strings, got {answers!r}"
        raise EvalError(msg)
    dataset = obj.get("dataset") or default_dataset
    return Example(str(dataset), str(example_id), str(question), tuple(answers), passages)


def split_longbench_context(context: str) -> list[Passage]:
    """Split a LongBench context at its ``Passage N:`` header lines; title = first line, text = the rest.

    Text before the first header (none in LongBench's multi-doc QA) is dropped.
    """
    headers = list(_PASSAGE_HEADER.finditer(context))
    passages = []
    ends = [h.start() for h in headers[1:]] + [len(context)] if headers else []
    for header, end in zip(headers, ends, strict=True):
        body = context[header.end() : end].strip("\n")
        title, _, text = body.partition("\n")
        passages.append(Passage(title.strip(), text.strip(), None))
    return passages


def _parse_passage(p: Any, where: str) -> Passage:
    if not isinstance(p, dict) or "title" not in p or "text" not in p:
        msg = f"{where}: each passage must be an object with 'title' and 'text', got {str(p)[:80]!r}"
        raise EvalError(msg)
    supporting = p.get("is_supporting")
    return Passage(str(p["title"]), str(p["text"]), None if supporting is None else bool(supporting))


def _require(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        msg = f"{where}: missing field(s) {', '.join(map(repr, missing))}"
        raise EvalError(msg)
