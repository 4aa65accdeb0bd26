"""Joint training of the encoding side: the student equals serving `fast` over chunks its encoder made, gradients
reach the encoding side, and training both sides lowers KL to full prefill, on several architectures."""

from __future__ import annotations

import pytest
import torch

from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.engine import ChunkEncodingError
from pc_rag.tune.pairs import Pair
from pc_rag.tune.teacher import teach
from pc_rag.tune.train import TrainConfig, student_logprobs, topk_kl, train_adapter

TEXTS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "Mount Fuji is the highest mountain of Japan.",
    "The Danube flows through Vienna, Budapest and Belgrade before the Black Sea.",
]
QUESTION = "Which city has the tower?"
ARCHS = ["llama", "qwen3", "gemma3", "phi3-partial-rotary"]


def _engine(arch: str, tokenizer, encoding: str, scale: float = 0.05) -> tuple[RagEngine, SpliceAdapter]:
    from conftest import tiny_model

    lm = tiny_model(arch, tokenizer)
    query = "qkv_proj" if arch.startswith("phi3") else "q_proj"  # Phi-3 fuses q, k and v
    adapter = SpliceAdapter(
        lm.model, AdapterConfig(rank=2, targets=(query, "o_proj"), encoding=encoding), lm.fingerprint()
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, scale)
    return RagEngine(lm, RagPrompt.longbench(), adapter=adapter), adapter


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("encoding", ["shared", "separate"])
def test_student_with_an_encoding_side_is_the_fast_serving_path(tokenizer, arch: str, encoding: str) -> None:
    engine, adapter = _engine(arch, tokenizer, encoding)
    chunks = engine.encode(TEXTS, "fast")
    assert {c.encoder for c in chunks} == {adapter.encoding_digest} != {""}
    record = teach(engine, chunks, QUESTION, "k", steps=3, top=8)
    served = engine.answer(chunks, QUESTION, "fast", max_new_tokens=1, reference_ids=record.answer_ids)
    with torch.no_grad():
        logp = student_logprobs(engine, adapter, chunks, QUESTION, record)
    assert served.step_logits is not None
    expected = torch.log_softmax(served.step_logits[: record.steps].float(), -1)
    assert torch.allclose(logp, expected, atol=1e-4), (logp - expected).abs().max()
    plain = engine.encode(TEXTS, "prefix")  # the encoding side changes the KV
    assert not torch.allclose(plain[0].kv.keys, chunks[0].kv.keys, atol=1e-4)


def test_gradients_reach_the_encoding_side(tokenizer) -> None:
    engine, adapter = _engine("llama", tokenizer, "separate")
    adapter.attach()
    model_params = [p for p in engine.lm.model.parameters() if p.requires_grad]
    for p in model_params:
        p.requires_grad_(False)
    try:
        adapter.requires_grad_(True)
        chunks = engine.encode(TEXTS, "fast")
        record = teach(engine, chunks, QUESTION, "k", steps=3, top=8)
        logp = student_logprobs(engine, adapter, chunks, QUESTION, record)
        topk_kl(record.logp.clone(), record.index.clone(), logp).sum().backward()
    finally:
        for p in model_params:
            p.requires_grad_(True)
    last = f"{len(engine.lm.model.get_decoder().layers) - 1}_"
    for side, group in [("encode", adapter.encode_a), ("encode", adapter.encode_b), ("query", adapter.lora_a)]:
        for key, p in group.items():
            # the last layer's chunk-side output feeds no KV: the only encoding-side pairs without a gradient
            reached = p.grad is not None and float(p.grad.abs().sum()) > 0
            assert reached != (side == "encode" and key.startswith(last)), (side, key)


def test_fast_refuses_chunks_encoded_by_the_plain_model(tokenizer) -> None:
    engine, adapter = _engine("llama", tokenizer, "separate")
    plain = engine.encode(TEXTS, "prefix")
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode") as info:
        engine.answer(plain, QUESTION, "fast", max_new_tokens=1)
    assert "plain model" in str(info.value) and adapter.encoding_digest in str(info.value)
    with pytest.raises(ChunkEncodingError, match="plain model"):  # and prefix refuses adapter-encoded chunks
        engine.answer(engine.encode(TEXTS, "fast"), QUESTION, "prefix", max_new_tokens=1)
    engine.answer(plain, QUESTION, "prefix", max_new_tokens=1)  # plain chunks keep working without the adapter


def test_a_query_only_adapter_reads_plain_chunks(tokenizer) -> None:
    engine, adapter = _engine("llama", tokenizer, "none")
    assert adapter.encoding_digest == "" and engine.chunk_encoder("fast") == ""
    chunks = engine.encode(TEXTS, "fast")
    assert {c.encoder for c in chunks} == {""}
    engine.answer(chunks, QUESTION, "fast", max_new_tokens=1)


def test_encoding_with_another_adapters_digest_is_refused(tokenizer) -> None:
    engine, _ = _engine("llama", tokenizer, "separate")
    ids = [engine.tokenize(TEXTS[0])]
    with pytest.raises(ChunkEncodingError, match="reencode"):
        engine.encode_token_ids(ids, True, encoder="0123456789abcdef")


