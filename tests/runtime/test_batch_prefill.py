"""Packed prefill of several requests equals each request's own forward, and packing changes no bit of a request."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_model

from pc_rag.assemble import forward_new_tokens
from pc_rag.kv import allocate
from pc_rag.runtime.batch_prefill import BatchPrefill, PrefillJob

DESCRIBED = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]
SIZES = [(40, 7), (90, 12), (3, 5), (0, 9)]  # (cached entries, new tokens); the last prefills from nothing


def _jobs(model, seed: int) -> list[PrefillJob]:
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for cached, new in SIZES:
        buffer = allocate(model, cached + new + 8)
        buffer.keys[:, :, :, :cached] = torch.randn(buffer.keys[:, :, :, :cached].shape, generator=g)
        buffer.values[:, :, :, :cached] = torch.randn(buffer.values[:, :, :, :cached].shape, generator=g)
        ids = torch.randint(0, 2000, (new,), generator=g).tolist()
        jobs.append(PrefillJob(buffer, cached, ids, list(range(cached + 3, cached + 3 + new))))
    return jobs


@pytest.mark.parametrize("arch", DESCRIBED)
def test_each_packed_request_equals_its_own_forward(tokenizer, arch: str) -> None:
    lm = tiny_model(arch, tokenizer)
    packed, alone = _jobs(lm.model, 0), _jobs(lm.model, 0)
    logits = BatchPrefill.of(lm.model)(packed)
    for job, own, got in zip(packed, alone, logits, strict=True):
        want, _ = forward_new_tokens(lm.model, own.buffer, own.length, own.ids, own.positions)
        error = (got - want).abs().max() / want.abs().max()  # logits: relative to their scale, as DecodeStep's test
        assert error < 1e-5, f"relative error {error:.1e}"
        end = job.length + len(job.ids)
        torch.testing.assert_close(job.buffer.keys[..., :end, :], own.buffer.keys[..., :end, :], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            job.buffer.values[..., :end, :], own.buffer.values[..., :end, :], rtol=1e-5, atol=1e-5
        )


def test_a_request_gets_the_same_bits_packed_alone_or_with_others(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    prefill = BatchPrefill.of(lm.model)
    together = prefill(_jobs(lm.model, 1))
    for i in range(len(SIZES)):
        assert torch.equal(prefill([_jobs(lm.model, 1)[i]])[0], together[i]), f"request {i}"


@pytest.mark.parametrize("arch", sorted(set(TINY_CONFIGS) - set(DESCRIBED)))
def test_models_it_does_not_describe_get_no_packed_prefill(tokenizer, arch: str) -> None:
    assert BatchPrefill.of(tiny_model(arch, tokenizer).model) is None
