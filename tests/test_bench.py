"""Benchmarks end to end on a tiny model: peers are timed or say why not, footprints add up, bad input refused."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_weights import tiny_in

from pc_rag.bench import peers as peers_module
from pc_rag.bench.memory import kv_footprint
from pc_rag.bench.peers import Reply, build_workload, engine_peers, llama_cpp_peers, measure, run_peers
from pc_rag.cli import main
from pc_rag.kv import kv_shape
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
    peers = engine_peers(engine, work)
    rows = [measure(name, work.tokens, peer, runs=1) for name, peer in peers.items() if not isinstance(peer, str)]
    assert len(rows) == 4 and all(r.ttft_ms > 0 and r.decode_tokens_per_s for r in rows)
    assert "pc-rag tune" in peers["pc-rag cached, fast (splice adapter, no recompute)"]  # a random model has none


def test_a_float32_reference_times_its_full_prefill_beside_the_compute_dtype(engine: RagEngine, tokenizer) -> None:
    quantized = RagEngine(tiny_in("llama", "int4", tokenizer), RagPrompt())
    rows = run_peers(quantized, [256], runs=1, gguf=None, progress=False, reference=engine)
    by_name = {r.peer: r for r in rows}
    assert by_name["full prefill, float32 (transformers, same runtime)"].dtype == "float32"
    assert by_name["full prefill (transformers, same runtime)"].dtype == "int4"
    assert by_name["pc-rag cached, naive splice"].end_to_end_ms > by_name["pc-rag cached, naive splice"].ttft_ms
    assert all(r.threads == torch.get_num_threads() for r in rows)


def test_unavailable_peer_reports_why(engine: RagEngine) -> None:
    peers = llama_cpp_peers(None, build_workload(engine, 256))
    assert all(isinstance(p, str) and ("not installed" in p or "GGUF" in p) for p in peers.values())


def test_decode_speed_counts_the_tokens_a_reply_generated() -> None:
    def stops_at_eos(n: int) -> Reply:  # first token at 10 ms; EOS after 5 tokens, 40 ms in all
        return Reply(10.0, 10.0, 1) if n == 1 else Reply(10.0, 40.0, 5)

    row = measure("peer", 100, stops_at_eos, runs=3)
    assert row.ttft_ms == 10.0 and row.decode_tokens == 5
    assert row.decode_tokens_per_s == pytest.approx(4 / 30 * 1000)
    assert row.end_to_end_ms == pytest.approx(10.0 + 31 * 7.5)  # a 32-token answer at 7.5 ms per token
    one = measure("peer", 100, lambda n: Reply(10.0, 10.0, 1), runs=1)
    assert one.decode_tokens_per_s is None and "ended after 1 token" in one.note


def test_every_peer_gets_one_row_per_length_failures_included(
    engine: RagEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(engine: RagEngine, work: object) -> object:
        def run(n: int) -> Reply:
            raise RuntimeError("out of memory")

        return run

    monkeypatch.setattr(peers_module, "kvboost_peer", broken)
    monkeypatch.setattr(peers_module, "huggingface_pipeline_peer", lambda engine, work: "not installed here")
    rows = run_peers(engine, [200, 300], runs=1, gguf=None, progress=False)
    by_length = [[r for r in rows if r.context_tokens == n] for n in sorted({r.context_tokens for r in rows})]
    assert len(by_length) == 2 and all(len(group) == 9 for group in by_length)
    for group in by_length:
        notes = {r.peer: r.note for r in group}
        assert notes["KVBoost (chunk KV reuse, warm)"] == "failed: RuntimeError: out of memory"
        assert notes["LangChain HuggingFacePipeline"] == "not installed here"
        assert "pc-rag tune" in notes["pc-rag cached, fast (splice adapter, no recompute)"]
        timed = [r for r in group if not r.note]
        assert len(timed) == 4 and all(r.ttft_ms > 0 for r in timed)
        assert all(r.ttft_ms is None for r in group if r.note)


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


def test_encode_bench_times_the_forward_the_engine_and_a_store(engine: RagEngine, monkeypatch) -> None:
    from test_document_store import embedder

    from pc_rag.bench import encode as encode_bench

    few = encode_bench.sample_questions()[:2]
    monkeypatch.setattr(encode_bench, "sample_questions", lambda: few)
    rows = encode_bench.encode_benchmark(engine, runs=1, embedder=embedder())
    assert [r.vs_forward is not None for r in rows] == [True, True, True]
    assert rows[0].vs_forward == 1.0 and all(r.tokens == rows[0].tokens > 0 for r in rows)
    assert "tokens/s" in encode_bench.format_rows(rows)


def test_serve_bench_compares_batched_with_one_at_a_time(tokenizer) -> None:
    from pc_rag.bench.serve import format_attention, format_serve, run_serve_bench
    from pc_rag.engine import PromptCache

    pc = PromptCache(tiny_model("llama", tokenizer))
    result, rows = run_serve_bench(pc, concurrency=4, shared_tokens=200, new_tokens=6, runs=2)
    assert result.identical and result.generated_tokens > 0
    assert result.tokens_per_s > 0 and result.single_tokens_per_s > 0
    assert 0 < result.shared_kv_bytes < result.duplicated_kv_bytes  # read while all four were live
    assert "identical answers: True" in format_serve(result)
    contenders = [("shared", "sdpa-duplicated"), ("shared", "decode-duplicated"),
                  ("chunk-first pass only", "sdpa-duplicated"), ("sequence-first pass only", "sdpa-duplicated"),
                  ("unshared", "decode")]  # fmt: skip
    assert [(r.caches, r.case, r.baseline) for r in rows] == [
        (caches, *contender) for caches in ("flushed", "decode-step") for contender in contenders
    ]
    assert all(r.partition_us > 0 and r.baseline_us > 0 for r in rows) and "two-phase" in format_attention(rows)


def test_rag_serve_bench_batches_the_store_default_mode(tmp_path, tokenizer) -> None:
    """``bench serve --store``: +rag answers in the store's mode ``fast`` (a splice adapter) at once and one at a time,
    with the same tokens, every request decoded in the batch."""
    import numpy as np

    from pc_rag.bench.serve_rag import format_rag_serve, run_rag_serve_bench
    from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
    from pc_rag.store import as_embedder
    from pc_rag.store.document_store import DocumentStore

    lm = tiny_model("llama", tokenizer)
    adapter = SpliceAdapter(lm.model, AdapterConfig(rank=4), "fp")
    with torch.no_grad():
        for p in adapter.lora_b.values():
            p.normal_(0, 0.5)
    engine = RagEngine(lm, RagPrompt.longbench(), adapter=adapter.attach(merged=True))
    embed = as_embedder(lambda texts: np.ones((len(texts), 8), dtype=np.float32), name="constant")
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embed, mode="fast")
    store.add_documents(["The Danube flows into the Black Sea.", "Fuji is a volcano in Japan."], progress=False)
    result = run_rag_serve_bench(store, concurrency=3, k=2, new_tokens=4)
    assert result.mode == "fast" and result.identical and result.generated_tokens > 0
    assert (result.batched, result.alone) == (3, 0) and result.widest_step >= 1
    assert result.tokens_per_s > 0 and result.single_tokens_per_s > 0
    assert "served alone: 0" in format_rag_serve(result)
