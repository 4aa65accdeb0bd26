"""``pc-rag bench gpu`` runs every gate at the tiny shape on the CPU and writes what the README table needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pc_rag.bench import gpu
from pc_rag.bench.gpu import SECTIONS, STATIC_GATE, TIMED, format_gates, run_gpu_bench
from pc_rag.cli.app import main
from pc_rag.errors import PCRagError

TOKENIZER = Path(__file__).parent / "data" / "tiny-tokenizer"


@pytest.fixture(scope="module")
def result() -> dict:
    return run_gpu_bench("tiny", "cpu", TOKENIZER, runs=1, on_progress=lambda _: None)


def test_every_section_runs_and_every_gate_is_reported_once(result: dict) -> None:
    assert all("error" not in section for section in result["sections"].values()), result["sections"]
    names = [g["name"] for g in result["gates"]]
    expected = [name for _, gates in SECTIONS.values() for name in gates] + [STATIC_GATE]
    assert sorted(names) == sorted(expected)
    for gate in result["gates"]:
        value, threshold = gate["value"], float(gate["threshold"].split()[1])
        assert isinstance(value, float | int)
        assert gate["met"] == (value >= threshold if gate["threshold"].startswith(">=") else value <= threshold)
    assert result["shape"] == "tiny" and result["device"].startswith("CPU") and result["torch"] and result["commit"]


def test_the_runner_equals_the_models_forward_and_batched_answers_match(result: dict) -> None:
    gates = {g["name"]: g for g in result["gates"]}
    for name in gpu.FIDELITY_GATES:  # logits, decode steps, every slot's KV, cached slots across captures
        assert gates[name]["met"], gates[name]
    row = result["sections"]["fidelity"]["rows"][0]
    assert row["static"] and row["cached_values_changed"] == 0 and len(row["decode_relative_errors"]) == 4
    for row in result["sections"]["attention"]["rows"]:  # the capturable split-KV form attends as SDPA does
        assert row["split_kv_max_abs_err"] < 1e-5 and row["max_abs_err"] < 1e-5, row
    serving = result["sections"]["serving"]["rows"][0]
    assert serving["identical_to_served_alone"] and serving["identical_to_one_at_a_time"]


def test_every_timed_call_took_the_static_path_the_gpu_would_replay(result: dict) -> None:
    """On the CPU the runner's bookkeeping mode runs the static-shape path where CUDA replays a graph: every timed
    cached request and decode step went through it, and each section says how many calls took which path."""
    assert set(result["static_calls"]) == set(result["eager_fallbacks"]) == set(SECTIONS)
    for name in TIMED:
        assert result["eager_fallbacks"][name] == 0, (name, result["sections"][name]["runner_calls"])
    for name in ("ttft", "decode", "serving"):
        assert result["static_calls"][name] > 0, name
    calls = result["sections"]["decode"]["runner_calls"]
    assert calls["static"] >= 2 * 63, calls  # every decode step of the cached and full-prefill timed runs
    assert {g["name"]: g for g in result["gates"]}[STATIC_GATE]["met"]


def test_a_failing_section_is_recorded_and_its_gates_unmet(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(bench: gpu.GpuBench) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(SECTIONS, "attention", (broken, ["two_phase_vs_sdpa_64x8k", "two_phase_vs_sdpa_16x1k"]))
    out = run_gpu_bench("tiny", "cpu", TOKENIZER, only=["attention"], runs=1, on_progress=lambda _: None)
    assert "kernel exploded" in out["sections"]["attention"]["error"]
    assert [(g["name"], g["value"], g["met"]) for g in out["gates"]] == [
        ("two_phase_vs_sdpa_64x8k", None, False),
        ("two_phase_vs_sdpa_16x1k", None, False),
    ]
    assert "| two_phase_vs_sdpa_64x8k | not run |" in format_gates(out)


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu_tiny.json"
    argv = ["--device", "cpu", "bench", "gpu", "--shape", "tiny", "--tokenizer", str(TOKENIZER)]
    assert main([*argv, "--only", "fidelity", "--runs", "1", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert [g["name"] for g in written["gates"]] == gpu.FIDELITY_GATES
    assert "| runner_relative_logit_error |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "llama-70b"], "unknown shape 'llama-70b'"),
        (["--shape", "tiny", "--only", "ttft,warp"], "unknown section(s) warp"),
    ],
)
def test_bad_arguments_get_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "bench", "gpu", "--tokenizer", str(TOKENIZER), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_before_building_anything() -> None:
    if gpu.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(PCRagError, match="no CUDA device"):
        run_gpu_bench("tiny", "cuda", TOKENIZER)
