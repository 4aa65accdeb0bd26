"""``pc-rag tune-phrases``: fit the model's stock phrases (``runtime.answer_phrases``) on its own answers.

The model answers the tuning split's questions (HotpotQA 300-699, never evaluated) from their own passages with
the engine's prompt, greedily, in the default mode and in ``naive`` (up to ``MAX_NEW_TOKENS`` tokens, the stop
token kept where it stopped), and the table is fitted on those answers. No gold answer is involved: the drafts
are what this model says, so they are kept where it says them again. This module knows nothing about serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import load_examples, tuning_split
from pc_rag.rag.engine import RagEngine
from pc_rag.runtime.answer_phrases import AnswerPhrases

MAX_NEW_TOKENS = 64
"""As the bench's answers (``bench.answer_rows.MAX_TOKENS``)."""


def model_answers(
    engine: RagEngine, dataset: Path, questions: int | None = None, modes: Sequence[str] = (), progress: bool = True
) -> list[list[int]]:
    """The greedy answers (token ids, the stop token kept where the answer stopped) of the first ``questions`` of
    the tuning split in ``dataset``, in each of ``modes`` (default: the engine's default mode and ``naive``)."""
    split = tuning_split(load_examples(dataset))[:questions]
    if not split:
        msg = f"{dataset} holds no questions of the tuning split (HotpotQA 300-699) to fit stock phrases on"
        raise PCRagError(msg)
    modes = tuple(dict.fromkeys(modes or (engine.default_mode, "naive")))
    stop = min(engine.stop_ids)
    answers = []
    for example in tqdm(split, desc="answers", unit="question", disable=not progress):
        texts = [engine.passage_text(i + 1, p.title, p.text) for i, p in enumerate(example.passages)]
        chunks = engine.encode(texts)
        for mode in modes:
            result = engine.answer(chunks, example.question, mode, max_new_tokens=MAX_NEW_TOKENS, speculative=False)
            ids = list(result.token_ids)
            answers.append(ids if len(ids) == MAX_NEW_TOKENS else [*ids, stop])
    return answers


def fit_phrases(engine: RagEngine, dataset: Path, questions: int | None = None, progress: bool = True) -> AnswerPhrases:
    """The stock phrases of the model's answers to the tuning split (``model_answers``)."""
    answers = model_answers(engine, dataset, questions, progress=progress)
    split = "HotpotQA tuning split (300-699)"
    split = split if questions is None else f"first {questions} of the {split}"
    source = f"{len(answers)} greedy answers ({engine.default_mode}, naive) to the {split}, {engine.lm.compute_dtype}"
    return AnswerPhrases.fit(answers, source=source)
