"""Teacher data for self-distillation: full prefill's greedy answer and its next-token distributions.

For each training pair the teacher is the model itself after a full prefill of the same
tokens: its greedy answer (up to ``steps`` tokens; the step that predicts EOS is kept) and,
at every step, the ``top`` most likely tokens with their log-probabilities (fp32) — enough
to compute KL(teacher || student) with the remaining mass as one bucket. A teacher set is
a directory: ``teacher.jsonl`` (one line per finished pair: key, answer ids, part file)
and ``parts/<n>.safetensors`` holding ``<key>.logp`` and ``<key>.index`` [steps, top].
A part is written completely (atomically renamed) before its lines are appended, so an
interrupted run loses at most the pairs in flight and resumes where it stopped. Nothing is
pickled. This module knows nothing about adapters or training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pc_rag.errors import PCRagError
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.tune.pairs import PairSource

STEPS = 8
TOP = 256


@dataclass(frozen=True)
class TeacherRecord:
    """Full prefill's greedy ``answer_ids`` and, per step, its ``top`` tokens: ``index`` and ``logp`` [steps, top]."""

    key: str
    answer_ids: tuple[int, ...]  # the tokens fed back while teacher-forcing (EOS, if predicted, is not one)
    index: torch.Tensor  # [steps, top] int64
    logp: torch.Tensor  # [steps, top] float32

    @property
    def steps(self) -> int:
        return int(self.index.shape[0])


def teach(
    engine: RagEngine, chunks: Sequence[Chunk], question: str, key: str, steps: int = STEPS, top: int = TOP
) -> TeacherRecord:
    """Full prefill of ``chunks`` and ``question`` as ``engine`` lays them out, then ``steps`` greedy steps."""
    full = engine.answer_full(chunks, question, max_new_tokens=steps, keep_logits=steps)
    assert full.step_logits is not None
    best = torch.topk(torch.log_softmax(full.step_logits, dim=-1), top)  # [steps run, top]
    answer = full.token_ids[: best.indices.shape[0] - 1]  # the last step's token (or EOS) is never fed back
    return TeacherRecord(key, tuple(answer), best.indices, best.values)


class TeacherSet:
    """A resumable directory of ``TeacherRecord``s, keyed by pair key."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._parts = self.directory / "parts"
        self._index = self.directory / "teacher.jsonl"
        self._entries: dict[str, dict] = {}
        if self._index.is_file():
            self._load_index()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def add_many(self, records: Iterable[TeacherRecord]) -> None:
        """Write ``records`` as one new part, then list them."""
        records = [r for r in records if r.key not in self._entries]
        if not records:
            return
        self._parts.mkdir(parents=True, exist_ok=True)
        name = f"{len(list(self._parts.glob('*.safetensors'))):05d}.safetensors"
        tensors = {}
        for r in records:
            tensors[f"{r.key}.index"] = r.index.contiguous()
            tensors[f"{r.key}.logp"] = r.logp.float().contiguous()
        staged = self._parts / f".{name}.tmp"
        save_file(tensors, str(staged))
        os.replace(staged, self._parts / name)
        lines = [{"key": r.key, "answer_ids": list(r.answer_ids), "part": name} for r in records]
        with self._index.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        for line in lines:
            self._entries[line["key"]] = line

    def get(self, key: str) -> TeacherRecord:
        """The record of ``key``; ``PCRagError`` when it is not in the set or its part is unreadable."""
        entry = self._entries.get(key)
        if entry is None:
            msg = f"no teacher record for pair {key!r} in {self.directory}"
            raise PCRagError(msg)
        path = self._parts / entry["part"]
        try:
            with safe_open(str(path), framework="pt") as f:
                index, logp = f.get_tensor(f"{key}.index"), f.get_tensor(f"{key}.logp")
        except (OSError, SafetensorError) as e:
            msg = f"teacher part {path} is unreadable for pair {key!r}: {e}"
            raise PCRagError(msg) from e
        return TeacherRecord(key, tuple(entry["answer_ids"]), index, logp)

    def _load_index(self) -> None:
        text = self._index.read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                key, part = entry["key"], entry["part"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if lineno == len(text.splitlines()) and not text.endswith("\n"):
                    break  # a line cut short by a crash: its pair is generated again
                msg = f"{self._index}:{lineno}: not a teacher record ({e}); delete the directory to start over"
                raise PCRagError(msg) from e
            if (self._parts / part).is_file():
                self._entries[key] = entry


def build_teacher(
    source: PairSource, teacher: TeacherSet, *, part: int = 16, progress: bool = True, total: int | None = None
) -> int:
    """Teach every pair of ``source`` not yet in ``teacher``, saving every ``part`` pairs; return how many were new.
    ``total`` (the pairs ``source`` yields, if known) gives the progress bar its ETA."""
    from tqdm import tqdm

    pending: list[TeacherRecord] = []
    new = 0
    bar = tqdm(desc="teacher", unit="pair", disable=not progress, initial=len(teacher), total=total)
    for pair in source.pairs():
        if pair.key in teacher:
            continue
        pending.append(teach(source.engine, source.chunks(pair), pair.question, pair.key))
        bar.update()
        if len(pending) == part:
            teacher.add_many(pending)
            new += len(pending)
            pending.clear()
    teacher.add_many(pending)
    bar.close()
    return new + len(pending)
