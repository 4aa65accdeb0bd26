"""The model runner's static-shape forward equals the model's own forward: new tokens padded to a bucket after a
cache, at reserved positions, then decode steps; the padding writes nothing a real query sees. On a GPU the
captured graphs equal the eager static forward."""

from __future__ import annotations

import pytest
import torch
from test_weights import tiny_in

from pc_rag.kv import KVBuffer, allocate
from pc_rag.runtime.model_runner import ModelRunner, StaticForward, bucket_for

DESCRIBED = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2}


def _plain(model, cache, ids: list[int], positions: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([positions], device=device),
        cache=cache,
        use_cache=True,
    )
    return out.logits[0, -1]


def _static(
    forward: StaticForward, buffer: KVBuffer, length: int, ids: list[int], positions: list[int], bucket: int
) -> torch.Tensor:
    pad = bucket - len(ids)
    return forward(
        torch.tensor([[*ids, *[7] * pad]]),
        torch.tensor([[*positions, *[positions[-1]] * pad]]),
        torch.tensor([length]),
        torch.tensor([len(ids) - 1]),
        buffer.keys,
        buffer.values,
    )


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("arch", DESCRIBED)
def test_padded_forward_then_steps_equal_the_models_forward(tokenizer, arch: str, dtype: str) -> None:
    lm = tiny_in(arch, dtype, tokenizer)
    forward = StaticForward.of(lm.model)
    assert forward is not None
    prompt = tokenizer("The tower stands in Paris and is tall.", add_special_tokens=False)["input_ids"]
    question = [11, 42, 250, 3, 99]
    at = list(range(len(prompt) + 6, len(prompt) + 6 + len(question)))  # reserved positions: a gap of 6
    ours, theirs = allocate(lm.model, 64), allocate(lm.model, 64)
    ours.keys.zero_()  # fresh memory may hold NaN, which a masked slot would still spread (0 * NaN)
    ours.values.zero_()
    with torch.inference_mode():
        for buffer in (ours, theirs):
            lm.model(input_ids=torch.tensor([prompt]), cache=buffer.cache(0), use_cache=True)
        length = len(prompt)
        mine = _static(forward, ours, length, question, at, bucket=16)
        reference = _plain(lm.model, theirs.cache(length), question, at)
        assert _relative(mine, reference) < TOLERANCE[dtype]
        length += len(question)
        for position, token in enumerate([5, 77, 301], start=at[-1] + 1):
            mine = _static(forward, ours, length, [token], [position], bucket=1)
            reference = _plain(lm.model, theirs.cache(length), [token], [position])
            assert _relative(mine, reference) < TOLERANCE[dtype], f"step at {position}"
            length += 1
    close = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 5e-2, "atol": 1e-1}
    torch.testing.assert_close(ours.keys[:, :, :, :length], theirs.keys[:, :, :, :length], **close)
    torch.testing.assert_close(ours.values[:, :, :, :length], theirs.values[:, :, :, :length], **close)


def test_padding_is_invisible_to_real_queries(tokenizer) -> None:
    """Garbage the padded tokens leave after the cached length changes no logit: the same tokens in a bucket of
    16 and in a bucket of 64 (with other padding tokens) give the same logits and the same next step."""
    lm = tiny_in("llama", "float32", tokenizer)
    forward = StaticForward.of(lm.model)
    assert forward is not None
    ids, positions = [4, 8, 15, 16, 23], [0, 1, 2, 3, 4]
    small, large = allocate(lm.model, 128), allocate(lm.model, 128)
    small.keys.zero_()
    small.values.zero_()
    large.keys.normal_()  # whatever the buffer held before must not matter either
    large.values.normal_()
    with torch.inference_mode():
        a = _static(forward, small, 0, ids, positions, bucket=16)
        b = _static(forward, large, 0, ids, positions, bucket=64)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a = _static(forward, small, len(ids), [42], [5], bucket=1)
        b = _static(forward, large, len(ids), [42], [5], bucket=1)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 16, 17, 512)] == [1, 16, 16, 32, 512]
    assert bucket_for(513) is None


def test_cpu_runs_eagerly_and_refuses_graphs(tokenizer) -> None:
    lm = tiny_in("llama", "float32", tokenizer)
    assert not ModelRunner.of(lm.model).graphs
    assert ModelRunner.of(lm.model) is ModelRunner.of(lm.model)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        ModelRunner(lm.model, graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphed_forward_equals_the_eager_one_on_cuda(tokenizer, arch: str) -> None:
    lm = tiny_in(arch, "float32", tokenizer)
    model = lm.model.to("cuda")
    runner = ModelRunner(model)
    assert runner.graphs
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    graphed, eager = allocate(model, 1024), allocate(model, 1024)
    with torch.inference_mode():
        for buffer in (graphed, eager):
            model(input_ids=torch.tensor([prompt], device="cuda"), cache=buffer.cache(0), use_cache=True)
        logits, cache = runner.forward(graphed, len(prompt), [7, 8, 9], [20, 21, 22])
        reference = _plain(model, eager.cache(len(prompt)), [7, 8, 9], [20, 21, 22])
        assert _relative(logits, reference) < 1e-4
        for position, token in enumerate([10, 11, 12], start=23):
            step = runner.decode(token, position, cache)
            reference = _plain(model, eager.cache(cache.get_seq_length() - 1), [token], [position])
            assert _relative(step, reference) < 1e-4, f"step at {position}"
