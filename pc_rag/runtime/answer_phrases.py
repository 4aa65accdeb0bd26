"""Drafts from the model's own stock phrases: what its answers to training questions said after the same words.

Prompt lookup (``speculation.PromptLookup``) drafts what the passages say, so an answer that copies nothing gets no
drafts: "The answer to this question is:" is the model's phrasing, not the passages'. A model repeats its
phrasing across questions, so the continuations it generated after the same last tokens on other questions are
good drafts (a retrieval datastore of outputs, as REST (He et al. 2024) and SGLang's n-gram speculation keep;
here fitted once, offline, on the model's greedy answers to training questions, and frozen). Drafts are only
proposals: verification keeps a greedy output bit-identical to plain decoding whatever the table says.

The table maps the last 1 to ``max_context`` tokens of an answer (an answer shorter than that is prefixed with
``START``, so an answer's opening words are their own context) to the token most often generated next, kept
where it was at least ``min_count`` times and at least ``min_share`` of that context's continuations. It is
stored as JSON beside the model's other fitted files (``rag.tuned``), never pickled. This module knows nothing
about models: it sees token ids.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

START = -1
"""Stands before an answer's first token in a context: the answer's opening words are a context of their own."""
FORMAT = "pc-rag answer phrases 1"


class PhrasesError(ValueError):
    """A phrase table file that is not one (wrong format, wrong fields, wrong types)."""


@dataclass(frozen=True)
class Continuation:
    token: int
    count: int
    """Times ``token`` followed the context in the fitted answers."""
    total: int
    """Times the context was followed by any token."""


class AnswerPhrases:
    """The fitted table: ``draft(answer, count)`` proposes up to ``count`` tokens after the answer so far."""

    def __init__(self, table: dict[tuple[int, ...], Continuation], max_context: int, source: str = "") -> None:
        self._table = table
        self.max_context = max_context
        self.source = source
        """What it was fitted on (free text, kept in the file)."""

    def __len__(self) -> int:
        return len(self._table)

    @classmethod
    def fit(
        cls,
        answers: Iterable[Sequence[int]],
        *,
        max_context: int = 3,
        min_count: int = 2,
        min_share: float = 0.5,
        source: str = "",
    ) -> AnswerPhrases:
        """The table of ``answers`` (each the generated token ids, its stop token included where it stopped)."""
        if max_context < 1 or min_count < 1 or not 0 < min_share <= 1:
            msg = f"max_context {max_context}, min_count {min_count} and min_share {min_share} must be positive"
            raise ValueError(msg)
        counts: dict[tuple[int, ...], Counter[int]] = {}
        for answer in answers:
            ids = [START, *answer]
            for t in range(2, len(ids)):  # the answer's first token comes from the prefill: never drafted
                for n in range(1, min(max_context, t) + 1):
                    counts.setdefault(tuple(ids[t - n : t]), Counter())[ids[t]] += 1
        table = {}
        for context, following in counts.items():
            token, count = following.most_common(1)[0]
            total = sum(following.values())
            if count >= min_count and count >= min_share * total:
                table[context] = Continuation(token, count, total)
        return cls(table, max_context, source)

    def draft(self, answer: Sequence[int], count: int) -> tuple[list[int], int, bool]:
        """Up to ``count`` drafts after ``answer`` (the tokens generated so far), each the continuation of the
        longest context the table holds; the length of the first draft's context (0: no drafts), and whether
        every fitted occurrence of that context was followed by the first draft."""
        ids = list(answer[-self.max_context :])
        if len(answer) < self.max_context:
            ids.insert(0, START)
        drafts: list[int] = []
        matched, agreed = 0, False
        while len(drafts) < count:
            found = self._continuation(ids)
            if found is None:
                break
            n, continuation = found
            if not drafts:
                matched, agreed = n, continuation.count == continuation.total
            drafts.append(continuation.token)
            ids.append(continuation.token)
        return drafts, matched, agreed

    def _continuation(self, ids: Sequence[int]) -> tuple[int, Continuation] | None:
        for n in range(min(self.max_context, len(ids)), 0, -1):
            found = self._table.get(tuple(ids[len(ids) - n :]))
            if found is not None:
                return n, found
        return None

    def save(self, path: Path) -> None:
        entries = [[*context, c.token, c.count, c.total] for context, c in sorted(self._table.items())]
        document = {"format": FORMAT, "source": self.source, "max_context": self.max_context, "entries": entries}
        path.write_text(json.dumps(document, separators=(",", ":")) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> AnswerPhrases:
        """The table saved at ``path``; ``PhrasesError`` naming the file and the field for anything else."""
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            msg = f"{path}: not a readable phrase table ({error})"
            raise PhrasesError(msg) from error
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            msg = f"{path}: expected a JSON object with format {FORMAT!r}"
            raise PhrasesError(msg)
        max_context = document.get("max_context")
        entries = document.get("entries")
        if not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
            msg = f"{path}: max_context must be a positive integer, got {max_context!r}"
            raise PhrasesError(msg)
        if not isinstance(entries, list):
            msg = f"{path}: entries must be a list"
            raise PhrasesError(msg)
        table = {}
        for i, entry in enumerate(entries):
            if (
                not isinstance(entry, list)
                or not 4 <= len(entry) <= max_context + 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            ):
                msg = f"{path}: entry {i} must be 1 to {max_context} context ids, then token, count, total (integers)"
                raise PhrasesError(msg)
            *context, token, count, total = entry
            if not 0 < count <= total or token < 0 or any(v < START for v in context):
                msg = f"{path}: entry {i} has a negative id or a count outside 1..total: {entry}"
                raise PhrasesError(msg)
            table[tuple(context)] = Continuation(token, count, total)
        return cls(table, max_context, str(document.get("source", "")))
