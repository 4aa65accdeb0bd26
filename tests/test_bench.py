"""Benchmarks end to end on a tiny model: peers are timed or say why not, footprints add up, bad input refused."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from pc_rag.cli import main
from pc_rag.footprint import kv_footprint
from pc_rag.kv import kv_shape
from pc_rag.peers import build_workload, engine_peers, llama_cpp_peers, measure
from pc_rag.rag import RagEngine, RagPrompt


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


def test_workload_fills_the_requested_context(engine: RagEngine) -> None:
    work = build_workload(engine, 400)
    assert 300 <= work.tokens <= 400 and len(work.chunks) >= 2
    assert work.tokens == len(engine.full_ids(work.chunks, work.question))


def test_engine_peers_are_timed(engine: RagEngine) -> None:
    work = build_workload(engine, 256)
    rows = [measure(name, work.tokens, peer, runs=1) for name, peer in engine_peers(engine, work).items()]
    assert len(rows) == 4 and all(r.ttft_ms > 0 and r.decode_tokens_per_s for r in rows)


def test_unavailable_peer_reports_why(engine: RagEngine) -> None:
    peers = llama_cpp_peers(None, build_workload(engine, 256))
    assert all(isinstance(p, str) and ("not installed" in p or "GGUF" in p) for p in peers.values())


def test_footprint_matches_the_kv_shape(engine: RagEngine) -> None:
    fp32, bf16 = kv_footprint(engine, [torch.float32, torch.bfloat16], documents=3)
    layers, heads, head_dim = kv_shape(engine.lm.model)
    assert fp32.memory_bytes_per_token == layers * 2 * heads * head_dim * 4 == 2 * bf16.memory_bytes_per_token
    assert fp32.memory_bytes_per_token <= fp32.disk_bytes_per_token < 1.1 * fp32.memory_bytes_per_token
    assert bf16.disk_bytes_per_token < 0.6 * fp32.disk_bytes_per_token


@pytest.mark.parametrize("tokens", ["1024,abc", "10", ""])
def test_bad_lengths_are_refused_before_loading(tokens: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "peers", "--tokens", tokens]) == 2
    assert "--tokens" in capsys.readouterr().err
