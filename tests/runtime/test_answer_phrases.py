"""Stock-phrase drafts: the fitted table, its file, the lookup that falls back to it, and speculation through it
keeping the plain output bit for bit."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_weights import tiny_in

from pc_rag.engine import PromptCache
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text
from pc_rag.rag import tuned
from pc_rag.runtime.answer_phrases import AnswerPhrases, PhrasesError
from pc_rag.runtime.draft_policy import DraftPolicy, StepCosts
from pc_rag.runtime.model_runner import ModelRunner
from pc_rag.runtime.speculation import PromptLookup

ANSWERS = [[10, 11, 12, 13, 2], [10, 11, 12, 14, 2], [10, 11, 12, 13, 2], [20, 11, 12, 13, 2], [30, 31, 2]]


def test_the_table_keeps_the_most_frequent_continuation_of_each_context() -> None:
    phrases = AnswerPhrases.fit(ANSWERS, max_context=3, min_count=2, min_share=0.5)
    # after "10" at an answer's start: "11" three times of three, then "12", then "13" (2 of 3 after "10 11 12")
    assert phrases.draft([10], 4) == ([11, 12, 13, 2], 2, True)  # matched (START, 10); every fitted one agreed
    assert phrases.draft([10, 11, 12], 1) == ([13], 3, False)  # 13 twice, 14 once: the majority, not unanimous
    assert phrases.draft([20, 11], 1) == ([12], 1, True)  # (START, 20, 11) and (20, 11) once: "11" -> 12, 4 of 4
    assert phrases.draft([30], 3) == ([], 0, False)  # seen once: below min_count
    assert phrases.draft([99], 3) == ([], 0, False)
    assert phrases.draft([10], 0) == ([], 0, False)


def test_the_first_token_and_unshared_continuations_are_never_drafted() -> None:
    phrases = AnswerPhrases.fit([[5, 6], [5, 7], [5, 8], [5, 6]], max_context=2, min_count=2, min_share=0.6)
    assert phrases.draft([], 1) == ([], 0, False)  # the first token comes from the prefill: 5 is never drafted
    assert phrases.draft([5], 1) == ([], 0, False)  # 6 is 2 of 4 continuations: under min_share


def test_a_table_round_trips_through_its_file(tmp_path: Path) -> None:
    phrases = AnswerPhrases.fit(ANSWERS, source="five answers")
    path = tmp_path / "m.phrases.json"
    phrases.save(path)
    loaded = AnswerPhrases.load(path)
    assert loaded._table == phrases._table and loaded.max_context == phrases.max_context
    assert loaded.source == "five answers" and len(loaded) == len(phrases) > 0


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ("not json", "not a readable phrase table"),
        (json.dumps([1, 2]), "format"),
        (json.dumps({"format": "other"}), "format"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 0, "entries": []}), "max_context"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": True, "entries": []}), "max_context"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": {}}), "entries must be a list"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[1, 2, 3]]}), "entry 0"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[1, 2, 3, 4, 5, 6]]}), "entry"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[1, 2.0, 1, 1]]}), "entry 0"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[1, True, 1, 1]]}), "entry 0"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[1, 2, 3, 2]]}), "count"),
        (json.dumps({"format": "pc-rag answer phrases 1", "max_context": 2, "entries": [[-5, 2, 1, 1]]}), "negative"),
    ],
)
def test_a_broken_file_is_refused_with_its_name_and_field(tmp_path: Path, document: str, says: str) -> None:
    path = tmp_path / "bad.phrases.json"
    path.write_text(document)
    with pytest.raises(PhrasesError, match=says) as error:
        AnswerPhrases.load(path)
    assert str(path) in str(error.value)


def test_the_lookup_drafts_phrases_where_they_match_more_of_the_answer_than_the_text_does() -> None:
    phrases = AnswerPhrases.fit(ANSWERS, max_context=3, min_count=2, min_share=0.5)
    lookup = PromptLookup([40, 41, 42, 11, 77], phrases=phrases)
    lookup.append(10)  # no "10" in the text: the phrase after (START, 10)
    assert lookup.propose(2) == [11, 12] and lookup.source == "phrases" and lookup.matched == 2 and lookup.agreed
    lookup.append(11)  # "11" occurred in the text (-> 77), a 1-token match; the phrase matched (START, 10, 11)
    assert lookup.propose(1) == [12] and lookup.source == "phrases" and lookup.matched == 3
    alone = PromptLookup([40, 41, 42, 11, 77])
    alone.append(10)
    alone.append(11)
    assert alone.propose(1) == [77] and alone.source == "context"
    copying = PromptLookup([10, 11, 55, 56], phrases=phrases)  # the text's own "10 11" -> 55 56
    copying.append(10)
    copying.append(11)
    assert copying.propose(2) == [12, 13]  # the phrase's 3-token match beats the text's 2-token one
    longer = PromptLookup([10, 11, 12, 88], phrases=phrases)
    for token in (10, 11, 12):
        longer.append(token)
    assert longer.propose(1) == [88] and longer.source == "context"  # 3 tokens each: the text's copy wins ties
    quiet = PromptLookup([7, 8, 9], phrases=phrases)
    quiet.append(7)
    assert quiet.propose(2) == [8, 9] and quiet.source == "context"  # no phrase after "7": the text's


def test_the_policy_learns_each_source_apart() -> None:
    costs = StepCosts()
    for rows, ms in ((1, 1.0), (2, 1.2), (3, 1.4), (4, 1.6)):
        costs.record(rows, 0, ms)
    policy = DraftPolicy(costs)
    for _ in range(30):
        policy.observe(2, drafted=3, kept=0, agreed=True, source="phrases")
        policy.observe(2, drafted=3, kept=3, agreed=True, source="context")
    assert policy.count(2, 3, 0, agreed=True, source="phrases") == 0
    assert policy.count(2, 3, 0, agreed=True, source="context") == 3


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_speculating_stock_phrases_keeps_the_plain_output_bit_for_bit(tokenizer, dtype: str, monkeypatch) -> None:
    """Phrases fitted on the plain answer itself (drafts mostly right), and the same with every continuation wrong:
    the greedy output and every step's logits equal plain one-row decoding, with the prompt lookup off so every
    draft is a phrase's, verified every step and under the draft policy."""
    pc = PromptCache(tiny_in("llama", dtype, tokenizer))
    pc.add_schema(Schema("s", (Module("doc", (Text("The red tower stands in Paris."),)),)))
    prompt = Prompt("s", (Import("doc"), Text(" Where is it?")))
    plain = pc.generate(prompt, max_new_tokens=30, keep_logits=30, speculative=False)
    runner = ModelRunner.of(pc.lm.model)
    monkeypatch.setattr(PromptLookup, "_from_text", lambda self, count: [])
    right = AnswerPhrases.fit([plain.token_ids] * 2, min_count=2)
    wrong = AnswerPhrases(
        {context: replace(c, token=(c.token + 1) % len(tokenizer)) for context, c in right._table.items()},
        right.max_context,
    )  # the same contexts, every continuation wrong
    for phrases, kept in ((right, True), (wrong, False)):
        monkeypatch.setattr(runner, "answer_phrases", phrases)
        for speculative in (True, None):
            fast = pc.generate(prompt, max_new_tokens=30, keep_logits=30, speculative=speculative)
            assert fast.token_ids == plain.token_ids
            assert fast.step_logits is not None and plain.step_logits is not None
            assert torch.equal(fast.step_logits, plain.step_logits)
            if speculative:
                assert fast.stats.drafted > 0 and (fast.stats.accepted > 0) == kept


def test_serving_finds_the_models_phrases_once_and_a_switch_or_a_broken_file_leaves_none(
    tokenizer, tmp_path: Path, monkeypatch, caplog
) -> None:
    lm = tiny_in("llama", "int4", tokenizer)
    runner = ModelRunner.of(lm.model)
    monkeypatch.setattr(tuned, "tuned_dirs", lambda: [tmp_path])
    path = tmp_path / tuned.phrases_file(lm.fitted_fingerprints()[-1])
    AnswerPhrases.fit(ANSWERS).save(path)
    monkeypatch.setenv(tuned.PHRASES_SWITCH, "0")
    assert tuned.use_answer_phrases(lm) is None
    monkeypatch.delenv(tuned.PHRASES_SWITCH)
    found = tuned.use_answer_phrases(lm)
    assert found is not None and runner.answer_phrases is found and len(found) > 0
    path.write_text("{}")
    assert tuned.use_answer_phrases(lm) is found  # loaded once per model
    runner.answer_phrases = None
    with caplog.at_level(logging.WARNING):
        assert tuned.use_answer_phrases(lm) is None
    assert "stock phrases not used" in caplog.text and str(path) in caplog.text
