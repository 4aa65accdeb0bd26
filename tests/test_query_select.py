"""Query-aware selection: the probe's attention mass equals eager attention; the choice respects its budget."""

from __future__ import annotations

import torch

from pc_rag.encode import encode_spans
from pc_rag.kv import allocate
from pc_rag.rag.query_select import query_indices, question_attention


def test_probe_mass_equals_eager_attention(tiny_lm) -> None:
    model = tiny_lm.model
    prefix, question = [5, 77, 1200, 31, 9, 400, 12, 8, 300, 2], [44, 45, 46, 47]
    layers = 2
    kv = encode_spans(model, [(prefix, range(len(prefix)))])[0]
    buffer = allocate(model, len(prefix) + len(question))
    buffer.keys[:, 0, :, : len(prefix)] = kv.keys
    buffer.values[:, 0, :, : len(prefix)] = kv.values
    got = question_attention(model, buffer, len(prefix), question, range(len(prefix), len(prefix) + 4), layers)
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prefix + question]), output_attentions=True)
    finally:
        model.set_attn_implementation(implementation)
    want = sum(a[0, :, len(prefix) :, : len(prefix)].sum((0, 1)) for a in out.attentions[:layers])
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_choice_has_edges_windows_and_the_budget() -> None:
    scores = torch.zeros(30)
    scores[12], scores[25] = 5.0, 4.0
    spans = [(10, 10), (20, 10)]  # 20 chunk tokens
    chosen = query_indices(scores, spans, share=0.3, window=1, edge=2)  # 2 edges x 2 + 6 by score
    assert chosen[:2] == [10, 11] and {20, 21} <= set(chosen)
    assert {11, 12, 13, 24, 25, 26} <= set(chosen)
    assert len(chosen) == 4 + 6 and all(10 <= i < 30 for i in chosen)
    assert query_indices(scores, spans, share=0.0) == []
