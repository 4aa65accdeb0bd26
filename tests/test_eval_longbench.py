"""LongBench's qa_f1_score, checked on hand-computed cases (the conventions of LongBench's metrics.py)."""

from __future__ import annotations

import pytest

from pc_rag.eval.longbench import best_f1, context_text, normalize_answer, passage_text, qa_f1_score


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The Eiffel Tower.", "eiffel tower"),
        ("  U.S.A.\n", "usa"),
        ("the-end", "theend"),  # punctuation goes before articles, so this is one token and no article
        ("A theater, an apple and THE end", "theater apple and end"),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize(
    ("prediction", "gold", "f1"),
    [
        ("Miller v. California", "Miller v. California", 1.0),  # LongBench hotpotqa-style exact answer
        ("Gates v. Collier", "Miller v. California", 1 / 3),  # only "v" is shared: p = r = 1/3
        ("The Eiffel Tower", "eiffel tower", 1.0),
        ("Paris, France", "Paris", 2 / 3),  # p = 1/2, r = 1
        ("an apple a day", "apple", 2 / 3),  # "apple day" vs "apple"
        ("new york new york", "New York", 2 / 3),  # multiset overlap: 2 shared tokens of 4 predicted
        ("1 June 1983", "June 1, 1983", 1.0),  # order does not matter
        ("no", "yes", 0.0),
        ("", "Tulsa", 0.0),
        ("the", "The", 0.0),  # both normalize to nothing: LongBench scores 0
    ],
)
def test_qa_f1_score(prediction: str, gold: str, f1: float) -> None:
    assert qa_f1_score(prediction, gold) == pytest.approx(f1)


def test_best_f1_is_the_max_over_answers() -> None:
    assert best_f1("Tulsa, Oklahoma", ["Oklahoma City", "Tulsa"]) == pytest.approx(2 / 3)
    assert best_f1("Tulsa", ["Tulsa", "Oklahoma"]) == 1.0
    assert best_f1("anything", []) == 0.0


def test_context_pieces() -> None:
    assert passage_text(2, "Title", "Body.") == "Passage 2:\nTitle\nBody.\n\n"
    assert context_text([("A", "a."), ("B", "b.")]) == "Passage 1:\nA\na.\n\nPassage 2:\nB\nb.\n\n"
