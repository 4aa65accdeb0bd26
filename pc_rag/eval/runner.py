"""Run every example through full prefill and each cached mode, resumably, and collect question records.

Closed context (LongBench): an example's own passages, in order, are its chunks, encoded once per
(example, mode) outside the timed path. Full prefill runs first per example and keeps its first
steps' logits; the other modes are compared with it, and teacher-forced with its first answer
tokens after their own answer is timed. Finished questions are appended to a JSONL state file, so
a rerun skips them. This module knows nothing about models or tokenizers: it drives any object
with the engine's ``encode / answer / answer_full / passage_text`` methods.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from pc_rag.errors import EvalError
from pc_rag.eval.codec_modes import base_mode, split_codec_mode, split_dtype_mode, stored
from pc_rag.eval.contexts import ClosedContexts, ContextSource
from pc_rag.eval.datasets import Example
from pc_rag.eval.metrics import FULL, TEACHER_FORCED_STEPS, QuestionRecord, make_record, teacher_forced_steps
from pc_rag.runtime.generate import GenerationResult

logger = logging.getLogger(__name__)

FULL_CHUNKS_MODE = "default"  # the encoding full prefill is given when no other mode of the example is due

Key = tuple[str, str, str, str]  # (setting, dataset, id, mode)


class EvalEngine(Protocol):
    """What the runner needs from ``pc_rag.rag.RagEngine``."""

    def encode(self, texts: list[str], mode: str) -> list[Any]: ...

    def chunk_encoder(self, mode: str) -> str: ...

    def answer(
        self,
        chunks: list[Any],
        question: str,
        mode: str,
        *,
        reference_ids: Sequence[int] | None = None,
        max_new_tokens: int = 32,
    ) -> GenerationResult: ...

    def answer_full(
        self, chunks: list[Any], question: str, *, max_new_tokens: int = 32, keep_logits: int = 0
    ) -> GenerationResult: ...

    def passage_text(self, i: int, title: str, text: str) -> str: ...


def parse_modes(
    spec: str | Sequence[str], known: Iterable[str], accepts: Callable[[str], bool] | None = None
) -> list[str]:
    """The requested modes in order, without repeats; ``known`` are the engine's mode names (``full`` is added),
    ``accepts`` also admits other specs (such as budgeted modes, ``selective:0.25``).

    Raises ``EvalError`` listing the known names for an unknown or empty request.
    """
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    modes = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    allowed = [FULL, *sorted(set(known) - {FULL})]
    unknown = [m for m in modes if m not in allowed and not (accepts and accepts(m))]
    if unknown or not modes:
        what = f"unknown mode(s) {', '.join(map(repr, unknown))}" if unknown else "no mode given"
        msg = f"{what}; known modes: {', '.join(allowed)}"
        raise EvalError(msg)
    return modes


def run_eval(
    engine: EvalEngine,
    examples: Sequence[Example],
    modes: Sequence[str],
    contexts: ContextSource | None = None,
    state_path: str | Path | None = None,
    max_new_tokens: int = 32,
    progress: bool = True,
    reference: EvalEngine | None = None,
    codec: Any | None = None,
) -> list[QuestionRecord]:
    """Answer every example in ``full`` (always, first) and each of ``modes``; one record per (example, mode).

    Modes ``<mode>@cachegen:<level>`` answer from chunks round-tripped through ``codec`` (a
    ``CacheGenCodec``), modes ``<mode>@<dtype>`` from chunks whose KV was rounded to that storage dtype
    (``pc_rag.eval.codec_modes``); both are compared with ``<mode>`` on the chunks as encoded.

    ``reference`` answers ``full`` instead of ``engine`` (the same model in another dtype: every mode, and the
    engine's own full prefill as ``selective:1.0``, is then measured against it).

    ``contexts`` supplies each example's chunks (default: closed context, its own passages).
    With ``state_path``, records already there are reused and each new one is appended as it finishes.
    Returns the records of these examples in example order, ``full`` first, then ``modes`` order.
    """
    contexts = contexts if contexts is not None else ClosedContexts(engine)
    setting = contexts.setting
    run_modes = [FULL, *(m for m in dict.fromkeys(modes) if m != FULL)]
    if codec is None and any(split_codec_mode(m)[1] is not None for m in run_modes):
        raise EvalError("modes over compressed chunks (<mode>@cachegen:<level>) need a codec")
    for mode in run_modes:
        split_dtype_mode(mode)  # EvalError for an unknown storage dtype, before anything runs
    done = load_state(state_path) if state_path is not None else {}
    keys = [[(setting, ex.dataset, ex.id, mode) for mode in run_modes] for ex in examples]
    already = sum(k in done for row in keys for k in row)
    total = len(keys) * len(run_modes)
    if already:
        logger.warning("resuming: %d of %d questions already done in %s", already, total, state_path)
    bar = tqdm(total=total, initial=already, desc="eval", unit="q", disable=not progress)
    with _appender(state_path) as save, bar:
        for example, example_keys in zip(examples, keys, strict=True):
            todo = [k for k in example_keys if k not in done]
            if todo:
                run = _run_example(engine, contexts, example, todo, max_new_tokens, reference or engine, codec)
                for record in run:
                    done[(setting, record.dataset, record.id, record.mode)] = record
                    save(record)
                    bar.update()
    return [done[k] for row in keys for k in row]


def _run_example(
    engine: EvalEngine,
    contexts: ContextSource,
    example: Example,
    todo: list[Key],
    max_new_tokens: int,
    reference: EvalEngine,
    codec: Any | None,
) -> Iterator[QuestionRecord]:
    """Yield the records of the ``todo`` keys of one example; full prefill runs (again) whenever a mode needs it."""

    def chunks(mode: str) -> list[Any]:  # encoding is not timed: TTFT is measured inside answer()
        return contexts.chunks(example, mode)

    recall = contexts.recall(example)

    def record(mode: str, chunk_list: list[Any], result: GenerationResult, plain: Any = None) -> QuestionRecord:
        return make_record(
            plain_first_logits=plain,
            setting=todo[0][0],
            dataset=example.dataset,
            example_id=example.id,
            mode=mode,
            answers=example.answers,
            context_tokens=sum(len(c.token_ids) for c in chunk_list),
            result=result,
            full=full,
            retrieval_recall=recall,
        )

    # Full's first steps' logits stay in memory while this example's modes run; after a resume the
    # full prefill is simply recomputed (greedy, deterministic) rather than stored in the state file.
    # Full prefill only reads the chunks' token ids, which no mode changes: reuse the first mode's encoding.
    full_chunks = chunks(next((base_mode(m) for *_, m in todo if m != FULL), FULL_CHUNKS_MODE))
    full = reference.answer_full(
        full_chunks, example.question, max_new_tokens=max_new_tokens, keep_logits=TEACHER_FORCED_STEPS
    )
    reference = full.token_ids[: teacher_forced_steps(full) - 1]  # the last forced step needs no token fed
    plain_first = {}  # mode on chunks as encoded -> its first-step logits, for its stored twins
    for *_, mode in todo:
        if mode == FULL:
            yield record(FULL, full_chunks, full)
            continue
        base = base_mode(mode)
        mode_chunks = stored(chunks(base), mode, codec)
        result = engine.answer(
            mode_chunks, example.question, base, reference_ids=reference, max_new_tokens=max_new_tokens
        )
        if base == mode:
            plain_first[base] = result.first_logits
            yield record(mode, mode_chunks, result)
            continue
        if base not in plain_first:  # its own record was done before a resume
            plain_first[base] = engine.answer(chunks(base), example.question, base, max_new_tokens=1).first_logits
        yield record(mode, mode_chunks, result, plain_first[base])


def load_state(path: str | Path) -> dict[Key, QuestionRecord]:
    """Records of a state file keyed by (setting, dataset, id, mode); a missing file is empty.

    A last line cut short by a crash is dropped from the file; any other unreadable line is an ``EvalError``.
    Fields with a default (added after older runs) may be missing: they take their default.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        logger.warning("dropping an unfinished last line of %s", path)
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    names = {f.name for f in fields(QuestionRecord)}
    required = {f.name for f in fields(QuestionRecord) if f.default is MISSING}
    records: dict[Key, QuestionRecord] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fix = "delete the file to start over"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            msg = f"{path}:{lineno}: invalid JSON in the state file ({e.msg}); {fix}"
            raise EvalError(msg) from e
        if not isinstance(obj, dict) or not required <= set(obj) <= names:
            msg = f"{path}:{lineno}: not a question record of this pc-rag version; {fix}"
            raise EvalError(msg)
        record = QuestionRecord(**obj)
        records[(record.setting, record.dataset, record.id, record.mode)] = record
    return records


@contextmanager
def _appender(path: str | Path | None) -> Iterator[Callable[[QuestionRecord], None]]:
    """A function that appends one record as a JSON line and flushes (a no-op without ``path``)."""
    if path is None:
        yield lambda record: None
        return
    with Path(path).open("a", encoding="utf-8") as f:

        def append(record: QuestionRecord) -> None:
            f.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
            f.flush()

        yield append