def test_joint_training_lowers_kl_to_full_prefill(tokenizer) -> None:
    from conftest import tiny_model

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    chunks = engine.encode(TEXTS, "prefix")
    orders = [[0, 1, 2], [2, 1, 0], [1, 2, 0]]
    pairs, records = [], {}
    for j, order in enumerate(orders):
        key = f"q/{j}"
        pairs.append(Pair(key, "train", "closed", tuple(map(str, order)), QUESTION))
        records[key] = teach(engine, [chunks[o] for o in order], QUESTION, key, steps=4, top=64)
    by_id = {str(i): c for i, c in enumerate(chunks)}
    config = TrainConfig(epochs=8, lr=5e-3, accumulate=3, eval_every=6, patience=10)
    adapter, report = train_adapter(
        engine, pairs, pairs, lambda p: [by_id[d] for d in p.doc_ids], records.__getitem__,
        AdapterConfig(rank=4, encoding="separate"), config, progress=False,
    )  # fmt: skip
    assert report.best is not None and report.best.mean_kl < 0.5 * report.history[0].mean_kl, report.history
    assert any(float(p.abs().sum()) > 0 for p in adapter.encode_b.values())  # the encoding side was trained
    with pytest.raises(PCRagError, match="without recompute"):
        student_logprobs(engine, adapter, chunks, QUESTION, records["q/0"], recompute=0.2)


def test_save_and_load_keep_the_encoding_side(tokenizer, tmp_path) -> None:
    engine, adapter = _engine("llama", tokenizer, "separate")
    adapter.save(tmp_path / "a.safetensors")
    loaded = SpliceAdapter.load(tmp_path / "a.safetensors", engine.lm.model, engine.lm.fingerprint())
    assert loaded.config.encoding == "separate"
    assert loaded.encoding_digest == adapter.encoding_digest and loaded.digest == adapter.digest
    for key, p in adapter.encode_b.items():
        assert torch.equal(loaded.encode_b[key], p)


def test_merged_encoding_side_equals_the_hooked_one(tokenizer) -> None:
    engine, adapter = _engine("llama", tokenizer, "separate", scale=0.2)
    ids = [engine.tokenize(t) for t in TEXTS]
    hooked = engine.encode_token_ids(ids, True, encoder=adapter.encoding_digest)
    adapter.detach()
    adapter.attach(merged=True)
    try:
        merged = engine.encode_token_ids(ids, True, encoder=adapter.encoding_digest)
    finally:
        adapter.detach()
        adapter.attach()
    for a, b in zip(hooked, merged, strict=True):
        assert torch.allclose(a.kv.keys, b.kv.keys, atol=1e-4) and torch.allclose(a.kv.values, b.kv.values, atol=1e-4)


def test_eval_contexts_encode_each_mode_as_it_reads_chunks(tokenizer) -> None:
    from pc_rag.eval.contexts import ClosedContexts
    from pc_rag.eval.datasets import Example, Passage

    engine, adapter = _engine("llama", tokenizer, "separate")
    example = Example("hotpotqa", "x", QUESTION, ("Paris",), tuple(Passage(f"T{i}", t) for i, t in enumerate(TEXTS)))
    contexts = ClosedContexts(engine)
    assert {c.encoder for c in contexts.chunks(example, "fast")} == {adapter.encoding_digest}
    assert {c.encoder for c in contexts.chunks(example, "prefix")} == {""}
    engine.answer(contexts.chunks(example, "fast"), QUESTION, "fast", max_new_tokens=1)


def test_training_starts_from_a_query_only_adapter(tokenizer, tmp_path) -> None:
    from conftest import tiny_model

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    chunks = engine.encode(TEXTS, "prefix")
    key = "q/0"
    pairs = [Pair(key, "train", "closed", ("0", "1", "2"), QUESTION)]
    records = {key: teach(engine, chunks, QUESTION, key, steps=3, top=32)}
    by_id = {str(i): c for i, c in enumerate(chunks)}
    start = SpliceAdapter(engine.lm.model, AdapterConfig(rank=2), engine.lm.fingerprint())
    with torch.no_grad():
        for p in start.parameters():
            p.normal_(0, 0.05)
    start.save(tmp_path / "start.safetensors")
    config = TrainConfig(epochs=1, lr=0.0, accumulate=1, eval_every=1, patience=1)  # lr 0: the start is kept
    adapter, report = train_adapter(
        engine, pairs, pairs, lambda p: [by_id[d] for d in p.doc_ids], records.__getitem__,
        AdapterConfig(rank=2, encoding="separate"), config, progress=False, init=tmp_path / "start.safetensors",
    )  # fmt: skip
    for key_, p in start.lora_b.items():
        assert torch.equal(adapter.lora_b[key_], p)
    assert all(float(p.abs().sum()) == 0 for p in adapter.encode_b.values())  # the new side starts as the identity
    assert report.pair_steps == 1 and report.seconds > 0
    with pytest.raises(PCRagError, match="rank 2"):
        train_adapter(
            engine, pairs, pairs, lambda p: [by_id[d] for d in p.doc_ids], records.__getitem__,
            AdapterConfig(rank=4), config, progress=False, init=tmp_path / "start.safetensors",
        )  # fmt: skip
