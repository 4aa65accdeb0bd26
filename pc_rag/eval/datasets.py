"""Load multi-document QA examples from JSONL: our format or LongBench's, detected per line.

Our format: ``{"id", "dataset", "question", "answers", "passages": [{"title", "text", "is_supporting"}]}``.
LongBench's: ``{"_id", "input", "context", "answers", "dataset"?}`` with ``context`` made of
``Passage N:\\n{title}\\n{text}`` pieces. ``TUNING_SPLIT`` names the examples reserved for training
adapters and fitting calibration constants, which evaluations skip by default. This module knows
nothing about models, prompts or scoring.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pc_rag.errors import EvalError

logger = logging.getLogger(__name__)

_PASSAGE_HEADER = re.compile(r"^Passage \d+:[ \t]*$", re.MULTILINE)

# Dataset name -> 0-based positions, in its file, of the examples reserved for tuning: HotpotQA 300-699 of
# ../shared/data/multidoc_qa/hotpotqa.jsonl train adapters and fit calibration constants, so no evaluation
# may score them.
TUNING_SPLIT: Mapping[str, range] = MappingProxyType({"hotpotqa": range(300, 700)})


@dataclass(frozen=True)
class Passage:
    """One candidate passage; ``is_supporting`` is None when the source does not say."""

    title: str
    text: str
    is_supporting: bool | None = None


@dataclass(frozen=True)
class Example:
    """One question with its gold answers and its own passages, in source order.

    ``index`` is its 0-based position among the examples of the file it was loaded from (None otherwise).
    """

    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[Passage, ...]
    index: int | None = None


def in_tuning_split(example: Example) -> bool:
    """Whether ``example`` is reserved for tuning (``TUNING_SPLIT``): by its dataset and position in its file."""
    return example.index is not None and example.index in TUNING_SPLIT.get(example.dataset, range(0))


def tuning_split(examples: Iterable[Example]) -> list[Example]:
    """The examples of ``examples`` (loaded from their file) that are reserved for tuning, in order."""
    return [e for e in examples if in_tuning_split(e)]


def load_datasets(
    paths: Iterable[str | Path], limit: int | Sequence[int] | None = None, *, include_tuning_split: bool = False
) -> list[Example]:
    """The examples to evaluate of every file in ``paths``, in order.

    The tuning split is skipped (and the count logged) unless ``include_tuning_split``; ``limit`` then
    keeps the first N remaining examples of each file (or N_i of file i).
    """
    paths = list(paths)
    limits = list(limit) if isinstance(limit, Sequence) else [limit] * len(paths)
    if len(limits) != len(paths):
        msg = f"{len(limits)} limits for {len(paths)} dataset files: give one limit, or one per --dataset"
        raise EvalError(msg)
    return [
        example
        for path, n in zip(paths, limits, strict=True)
        for example in load_examples(path, n, skip_tuning_split=not include_tuning_split)
    ]


def load_examples(path: str | Path, limit: int | None = None, *, skip_tuning_split: bool = False) -> list[Example]:
    """The examples of one JSONL file (blank lines skipped); the dataset name defaults to the file stem.

    With ``skip_tuning_split`` the examples of ``TUNING_SPLIT`` are left out and counted in a log
    warning; ``limit`` counts the examples returned. Raises ``EvalError`` naming the file and line for
    a missing file, invalid JSON, missing fields, or an id that repeats within a dataset (results are
    keyed by dataset and id).
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
    skipped = 0
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
            position = len(seen)  # 0-based among the file's examples (every one before was added to seen)
            example = replace(parse_example(obj, default_dataset=path.stem, where=where), index=position)
            key = (example.dataset, example.id)
            if key in seen:
                msg = f"{where}: id {example.id!r} repeats in dataset {example.dataset!r}; ids must be unique"
                raise EvalError(msg)
            seen.add(key)
            if skip_tuning_split and in_tuning_split(example):
                skipped += 1
            else:
                examples.append(example)
    if skipped:
        split = ", ".join(f"{name} {r.start}-{r.stop - 1}" for name, r in TUNING_SPLIT.items())
        logger.warning("%s: skipped %d examples of the tuning split (%s)", path, skipped, split)
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
