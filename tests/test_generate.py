"""Decoding properties: greedy is deterministic, a seed reproduces, limits and stop strings hold."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from pc_rag.engine import PromptCache
from pc_rag.model import LoadedModel
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text
from pc_rag.runtime.generate import SamplingParams, sample, stream_text


@pytest.fixture(scope="module")
def pc(tokenizer) -> PromptCache:
    cache = PromptCache(tiny_model("llama", tokenizer))
    cache.add_schema(Schema("s", (Text("Context: "), Module("doc", (Text("Paris is in France."),)))))
    return cache


PROMPT = Prompt("s", (Import("doc"), Text(" Where is Paris?")))


def test_greedy_is_deterministic_and_equals_full_prefill_for_one_module(pc: PromptCache) -> None:
    first = pc.generate(PROMPT, max_new_tokens=12)
    assert first.token_ids == pc.generate(PROMPT, max_new_tokens=12).token_ids
    # prefix + one module + text is an ordinary causal prompt: full prefill must agree token for token
    assert first.token_ids == pc.generate_full(PROMPT, max_new_tokens=12).token_ids


def test_seed_reproduces_sampling(pc: PromptCache) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=0.95, top_k=50, seed=7)
    a, b = pc.generate(PROMPT, params), pc.generate(PROMPT, params)
    assert a.token_ids == b.token_ids
    others = {tuple(pc.generate(PROMPT, params, seed=s).token_ids) for s in range(5)}
    assert len(others) > 1


def test_max_new_tokens_is_respected(pc: PromptCache) -> None:
    for n in (1, 5):
        result = pc.generate(PROMPT, max_new_tokens=n)
        assert len(result.token_ids) <= n and result.stats.new_tokens == len(result.token_ids)


def test_stats_count_cached_and_computed_tokens(pc: PromptCache) -> None:
    plan = pc.plan(PROMPT)
    stats = pc.generate(PROMPT, max_new_tokens=2).stats
    layout = pc.schemas["s"].layout
    assert stats.cached_tokens == sum(len(layout.spans[n].token_ids) for n in plan.spans)
    assert stats.computed_tokens == len(plan.new_ids)
    assert 0 < stats.ttft_ms <= stats.total_ms


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(100)
    params = SamplingParams(temperature=0.8, top_k=1, seed=0)
    assert sample(logits, params, torch.Generator().manual_seed(0)) == int(logits.argmax())


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    drawn = {sample(logits, params, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    "bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(keep_logits=-1)]
)
def test_invalid_sampling_settings_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


class _CharTokenizer:
    """Decodes ids as characters: enough to exercise stop-string handling."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world", ("wor",), "hello "),
        ("hello world", ("xyz",), "hello world"),
        ("a\n\nb", ("\n\n",), "a"),
        ("stop at once", ("stop",), ""),
    ],
)
def test_stop_strings_end_the_text_before_them(text: str, stop: tuple[str, ...], expected: str) -> None:
    seen: list[int] = []
    pieces = list(stream_text(iter(map(ord, text)), _CharTokenizer(), stop, seen.append))
    assert "".join(pieces) == expected
    assert all(not any(s in p for s in stop) for p in pieces)


def test_stop_string_in_generation(pc: PromptCache) -> None:
    full = pc.generate(PROMPT, max_new_tokens=12).text
    assert len(full) > 3
    stop = full[2:4]
    assert pc.generate(PROMPT, max_new_tokens=12, stop=(stop,)).text == full[: full.find(stop)]


def test_kv_dtype_and_device_options(tokenizer) -> None:
    lm: LoadedModel = tiny_model("qwen2", tokenizer)
    pc = PromptCache(lm, kv_device="cpu", kv_dtype=torch.bfloat16)
    encoded = pc.add_schema(Schema("s", (Module("doc", (Text("Paris is in France."),)),)))
    assert encoded.kv["doc"].keys.dtype == torch.bfloat16
    prompt = Prompt("s", (Import("doc"), Text(" Where?")))
    exact = PromptCache(lm)
    exact.add_schema(Schema("s", (Module("doc", (Text("Paris is in France."),)),)))
    low, high = (
        pc.generate(prompt, max_new_tokens=1).first_logits,
        exact.generate(prompt, max_new_tokens=1).first_logits,
    )
    assert (low - high).abs().max() / high.abs().max() < 2e-2


def test_kept_step_logits_are_the_logits_of_each_decoding_step(pc: PromptCache) -> None:
    result = pc.generate(PROMPT, max_new_tokens=6, keep_logits=4)
    assert result.step_logits is not None and result.step_logits.shape == (4, result.first_logits.shape[-1])
    assert result.step_logits.dtype == torch.float32 and result.step_logits.device.type == "cpu"
    ids = pc.full_prompt_ids(PROMPT)
    with torch.inference_mode():  # plain causal forward over prompt + generated tokens
        logits = pc.lm.model(input_ids=torch.tensor([[*ids, *result.token_ids[:3]]])).logits[0]
    torch.testing.assert_close(result.step_logits, logits[len(ids) - 1 :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result.step_logits[0], result.first_logits)
    assert result.token_ids[:4] == result.step_logits.argmax(-1).tolist()  # greedy: step j's argmax is token j
    assert pc.generate(PROMPT, max_new_tokens=6).step_logits is None  # kept only when asked
    assert pc.generate(PROMPT, max_new_tokens=2, keep_logits=8).step_logits.shape[0] == 2  # no more steps than run


def test_detokenizing_a_reply_never_decodes_it_whole_again() -> None:
    """Without a fast backend, each step decodes a window of a few ids, however long the reply."""
    decoded: list[int] = []

    class _Recording(_CharTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            decoded.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    text = "a long reply " * 40
    assert "".join(stream_text(iter(map(ord, text)), _Recording(), (), lambda _: None)) == text
    assert max(decoded) <= 2


@pytest.mark.parametrize("text", ["plain words", " naïve café — 東京, ok.", "a\n\n b  c"])
def test_streamed_pieces_join_to_the_full_decode(text: str) -> None:
    from tests.conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = list(stream_text(iter(ids), tokenizer, (), lambda _: None))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_cached_generation_uses_the_current_cache_api(tokenizer) -> None:
    """transformers 5.24 deprecates ``forward(past_key_values=...)`` with a FutureWarning; encoding the modules,
    prefilling the new tokens and decoding pass ``cache=`` instead."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        fresh = PromptCache(tiny_model("llama", tokenizer))
        fresh.add_schema(Schema("s", (Text("Context: "), Module("doc", (Text("Paris is in France."),)))))
        assert len(fresh.generate(PROMPT, max_new_tokens=3).token_ids) == 3


@pytest.mark.parametrize(
    ("version", "keyword"),
    [("5.17.0", "past_key_values"), ("5.23.1", "past_key_values"), ("5.24.0", "cache"), ("5.40.0.dev0", "cache")],
)
def test_the_cache_goes_under_the_installed_transformers_name(version: str, keyword: str) -> None:
    """A GPU image may ship transformers 5.17, whose forward has no ``cache`` argument (it would be swallowed by
    ``**kwargs`` and the cache ignored)."""
    from pc_rag.runtime.model_call import cache_keyword

    assert cache_keyword(version) == keyword
