"""Accuracy and latency evaluation of the RAG engine on multi-document QA (LongBench conventions).

The package knows nothing about how the engine caches: it loads examples, asks the engine for
answers in each mode and full prefill, scores and compares them, and reports.
"""

from pc_rag.eval.datasets import (
    TUNING_SPLIT,
    Example,
    Passage,
    in_tuning_split,
    load_datasets,
    load_examples,
    split_longbench_context,
    tuning_split,
)
from pc_rag.eval.longbench import best_f1, normalize_answer, qa_f1_score
from pc_rag.eval.metrics import FULL, QuestionRecord, ResultRow, aggregate, first_token_kl, paired_bootstrap_ci
from pc_rag.eval.report import format_table, plot, results_json, write_json
from pc_rag.eval.runner import EvalEngine, load_state, parse_modes, run_eval

__all__ = [
    "FULL",
    "TUNING_SPLIT",
    "EvalEngine",
    "Example",
    "Passage",
    "QuestionRecord",
    "ResultRow",
    "aggregate",
    "best_f1",
    "first_token_kl",
    "format_table",
    "in_tuning_split",
    "load_datasets",
    "load_examples",
    "load_state",
    "normalize_answer",
    "paired_bootstrap_ci",
    "parse_modes",
    "plot",
    "qa_f1_score",
    "results_json",
    "run_eval",
    "split_longbench_context",
    "tuning_split",
    "write_json",
]
