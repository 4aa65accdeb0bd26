"""The runner on a fake engine: full runs first, records compare with it, and an interrupted run resumes exactly."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from pc_rag.errors import EvalError
from pc_rag.eval import aggregate, format_table, load_state, parse_modes, plot, results_json, run_eval, write_json
from pc_rag.eval.datasets import Example, Passage
from pc_rag.runtime.generate import GenerationResult, GenerationStats

V = 16  # fake vocabulary size
FAKE_MODES = ("naive", "prefix", "edge", "selective", "default")


@dataclass(frozen=True)
class FakeChunk:
    text: str
    token_ids: tuple[int, ...]


class Interrupted(RuntimeError):
    pass


class FakeEngine:
    """Deterministic answers: full copies the gold answer; ``naive`` adds words; other modes equal full.

    ``fail_after`` makes the (n+1)-th answer/answer_full call raise, as a crash would.
    """

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.calls: list[tuple[str, str, str]] = []  # (kind, question, mode)
        self.references: list[list[int] | None] = []  # reference_ids of each answer() call

    def passage_text(self, i: int, title: str, text: str) -> str:
        return f"Passage {i}:\n{title}\n{text}\n\n"

    def chunk_encoder(self, mode: str) -> str:
        return ""

    def encode(self, texts: list[str], mode: str) -> list[FakeChunk]:
        self.calls.append(("encode", "", mode))
        return [FakeChunk(t, tuple(range(len(t.split())))) for t in texts]

    def answer(
        self,
        chunks: list[FakeChunk],
        question: str,
        mode: str,
        *,
        reference_ids: list[int] | None = None,
        max_new_tokens: int = 32,
    ) -> GenerationResult:
        self.references.append(reference_ids)
        result = self._generate(chunks, question, mode, max_new_tokens)
        if reference_ids is not None:  # forced steps: the step logits of this mode's own answer
            result.step_logits = _steps(result.first_logits, 1 + len(reference_ids))
        return result

    def answer_full(
        self, chunks: list[FakeChunk], question: str, *, max_new_tokens: int = 32, keep_logits: int = 0
    ) -> GenerationResult:
        result = self._generate(chunks, question, "full", max_new_tokens)
        run = len(result.token_ids) + (len(result.token_ids) < max_new_tokens)  # the EOS step runs too
        result.step_logits = _steps(result.first_logits, min(keep_logits, run)) if keep_logits else None
        return result

    def _generate(self, chunks: list[FakeChunk], question: str, mode: str, max_new_tokens: int) -> GenerationResult:
        if self.fail_after is not None and sum(c[0] != "encode" for c in self.calls) >= self.fail_after:
            raise Interrupted("simulated crash")
        self.calls.append(("answer", question, mode))
        gold = question.removeprefix("Q: ")
        seed = sum(map(ord, question))
        logits = torch.linspace(0, 1, V) * (seed % 7) + torch.arange(V) % 3
        if mode == "naive":
            text, first, logits = f"The {gold} maybe", 1, logits.flip(0)
        else:
            text, first = gold, 2
        ids = [first, 3, 4][:max_new_tokens]
        context = sum(len(c.token_ids) for c in chunks)
        ttft = 100.0 + seed % 10 if mode == "full" else 10.0 + seed % 5
        stats = GenerationStats(ttft, ttft + 5, 0 if mode == "full" else context, 20, len(ids))
        return GenerationResult(text, ids, stats, logits)


def _steps(first: torch.Tensor, n: int) -> torch.Tensor:
    """Fake step logits [n, V]: step j is the first step's logits rolled by j."""
    return torch.stack([first.roll(j) for j in range(n)])


def make_examples(datasets: tuple[str, ...] = ("hotpotqa", "musique"), per: int = 3) -> list[Example]:
    return [
        Example(d, f"{d}-{i}", f"Q: answer {d} {i}", (f"answer {d} {i}",),
                tuple(Passage(f"T{j}", f"text {j} " * (j + 1)) for j in range(3)))
        for d in datasets for i in range(per)
    ]  # fmt: skip


MODES = ["full", "naive", "default"]


def test_full_first_and_records_compare_with_it() -> None:
    engine = FakeEngine()
    examples = make_examples(per=2)
    records = run_eval(engine, examples, ["naive", "default"], progress=False)  # full is added
    assert [r.mode for r in records[:3]] == MODES
    answers = [c for c in engine.calls if c[0] == "answer"]
    assert [c[2] for c in answers[:3]] == MODES  # full is answered before the modes it is compared with
    assert len([c for c in engine.calls if c[0] == "encode"]) == 2 * len(examples)  # naive, default: once each
    naive = [r for r in records if r.mode == "naive"]
    assert all(not r.agreement and not r.first_token_agreement and r.first_token_kl > 0 for r in naive)
    assert all(
        r.f1 == pytest.approx(2 * 0.75 / 1.75) for r in naive
    )  # "answer d i" vs "the answer d i maybe": p=3/4, r=1
    default = [r for r in records if r.mode == "default"]
    assert all(r.agreement and r.identical and r.first_token_kl == 0.0 and r.f1 == 1.0 for r in default)
    # every mode is teacher-forced with full's answer but its last scored token (full answers [2, 3, 4])
    assert engine.references == [[2, 3]] * (2 * len(examples))
    full = [r for r in records if r.mode == "full"]
    assert all((r.teacher_forced_kl, r.teacher_forced_agreement) == (0.0, 1.0) for r in full + default)
    assert all(r.teacher_forced_kl > 0 and r.teacher_forced_agreement < 1 for r in naive)
    assert all(r.context_tokens == sum(3 + 2 * (j + 1) for j in range(3)) for r in records)  # fake: word count


