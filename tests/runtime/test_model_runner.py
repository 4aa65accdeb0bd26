"""The model runner's static-shape forward equals the model's own forward: new tokens padded to a bucket after a
cache, at reserved positions, then decode steps; the padding writes nothing a real query sees. On a GPU the
captured graphs equal the eager static forward."""

from __future__ import annotations

import pytest
import torch
from test_weights import tiny_in

from pc_rag.kv import KVBuffer, allocate
from pc_rag.runtime.model_runner import PREFILL_BUCKETS, ModelRunner, StaticForward, bucket_for, capture_length

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


def _static_runner(model) -> ModelRunner:
    runner = ModelRunner(model)  # its own runner: ModelRunner.of would share the mode with other tests
    runner.enable_static()
    return runner


def _prefilled(model, capacity: int, prompt: list[int]) -> KVBuffer:
    buffer = allocate(model, capacity)
    buffer.keys.zero_()  # fresh memory may hold NaN, which a masked slot of the static forward would still spread
    buffer.values.zero_()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=buffer.cache(0), use_cache=True)
    return buffer


def test_capture_leaves_every_cached_slot_bit_identical(tokenizer) -> None:
    """The capture forwards of every bucket run at ``capture_length`` (the buffer's last slots), never over the
    cached tokens of the request that triggers them (at length 0 they would rewrite its first tokens)."""
    lm = tiny_in("llama", "float32", tokenizer)
    runner = _static_runner(lm.model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    buffer = _prefilled(lm.model, 128, prompt)
    keys, values = buffer.keys[..., : len(prompt), :].clone(), buffer.values[..., : len(prompt), :].clone()
    runner.prepare(buffer, len(prompt))
    assert runner.calls["captures"] == len([b for b in (1, *PREFILL_BUCKETS) if len(prompt) + b <= 128])
    assert torch.equal(buffer.keys[..., : len(prompt), :], keys)
    assert torch.equal(buffer.values[..., : len(prompt), :], values)
    assert buffer.keys[..., -1, :].abs().sum() > 0, "the capture forwards wrote nothing: the test saw no capture"
    assert [capture_length(128, b) for b in (1, 16, 128)] == [127, 112, 0]


def test_static_runner_matches_the_model_in_every_slot_and_step(tokenizer) -> None:
    """Weight-independent fidelity: after the runner's first forward (which captures) and several decode steps,
    every slot's key and value equals the model's own forward, and so does every step's logits."""
    lm = tiny_in("llama", "float32", tokenizer)
    runner = _static_runner(lm.model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours, theirs = _prefilled(lm.model, 64, prompt), _prefilled(lm.model, 64, prompt)
    question, at = [7, 8, 9], [8, 9, 10]
    with torch.inference_mode():
        logits, cache = runner.forward(ours, len(prompt), question, at)
        assert _relative(logits, _plain(lm.model, theirs.cache(len(prompt)), question, at)) < 1e-5
        for position, token in enumerate([10, 11, 12, 13], start=11):
            length = cache.get_seq_length()
            step = runner.decode(token, position, cache)
            assert _relative(step, _plain(lm.model, theirs.cache(length), [token], [position])) < 1e-5
    length = cache.get_seq_length()
    assert length == len(prompt) + len(question) + 4
    torch.testing.assert_close(ours.keys[..., :length, :], theirs.keys[..., :length, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.values[..., :length, :], theirs.values[..., :length, :], rtol=1e-5, atol=1e-5)
    calls = runner.take_calls()
    assert (calls["static"], calls["fallback"]) == (5, 0) and not runner.calls


def test_a_buffer_without_room_for_the_bucket_is_counted_as_a_fallback(tokenizer) -> None:
    lm = tiny_in("llama", "float32", tokenizer)
    runner = _static_runner(lm.model)
    buffer = _prefilled(lm.model, 20, list(range(3, 13)))
    runner.forward(buffer, 10, [5, 6], [10, 11])  # 10 cached + bucket 16 > 20 slots
    assert runner.calls["fallback"] == 1 and runner.calls["static"] == 0


def test_the_static_forward_compiles_whole_and_once_for_any_length(tokenizer) -> None:
    """The nearest CPU proxy for "capturable": ``torch.compile(fullgraph=True)`` traces the static forward with no
    graph break (AOT autograd functionalizes its KV writes), and a second cached length reuses the one graph (the
    length is a device tensor). About 5-10 s on one loaded core (the aot_eager backend; inductor takes ~2 min)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    lm = tiny_in("llama", "float32", tokenizer)
    forward = StaticForward.of(lm.model)
    assert forward is not None
    compiled_buffer, eager_buffer = (
        _prefilled(lm.model, 64, list(range(3, 23))),
        _prefilled(lm.model, 64, list(range(3, 23))),
    )
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forward.__call__, backend=counter, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for length in (20, 36):
            inputs = (torch.arange(16)[None] + 40, torch.arange(16)[None] + length, torch.tensor([length]),
                      torch.tensor([9]))  # fmt: skip
            mine = compiled(*inputs, compiled_buffer.keys, compiled_buffer.values)
            torch.testing.assert_close(mine, forward(*inputs, eager_buffer.keys, eager_buffer.values))
    assert counter.frame_count == 1, "recompiled for a new length"
    torch.testing.assert_close(compiled_buffer.keys[..., :52, :], eager_buffer.keys[..., :52, :])


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
        cached = graphed.keys[..., : len(prompt), :].clone()
        logits, cache = runner.forward(graphed, len(prompt), [7, 8, 9], [20, 21, 22])  # captures every bucket
        assert torch.equal(graphed.keys[..., : len(prompt), :], cached), "a capture wrote over cached tokens"
        reference = _plain(model, eager.cache(len(prompt)), [7, 8, 9], [20, 21, 22])
        assert _relative(logits, reference) < 1e-4
        for position, token in enumerate([10, 11, 12], start=23):
            step = runner.decode(token, position, cache)
            reference = _plain(model, eager.cache(cache.get_seq_length() - 1), [token], [position])
            assert _relative(step, reference) < 1e-4, f"step at {position}"
    calls = runner.take_calls()
    assert (calls["static"], calls["fallback"]) == (4, 0), calls
