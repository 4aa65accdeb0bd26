"""RAG assembly: re-rotated isolated chunks equal direct encoding at their slots; full recompute equals full prefill."""

from __future__ import annotations

import random

import pytest
import torch

from pc_rag.assemble import splice
from pc_rag.encode import encode_spans
from pc_rag.errors import PCRagError
from pc_rag.kv import allocate
from pc_rag.rag import RagEngine, RagPrompt, RecoveryMode
from pc_rag.rag.modes import is_mode, resolve_mode
from pc_rag.recompute import recompute_mask

TEXTS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "Mount Fuji is the highest mountain of Japan.",
    "The Danube flows through Vienna, Budapest and Belgrade before the Black Sea.",
    "Gustave Eiffel's company also built the frame of the Statue of Liberty.",
]
QUESTION = "Which city has the tower?"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def engines(tokenizer) -> dict[str, RagEngine]:
    from conftest import tiny_model

    return {arch: RagEngine(tiny_model(arch, tokenizer), RagPrompt.longbench()) for arch in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_isolated_chunks_assemble_to_direct_encoding(engines: dict[str, RagEngine], arch: str, seed: int) -> None:
    engine = engines[arch]
    chunks = engine.encode(TEXTS, RecoveryMode("iso", conditioned=False))
    rng = random.Random(seed)
    order = rng.sample(range(len(chunks)), k=rng.randint(1, len(chunks)))  # any order and subset
    picked = [chunks[i] for i in order]
    head = len(engine.head_ids)
    starts = [head + sum(c.kv.length for c in picked[:i]) for i in range(len(picked))]
    buffer = allocate(engine.lm.model, starts[-1] + picked[-1].kv.length)
    parts = [(c.kv, s - int(c.kv.positions[0])) for c, s in zip(picked, starts, strict=True)]
    length = splice(buffer, engine.lm.rope, parts)
    direct = encode_spans(
        engine.lm.model, [(c.token_ids, range(s, s + len(c.token_ids))) for c, s in zip(picked, starts, strict=True)]
    )
    keys = torch.cat([d.keys for d in direct], dim=2)
    values = torch.cat([d.values for d in direct], dim=2)
    assert length == keys.shape[2]
    assert relative_error(buffer.keys[:, 0, :, :length], keys) < 1e-4
    assert relative_error(buffer.values[:, 0, :, :length], values) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("mode", [RecoveryMode("all", ratio=1.0), RecoveryMode("edges", conditioned=False, edge=10**6)])
def test_recomputing_every_chunk_token_equals_full_prefill(engines: dict[str, RagEngine], arch: str, mode) -> None:
    engine = engines[arch]
    chunks = engine.encode(TEXTS, mode)
    recovered = engine.answer(chunks, QUESTION, mode, max_new_tokens=4)
    full = engine.answer_full(chunks, QUESTION, max_new_tokens=4)
    assert relative_error(recovered.first_logits, full.first_logits) < 1e-4
    assert recovered.token_ids == full.token_ids
    assert recovered.stats.cached_tokens == len(engine.head_ids)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_partial_recovery_is_approximate(engines: dict[str, RagEngine], arch: str) -> None:
    """On random weights only exactness can be asserted; quality is measured on the real model."""
    engine = engines[arch]
    full = engine.answer_full(engine.encode(TEXTS, "naive"), QUESTION, max_new_tokens=1).first_logits
    errors = {}
    for mode in ("naive", "edge", "selective"):
        result = engine.answer(engine.encode(TEXTS, mode), QUESTION, mode, max_new_tokens=1)
        errors[mode] = relative_error(result.first_logits, full)
        assert result.stats.computed_tokens > 0
    assert min(errors.values()) > 1e-3  # splicing separately encoded chunks is not exact


def test_recompute_mask_structure() -> None:
    mask = recompute_mask(cached=6, selected=[2, 4], new=2)[0, 0]
    # selected tokens are refreshed in place: the one at 2 sees 0..2, the one at 4 sees 0..4 (2 already fresh)
    assert mask[0].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[1].tolist() == [True, True, True, True, True, False, False, False]
    # question tokens see the whole refreshed cache and the question causally
    assert mask[2].tolist() == [True, True, True, True, True, True, True, False]
    assert mask[3].tolist() == [True] * 8
    windowed = recompute_mask(cached=6, selected=[2, 4], new=2, window=3)[0, 0]
    assert windowed[1].tolist() == [False, False, True, True, True, False, False, False]
    assert windowed[2].tolist() == [False, False, False, False, True, True, True, False]


def test_stream_and_stats(engines: dict[str, RagEngine]) -> None:
    engine = engines["llama"]
    chunks = engine.encode(TEXTS, "edge")
    stream = engine.stream(chunks, QUESTION, "edge", max_new_tokens=5)
    text = "".join(stream)
    assert stream.result is not None and text == stream.result.text
    edge_tokens = sum(min(16, len(c.token_ids)) for c in chunks)
    tail = len(engine.full_ids(chunks, QUESTION)) - len(engine.head_ids) - sum(len(c.token_ids) for c in chunks)
    assert stream.result.stats.computed_tokens == edge_tokens + tail


def test_unknown_mode_is_a_clear_error(engines: dict[str, RagEngine]) -> None:
    with pytest.raises(PCRagError, match="unknown recovery mode"):
        engines["llama"].encode(TEXTS, "bogus")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_deviation_probe_is_zero_on_an_exact_cache(engines: dict[str, RagEngine], arch: str) -> None:
    from pc_rag.rag.select import kv_deviation

    engine = engines[arch]
    chunks = engine.encode(TEXTS, "naive")
    ids = [t for c in chunks for t in c.token_ids]
    head = len(engine.head_ids)
    exact = allocate(engine.lm.model, head + len(ids))
    with torch.inference_mode():  # a full prefill: every cached value is what full attention gives
        engine.lm.model(input_ids=torch.tensor([[*engine.head_ids, *ids]]), cache=exact.cache(0))
    positions = range(head, head + len(ids))
    assert float(kv_deviation(engine.lm.model, exact, head, ids, positions, 1).max()) < 1e-4
    spliced = allocate(engine.lm.model, head + len(ids))
    parts = [(engine.head_kv, 0)]
    starts = [head + sum(c.kv.length for c in chunks[:i]) for i in range(len(chunks))]
    parts += [(c.kv, s - int(c.kv.positions[0])) for c, s in zip(chunks, starts, strict=True)]
    splice(spliced, engine.lm.rope, parts)
    deviation = kv_deviation(engine.lm.model, spliced, head, ids, positions, 1)
    # naive chunks missed the head and the chunks before them: every token that can see that far deviates
    # (on a sliding layer, only the first ``window - 1`` tokens of each chunk see past its start)
    config = engine.lm.model.config.get_text_config()
    sliding = (getattr(config, "layer_types", None) or [""] * 2)[1] == "sliding_attention"
    window = config.sliding_window if sliding else len(ids) + 1
    reaching = [s - head + i for c, s in zip(chunks, starts, strict=True) for i in range(min(window - 1, c.kv.length))]
    assert float(deviation[reaching].min()) > 1e-3


@pytest.mark.parametrize(
    ("spec", "edge", "ratio"), [("selective:0.25", 0, 0.25), ("edge:32", 32, 0.0), ("hybrid:0.2", 8, 0.2)]
)
def test_budgeted_mode_specs(spec: str, edge: int, ratio: float) -> None:
    mode = resolve_mode(spec)
    assert (mode.name, mode.edge, mode.ratio, mode.conditioned) == (spec, edge, ratio, True)


@pytest.mark.parametrize("spec", ["selective:0", "selective:1.5", "edge:x", "edge:0", "bogus", "naive:3"])
def test_bad_mode_specs_are_refused_with_the_known_names(spec: str) -> None:
    assert not is_mode(spec)
    with pytest.raises(PCRagError, match="known: naive"):
        resolve_mode(spec)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_caching_baseline_equals_full_prefill(engines: dict[str, RagEngine], arch: str) -> None:
    engine = engines[arch]
    chunks = engine.encode(TEXTS, "naive")
    full = engine.answer_full(chunks, QUESTION, max_new_tokens=4)
    prefix = engine.answer_full(chunks, QUESTION, reuse_preamble=True, max_new_tokens=4)
    assert relative_error(prefix.first_logits, full.first_logits) < 1e-4 and prefix.text == full.text
    assert prefix.stats.cached_tokens == len(engine.head_ids) and full.stats.cached_tokens == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_teacher_forced_logits_of_an_exact_cache_equal_full_prefill(engines: dict[str, RagEngine], arch: str) -> None:
    engine = engines[arch]
    chunks = engine.encode(TEXTS, "selective:1.0")  # every chunk token recomputed: the cache is full prefill's
    full = engine.answer_full(chunks, QUESTION, max_new_tokens=6, keep_logits=6)
    assert len(full.token_ids) == 6 and full.step_logits.shape[0] == 6
    forced = engine.answer(chunks, QUESTION, "selective:1.0", max_new_tokens=6, reference_ids=full.token_ids[:5])
    assert forced.step_logits.shape == full.step_logits.shape
    assert relative_error(forced.step_logits, full.step_logits) < 1e-4
    # forced with tokens it would not generate: the logits of a plain forward over prompt + those tokens
    other = [engine.tokenize(" Vienna")[0], 17, 1242]
    forced = engine.answer(chunks, QUESTION, "selective:1.0", max_new_tokens=2, reference_ids=other)
    ids = engine.full_ids(chunks, QUESTION)
    with torch.inference_mode():
        plain = engine.lm.model(input_ids=torch.tensor([[*ids, *other]])).logits[0, len(ids) - 1 :]
    assert forced.step_logits.shape == (4, plain.shape[-1]) and relative_error(forced.step_logits, plain) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_teacher_forcing_leaves_the_answer_alone(engines: dict[str, RagEngine], arch: str) -> None:
    engine = engines[arch]
    chunks = engine.encode(TEXTS, "prefix")
    alone = engine.answer(chunks, QUESTION, "prefix", max_new_tokens=5)
    assert alone.step_logits is None  # off unless asked
    reference = engine.answer_full(chunks, QUESTION, max_new_tokens=5).token_ids[:4]
    forced = engine.answer(chunks, QUESTION, "prefix", max_new_tokens=5, reference_ids=reference)
    assert forced.token_ids == alone.token_ids and forced.text == alone.text
    torch.testing.assert_close(forced.first_logits, alone.first_logits)
    assert forced.step_logits.shape[0] == 1 + len(reference)
    torch.testing.assert_close(forced.step_logits[0], forced.first_logits)  # step 0: nothing forced yet
    assert engine.answer(chunks, QUESTION, "prefix", max_new_tokens=1, reference_ids=[]).step_logits.shape[0] == 1


@pytest.mark.parametrize("mode", ["default", "selective:0.5", "edge:3", "query:0.3"])
def test_recovery_equals_its_exact_oracle(tokenizer, monkeypatch, mode: str) -> None:
    """Chunks encoded alone, then served with recompute: each decoded step equals a masked full forward in
    which unselected chunk tokens see only their chunk and selected ones everything before them."""
    from conftest import tiny_model
    from reference import recompute_oracle_logits

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    texts = [
        "The Eiffel Tower is in Paris and was finished in 1889.",
        "Mount Fuji is the highest mountain in Japan.",
        "The Danube flows into the Black Sea.",
    ]
    chunks = engine.encode(texts, mode="naive")  # encoded alone: re-rotation keeps what each token saw
    chosen: list[list[int]] = []
    select = RagEngine._select

    def spy(self, *args, **kwargs):  # records the selection; changes nothing
        chosen.append(select(self, *args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(RagEngine, "_select", spy)
    question = "Which river reaches the Black Sea?"
    result = engine.answer(chunks, question, mode, max_new_tokens=4, keep_logits=4)
    assert chosen[0], "the mode recomputed nothing: the oracle would test nothing"
    head = list(engine.head_ids)
    tail = engine.tokenize(engine.prompt.tail(engine.wrappers, question))
    model = engine.lm.model
    for step, logits in enumerate(result.step_logits):
        expected = recompute_oracle_logits(
            model, head, [list(c.token_ids) for c in chunks], chosen[0], tail, result.token_ids[:step]
        )
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
