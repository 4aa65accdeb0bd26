"""The KV metric: query moments equal those of queries recomputed by hand, value moments those of ``o_proj``'s
weights, and the codec's transform fitted in a metric inverts and puts its errors where they cost little."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pc_rag.codec import CacheGenCodec
from pc_rag.codec.tables import CodecTables, fit_tables
from pc_rag.errors import CodecError
from pc_rag.kv import SpanKV
from pc_rag.tune.kv_metric import kv_metric, output_moments, query_moments


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


def _queries_by_hand(lm, ids: list[int]) -> list[torch.Tensor]:
    """Per layer, the queries [H, S, D] after RoPE, from each layer's input hidden states."""
    model, config = lm.model, lm.model.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        positions = torch.arange(len(ids))[None]
        cos, sin = model.model.rotary_emb(out.hidden_states[0], positions)
        queries = []
        for layer, hidden in zip(model.model.layers, out.hidden_states, strict=False):
            q = layer.self_attn.q_proj(layer.input_layernorm(hidden)).view(1, len(ids), heads, dim).transpose(1, 2)
            queries.append(apply_rotary_pos_emb(q, q, cos, sin)[0][0])
    return queries


def test_query_moments_are_those_of_the_queries_recomputed_by_hand(llama) -> None:
    prompts = [list(range(5, 40)), list(range(100, 117))]
    got = query_moments(llama, prompts)
    kv_heads = llama.model.config.num_key_value_heads
    for layer in range(got.shape[0]):
        expected = 0
        for ids in prompts:
            q = _queries_by_hand(llama, ids)[layer].double()  # [H, S, D]; heads 2g, 2g+1 share KV head g
            grouped = q.reshape(kv_heads, -1, q.shape[-1])
            expected = expected + grouped.transpose(1, 2) @ grouped
        torch.testing.assert_close(got[layer], expected, rtol=1e-4, atol=1e-6)


def test_value_moments_are_those_of_the_output_projection(llama) -> None:
    config = llama.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    got = output_moments(llama)
    for i, layer in enumerate(llama.model.model.layers):
        w = layer.self_attn.o_proj.weight.double()  # [hidden, H * D]
        for g in range(kv_heads):
            blocks = [w[:, h * dim : (h + 1) * dim] for h in range(g * heads // kv_heads, (g + 1) * heads // kv_heads)]
            torch.testing.assert_close(got[i, g], sum(b.T @ b for b in blocks), rtol=1e-5, atol=1e-6)


def test_the_metric_is_normalised_and_the_model_is_left_as_it_was(llama) -> None:
    ids = list(range(3, 30))
    before = llama.model(torch.tensor([ids])).logits
    metric = kv_metric(llama, [ids], weigh_values=True)
    assert metric.shape == (2, 3, 2, 16, 16)
    torch.testing.assert_close(metric.diagonal(dim1=-2, dim2=-1).mean(-1), torch.ones(2, 3, 2))
    keys_only = kv_metric(llama, [ids])
    torch.testing.assert_close(keys_only[0], metric[0])
    torch.testing.assert_close(keys_only[1], torch.eye(16).expand(3, 2, 16, 16))
    torch.testing.assert_close(llama.model(torch.tensor([ids])).logits, before)


def _samples(count: int, length: int = 50) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(2, 1, length, 4, generator=g), torch.randn(2, 1, length, 4, generator=g)) for _ in range(count)
    ]


def test_a_transform_fitted_in_a_metric_inverts_and_spends_its_error_where_it_costs_little() -> None:
    metric = torch.diag(torch.tensor([100.0, 1.0, 1.0, 1.0])).expand(2, 2, 1, 4, 4).clone()
    samples = _samples(8)
    plain, weighted = fit_tables(samples, "m").transform, fit_tables(samples, "m", metric=metric).transform
    x = torch.stack(_samples(1)[0])
    torch.testing.assert_close(weighted.inverse(weighted.forward(x)), x, atol=1e-4, rtol=1e-4)
    errors = []
    for t in (plain, weighted):
        steps = t.steps(0.5)
        error = t.inverse(torch.round(t.forward(x) / steps) * steps) - x  # [2, L, H, S, D]
        errors.append(error.square().mean(dim=(0, 1, 2, 3)))
    assert float(errors[1][0]) < 0.5 * float(errors[0][0])  # the costly direction is coded finer
    assert float(errors[1][1:].mean()) > float(errors[0][1:].mean())  # and the cheap ones coarser


def test_a_metric_of_the_wrong_shape_or_without_weight_is_refused() -> None:
    with pytest.raises(CodecError, match="a metric is"):
        fit_tables(_samples(2), "m", metric=torch.eye(4).expand(2, 2, 1, 4, 4)[:, :1])
    with pytest.raises(CodecError, match="no positive eigenvalue"):
        fit_tables(_samples(2), "m", metric=torch.zeros(2, 2, 1, 4, 4))


def test_tables_fitted_in_a_metric_code_chunks_and_survive_a_save(tmp_path) -> None:
    samples = _samples(6, length=40)
    g = torch.Generator().manual_seed(1)
    factor = torch.randn(2, 2, 1, 4, 4, generator=g)
    metric = factor @ factor.transpose(-1, -2)
    tables = fit_tables(samples, "m", metric=metric)
    tables.save(tmp_path / "t.safetensors")
    again = CodecTables.load(tmp_path / "t.safetensors")
    assert again.digest == tables.digest != fit_tables(samples, "m").digest
    torch.testing.assert_close(again.transform.synthesis, tables.transform.synthesis)
    keys, values = _samples(1, length=33)[0]
    codec = CacheGenCodec(again)
    out = codec.decode(codec.encode(SpanKV(keys, values, torch.arange(33)), 5))
    torch.testing.assert_close(out.keys[:, :, 0], keys[:, :, 0].half().float())  # the first token as stored

    def cost(x: torch.Tensor, kind: int) -> float:  # x [L, H, S, D] in the metric
        return float(torch.einsum("lhsd,lhde,lhse->", x, metric[kind], x))

    assert cost(out.keys - keys, 0) < 0.05 * cost(keys, 0)
    assert cost(out.values - values, 1) < 0.05 * cost(values, 1)