def test_interrupted_run_resumes_without_repeating_work(tmp_path: Path) -> None:
    examples = make_examples()
    reference = run_eval(FakeEngine(), examples, MODES, state_path=tmp_path / "ref.jsonl", progress=False)
    state = tmp_path / "run.jsonl"
    with pytest.raises(Interrupted):  # example 1 finishes, example 2 stops after its full prefill
        run_eval(FakeEngine(fail_after=4), examples, MODES, state_path=state, progress=False)
    assert len(load_state(state)) == 4
    with state.open("a") as f:
        f.write('{"setting": "closed", "dat')  # a line cut short by the crash
    engine = FakeEngine()
    records = run_eval(engine, examples, MODES, state_path=state, progress=False)
    assert records == reference
    answered = [c for c in engine.calls if c[0] == "answer"]
    # the interrupted example re-runs full (for KL) but not what is done; the rest runs once
    assert len(answered) == (1 + 2) + 4 * 3
    lines = [json.loads(line) for line in state.read_text().splitlines()]
    keys = [(r["dataset"], r["id"], r["mode"]) for r in lines]
    assert len(keys) == len(set(keys)) == len(examples) * len(MODES)
    again = FakeEngine()
    assert run_eval(again, examples, MODES, state_path=state, progress=False) == reference
    assert again.calls == []  # everything was done


def test_state_of_an_older_version_loads_without_teacher_forced_metrics(tmp_path: Path) -> None:
    examples = make_examples(per=1)
    state = tmp_path / "old.jsonl"
    run_eval(FakeEngine(), examples, MODES, state_path=state, progress=False)
    older = [json.loads(line) for line in state.read_text().splitlines()]
    for record in older:  # what runs before the teacher-forced metrics wrote
        del record["teacher_forced_kl"], record["teacher_forced_agreement"]
    state.write_text("".join(json.dumps(r) + "\n" for r in older))
    records = run_eval(FakeEngine(), examples, MODES, state_path=state, progress=False)
    assert all(r.teacher_forced_kl is None and r.teacher_forced_agreement is None for r in records)
    rows = results_json(aggregate(records))["results"]
    assert all(r["teacher_forced_kl"] is None and r["teacher_forced_agreement"] is None for r in rows)
    state.write_text(json.dumps({k: v for k, v in older[0].items() if k != "first_token_kl"}) + "\n")
    with pytest.raises(EvalError, match="not a question record"):  # a field without a default is still required
        load_state(state)


def test_corrupt_state_is_an_error(tmp_path: Path) -> None:
    state = tmp_path / "s.jsonl"
    state.write_text('{"not": "a record"}\n')
    with pytest.raises(EvalError, match=r"s\.jsonl:1: not a question record"):
        run_eval(FakeEngine(), make_examples(per=1), MODES, state_path=state, progress=False)


def test_parse_modes() -> None:
    assert parse_modes("full, naive,naive,default", FAKE_MODES) == ["full", "naive", "default"]
    with pytest.raises(EvalError, match=r"unknown mode.*'fast'.*known modes: full, default, edge, naive"):
        parse_modes("naive,fast", FAKE_MODES)
    with pytest.raises(EvalError, match="no mode given"):
        parse_modes(" , ", FAKE_MODES)


def test_report_json_table_and_plot(tmp_path: Path) -> None:
    records = run_eval(FakeEngine(), make_examples(), MODES, progress=False)
    rows = aggregate(records, ["default", "naive"])
    out = tmp_path / "r.json"
    write_json(rows, out, config={"max_new_tokens": 32})
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(results_json(rows, {"max_new_tokens": 32})))
    required = {"dataset", "mode", "setting", "n", "f1", "agreement", "first_token_agreement", "first_token_kl",
                "ttft_ms_median", "ttft_ms_p90", "context_tokens_mean", "identical", "teacher_forced_kl",
                "teacher_forced_agreement"}  # fmt: skip
    assert all(required <= set(row) for row in data["results"])
    assert {(r["dataset"], r["mode"]) for r in data["results"]} == {
        (d, m) for d in ("hotpotqa", "musique", "all") for m in ("default", "naive")
    }
    assert {r["setting"] for r in data["results"]} == {"closed"}
    closed_row = {k: v for k, v in asdict(rows[0]).items() if k != "retrieval_recall"}  # open rows only
    assert data["results"][0] == closed_row and data["config"] == {"max_new_tokens": 32}
    table = format_table(rows).splitlines()
    assert len(table) == 1 + len(rows) and "F1" in table[0] and "all" in table[-1]
    png = tmp_path / "plot.png"
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reference_engine_answers_full_and_the_engine_every_mode() -> None:
    """A dtype's quality guard: full prefill by the reference (say float32), the modes by the engine (say int4)."""
    engine, reference = FakeEngine(), FakeEngine()
    examples = make_examples(per=2)
    records = run_eval(engine, examples, ["naive", "default"], progress=False, reference=reference)
    assert {c[2] for c in reference.calls if c[0] == "answer"} == {"full"}
    assert {c[2] for c in engine.calls if c[0] == "answer"} == {"naive", "default"}
    assert len(records) == 3 * len(examples)
