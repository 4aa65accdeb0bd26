"""Speculative decoding from the prompt: a verify row equals a one-token step bit for bit, greedy output equals
plain decoding, and sampled output keeps plain sampling's distribution."""

from __future__ import annotations

import math
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from conftest import TINY_CONFIGS, acting_adapter, tiny_model
from test_weights import tiny_in
from transformers import PreTrainedModel

from pc_rag.assemble import forward_new_tokens
from pc_rag.engine import PromptCache
from pc_rag.kv import allocate
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text
from pc_rag.rag.adapter import SpliceAdapter
from pc_rag.runtime import generate
from pc_rag.runtime.decode_step import STEP_ROWS
from pc_rag.runtime.draft_policy import DraftPolicy
from pc_rag.runtime.generate import SamplingParams, probabilities
from pc_rag.runtime.model_call import ModelCall
from pc_rag.runtime.model_runner import ModelRunner
from pc_rag.runtime.speculation import PromptLookup, accept
from pc_rag.runtime.verify_attention import BUCKET

DESCRIBED = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]


def test_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1])
    lookup.append(2)
    lookup.append(3)  # the text ends ... 1 2 3: the 3-gram occurred at the start, followed by 4 5 9
    assert lookup.propose(3) == [4, 5, 9]
    lookup.append(6)  # "2 3 6" and "3 6" never occurred, nor "6"
    assert lookup.propose(3) == []
    lookup.append(2)  # "6 2" never occurred; "2" last occurred before "2 3" at index 12... latest earlier: index 12
    assert lookup.propose(2) == [3, 6]
    assert lookup.propose(0) == []


def test_lookup_says_whether_every_occurrence_of_the_match_had_the_drafted_continuation() -> None:
    lookup = PromptLookup([4, 5, 6, 9, 4, 5, 6, 1, 4, 5])
    assert lookup.propose(2) == [6, 1] and lookup.matched == 2 and lookup.agreed  # 4 5 -> 6 both times
    lookup.append(6)
    assert lookup.propose(1) == [1] and lookup.matched == 3 and not lookup.agreed  # 4 5 6 -> 9, then 1
    assert lookup.propose(0) == [] and not lookup.agreed


def test_lookup_grows_past_its_room() -> None:
    lookup = PromptLookup([5, 6], room=1)
    for token in (7, 5, 6):
        lookup.append(token)
    assert lookup.propose(2) == [7, 5]


def _prefilled(lm, prompt: list[int]):
    buffer = allocate(lm.model, len(prompt) + 2 * STEP_ROWS)
    for tensor in (buffer.keys, buffer.values):
        tensor.fill_(float("nan"))  # what fresh memory may hold: the step must never let it into attention
    _, cache = forward_new_tokens(lm.model, buffer, 0, prompt, range(len(prompt)))
    return buffer, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("arch", DESCRIBED)
@pytest.mark.parametrize("cached", [9, BUCKET - 2])  # rows in one bucket of keys; rows across two
def test_a_verify_row_equals_the_one_token_step_bit_for_bit(
    tokenizer, decode_attention_path, arch: str, dtype: str, cached: int
) -> None:
    lm = tiny_in(arch, dtype, tokenizer)
    runner = ModelRunner.of(lm.model)
    prompt = [(7 * i) % 500 + 3 for i in range(cached)]
    tokens = [5, 77, 301, 9][:STEP_ROWS]
    plain_buffer, plain_cache = _prefilled(lm, prompt)
    spec_buffer, spec_cache = _prefilled(lm, prompt)
    with torch.inference_mode():  # each token alone through the speculative step (no drafts), then all at once
        one_by_one = torch.cat([runner.verify([t], len(prompt) + i, plain_cache) for i, t in enumerate(tokens)])
        verified = runner.verify(tokens, len(prompt), spec_cache)
    assert torch.equal(verified, one_by_one)
    length = len(prompt) + len(tokens)
    assert plain_cache.get_seq_length() == spec_cache.get_seq_length() == length
    assert torch.equal(plain_buffer.keys[..., :length, :], spec_buffer.keys[..., :length, :])
    assert torch.equal(plain_buffer.values[..., :length, :], spec_buffer.values[..., :length, :])


def _echo_prompt(tokenizer) -> tuple[PromptCache, Prompt]:
    """A prompt whose text repeats, so that drafts looked up in it are often right."""
    pc = PromptCache(tiny_model("llama", tokenizer))
    text = "The red tower stands in Paris. The red tower stands in Paris. The red tower stands in"
    pc.add_schema(Schema("s", (Module("doc", (Text(text),)),)))
    return pc, Prompt("s", (Import("doc"), Text(" Paris. The red tower")))


@pytest.mark.parametrize("arch", DESCRIBED)
def test_greedy_output_with_speculation_is_the_plain_output(
    tokenizer, decode_attention_path, arch: str, monkeypatch
) -> None:
    """Bit for bit against the same steps with no drafts; within float rounding against one-row steps."""
    pc = PromptCache(tiny_model(arch, tokenizer))
    text = "The red tower stands in Paris. The red tower stands in Paris. The red tower stands in"
    pc.add_schema(Schema("s", (Module("doc", (Text(text),)),)))
    accepted = 0
    for question in (" Paris. The red tower", " Where is it?", " tower stands"):
        prompt = Prompt("s", (Import("doc"), Text(question)))
        fast = pc.generate(prompt, max_new_tokens=40, keep_logits=40, speculative=True)
        one_row = pc.generate(prompt, max_new_tokens=40, keep_logits=40, speculative=False)
        with monkeypatch.context() as patch:
            patch.setattr(PromptLookup, "propose", lambda self, count: [])
            plain = pc.generate(prompt, max_new_tokens=40, keep_logits=40, speculative=True)
        assert fast.token_ids == plain.token_ids and fast.text == plain.text
        assert fast.step_logits is not None and plain.step_logits is not None and one_row.step_logits is not None
        assert torch.equal(fast.step_logits, plain.step_logits)  # each token picked from the same bits
        steps = min(len(one_row.step_logits), len(plain.step_logits))
        torch.testing.assert_close(one_row.step_logits[:steps], plain.step_logits[:steps], rtol=1e-4, atol=1e-4)
        assert plain.stats.decode_steps == len(plain.token_ids) - 1 and plain.stats.drafted == 0
        assert fast.stats.decode_steps <= plain.stats.decode_steps
        accepted += fast.stats.accepted
    assert accepted > 0  # drafts were kept: the test compared real speculation


def _oracle(answer: list[int], vocab: int):
    """``PromptLookup.propose`` from an oracle that knows the plain answer: no draft, or 1 to 3 tokens, some
    ending in a wrong one (a tiny random model rarely copies its prompt)."""
    starts: dict[int, int] = {}
    turns = iter(range(10**6))

    def propose(self: PromptLookup, count: int) -> list[int]:
        emitted = self._length - starts.setdefault(id(self), self._length - 1)
        right = answer[emitted : emitted + count]
        turn = next(turns) % 5  # none, 3 right, 1 right, 1 right then 1 wrong, 2 right then 1 wrong
        draft = [[], right, right[:1], right[:2], right][turn]
        return draft if turn < 3 or not draft else [*draft[:-1], (draft[-1] + 1) % vocab]

    return propose


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("arch", DESCRIBED)
def test_quantized_speculation_is_plain_one_row_decoding_bit_for_bit(
    tokenizer, decode_attention_path, arch: str, dtype: str, monkeypatch
) -> None:
    """With every linear layer on its quantized kernel, a row's bits do not depend on the step's row count, and a
    plain step attends as a speculative row does: a step runs as many rows as it has tokens, and speculative output
    equals one-row decoding in tokens and in every step's logits. Drafts come from an oracle that knows the plain
    answer (``_oracle``)."""
    pc = PromptCache(tiny_in(arch, dtype, tokenizer))
    assert ModelRunner.of(pc.lm.model).rows_agree
    pc.add_schema(Schema("s", (Module("doc", (Text("The red tower stands in Paris."),)),)))
    prompt = Prompt("s", (Import("doc"), Text(" Where is it?")))
    plain = pc.generate(prompt, max_new_tokens=40, keep_logits=40, speculative=False)
    steps: Counter[int] = Counter()
    eager = ModelRunner._eager

    def counted(self, tokens, position, cache, rows, bucketed=False):
        steps[rows] += 1
        return eager(self, tokens, position, cache, rows, bucketed)

    monkeypatch.setattr(PromptLookup, "propose", _oracle(plain.token_ids, len(tokenizer)))
    monkeypatch.setattr(ModelRunner, "_eager", counted)
    fast = pc.generate(prompt, max_new_tokens=40, keep_logits=40, speculative=True)
    assert fast.token_ids == plain.token_ids
    assert fast.step_logits is not None and plain.step_logits is not None
    assert torch.equal(fast.step_logits, plain.step_logits)
    assert fast.stats.accepted > 0 and fast.stats.accepted < fast.stats.drafted  # kept and rejected drafts
    assert set(steps) == {1, 2, 3, 4}  # each step ran as many rows as it had tokens


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_speculation_under_a_merged_adapter_is_plain_one_row_decoding_bit_for_bit(
    tokenizer, dtype: str, monkeypatch
) -> None:
    """The default mode decodes with its merged splice adapter applied: the fused kernels run with the adapter's
    padded low-rank term added to their rows (4 quantized calls per layer, as without it), so a row's bits still do
    not depend on the row count: each step runs as many rows as it has tokens and speculation equals one-row
    decoding. A hooked (trainable) adapter's term is a plain GEMM: there every speculative step runs
    ``STEP_ROWS`` rows."""
    lm = tiny_in("llama", dtype, tokenizer)
    prompt = tokenizer("The red tower stands in Paris. Where is it?", add_special_tokens=False)["input_ids"]
    steps: Counter[int] = Counter()
    eager = ModelRunner._eager

    def counted(self, tokens, position, cache, rows, bucketed=False):
        steps[rows] += 1
        return eager(self, tokens, position, cache, rows, bucketed)

    monkeypatch.setattr(ModelRunner, "_eager", counted)
    for merged in (True, False):
        adapter = acting_adapter(lm.model).attach(merged=merged)
        try:
            answer, plain = _decode_under(adapter, lm.model, prompt, speculative=False)
            steps.clear()
            with monkeypatch.context() as patch:
                patch.setattr(PromptLookup, "propose", _oracle(answer, len(tokenizer)))
                tokens, fast = _decode_under(adapter, lm.model, prompt, speculative=True)
        finally:
            adapter.detach()
        assert 0 < fast.accepted < fast.drafted  # kept and rejected drafts
        if merged:
            assert tokens == answer
            assert torch.equal(torch.stack(fast.step_logits), torch.stack(plain.step_logits))
            assert set(steps) == {1, 2, 3, 4}  # each step ran as many rows as it had tokens
        else:
            assert set(steps) == {STEP_ROWS}


def _decode_under(
    adapter: SpliceAdapter | None, model: PreTrainedModel, prompt: list[int], speculative: bool
) -> tuple[list[int], generate.DecodedTokens]:
    """The greedy answer to ``prompt`` with ``adapter`` applied to every model call (as the default mode runs), or
    with none."""
    context = nullcontext if adapter is None else adapter.applied
    buffer = allocate(model, len(prompt) + 48)
    with torch.inference_mode(), context():
        logits, cache = forward_new_tokens(model, buffer, 0, prompt, range(len(prompt)))
    params = SamplingParams(max_new_tokens=30, keep_logits=30, speculative=speculative)
    call = ModelCall(context=context)
    decoded = generate.decode_tokens(model, cache, logits, len(prompt), params, frozenset(), call)
    return list(decoded), decoded


def test_dense_models_keep_every_speculative_step_at_step_rows(tokenizer) -> None:
    """Dense GEMMs round by row count: there a step without drafts must still run ``STEP_ROWS`` rows."""
    assert not ModelRunner.of(tiny_in("llama", "float32", tokenizer).model).rows_agree
    assert not ModelRunner.of(tiny_in("llama", "bfloat16", tokenizer).model).rows_agree


def test_int8_verifies_drafts_and_undescribed_models_decode_one_token_per_forward(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(PromptLookup, "propose", lambda self, count: [7, 8, 9][:count])  # a draft every step
    schema = Schema("s", (Module("doc", (Text("The red tower. The red tower. The red tower."),)),))
    prompt = Prompt("s", (Import("doc"), Text(" The red")))
    quantized = PromptCache(tiny_in("llama", "int8", tokenizer))
    quantized.add_schema(schema)
    assert quantized.generate(prompt, max_new_tokens=12, speculative=True).stats.drafted > 0
    undescribed = PromptCache(tiny_model(sorted(set(TINY_CONFIGS) - set(DESCRIBED))[0], tokenizer))
    undescribed.add_schema(schema)
    plain = undescribed.generate(prompt, max_new_tokens=8, speculative=True)
    assert plain.stats.drafted == 0 and plain.stats.decode_steps == len(plain.token_ids) - 1


def test_the_sampling_rule_keeps_each_tokens_distribution() -> None:
    """Point-mass drafts under the speculative sampling rule: the first token is distributed as row 0, and the
    second, given that the first was the draft, as row 1 (chi-square against the exact probabilities)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    p = [probabilities(row, params) for row in logits]
    drafts = [int(p[0].argmax()), 2]  # a likely draft, then an arbitrary one
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    trials = 20_000
    for _ in range(trials):
        out = accept(logits, drafts, False, lambda row: probabilities(row, params), g)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert _chi_square_p(first, p[0], trials) > 1e-3
    assert _chi_square_p(second, p[1], sum(second.values())) > 1e-3


def _chi_square_p(counts: Counter[int], p: torch.Tensor, n: int) -> float:
    """The p-value of a chi-square goodness-of-fit test of ``counts`` against ``p`` (Wilson-Hilferty)."""
    stat = sum((counts.get(k, 0) - n * float(pk)) ** 2 / (n * float(pk)) for k, pk in enumerate(p) if pk > 0)
    dof = int((p > 0).sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_generation_on_a_tiny_model_keeps_plain_samplings_distribution(tokenizer, monkeypatch) -> None:
    """At temperature 1 on a tiny model (its head sharpened so a few tokens carry the mass), the first two tokens
    with speculation and without are samples of one distribution (a two-sample chi-square test). The drafts are
    the greedy continuation, so they are kept often and rejected often."""
    pc, prompt = _echo_prompt(tokenizer)
    with torch.no_grad():
        pc.lm.model.lm_head.weight.mul_(3.0)  # tied to the embeddings: a peaked, still random, distribution
    greedy = pc.generate(prompt, max_new_tokens=4, speculative=False).token_ids
    monkeypatch.setattr(PromptLookup, "propose", lambda self, count: greedy[self._length - self._start :][:count])
    runs = 200
    samples: dict[bool, Counter[tuple[int, ...]]] = {True: Counter(), False: Counter()}
    drafted = accepted = 0
    for speculative in (False, True):
        for seed in range(runs):
            result = pc.generate(prompt, max_new_tokens=3, temperature=1.0, seed=seed, speculative=speculative)
            samples[speculative][tuple(result.token_ids[:2])] += 1
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert 0 < accepted < drafted  # drafts were both kept and rejected
    keys = set(samples[True]) | set(samples[False])
    common = [k for k in keys if samples[True][k] + samples[False][k] >= 10]
    stat = sum((samples[True][k] - samples[False][k]) ** 2 / (samples[True][k] + samples[False][k]) for k in common)
    dof = max(len(common) - 1, 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


def test_speculation_is_on_by_default_for_quantized_models_where_drafts_pay_for_their_rows(
    tokenizer, monkeypatch
) -> None:
    """Left unset, speculation runs where it measured faster (int8/int4 kernels), each step verifying the drafts
    whose expected kept tokens pay for their rows' measured cost (``draft_policy``): none once a runner timed
    several-row steps at three times a one-row step's cost; asked for, it verifies every draft; dense models
    decode plainly unless asked."""

    def propose(self: PromptLookup, count: int) -> list[int]:  # a draft every step, after a 3-token match
        self.matched = 3
        return [7, 8, 9][:count]

    monkeypatch.setattr(PromptLookup, "propose", propose)
    schema = Schema("s", (Module("doc", (Text("The red tower. The red tower. The red tower."),)),))
    prompt = Prompt("s", (Import("doc"), Text(" The red")))
    model = tiny_in("llama", "int4", tokenizer)
    quantized = PromptCache(model)
    quantized.add_schema(schema)
    cheap = quantized.generate(prompt, max_new_tokens=12).stats
    assert cheap.drafted > 0  # drafts were verified (a random model rejects them)
    costs = ModelRunner.of(model.model).step_costs
    for rows in range(1, STEP_ROWS + 1):  # several-row steps measured expensive at this length
        for _ in range(8):
            costs.record(rows, 0, 1.0 + 2.0 * (rows - 1))
    assert quantized.generate(prompt, max_new_tokens=12).stats.drafted == 0
    forced = quantized.generate(prompt, max_new_tokens=12, speculative=True).stats
    assert forced.drafted >= forced.decode_steps  # every step verified drafts
    dense = PromptCache(tiny_model("llama", tokenizer))
    dense.add_schema(schema)
    assert dense.generate(prompt, max_new_tokens=12).stats.drafted == 0
    assert dense.generate(prompt, max_new_tokens=12, speculative=True).stats.drafted > 0


def test_the_policy_is_given_each_fed_tokens_confidence(tokenizer, monkeypatch) -> None:
    """Each policy decision gets the top probability of the logits row that picked the step's fed token (the first
    logits' for the first step, then the row of the token each step emitted last)."""
    seen: list[float | None] = []
    original = DraftPolicy.count

    def count(self: DraftPolicy, *args: object, **kwargs: object) -> int:
        seen.append(args[5] if len(args) > 5 else kwargs.get("confidence"))  # type: ignore[arg-type]
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DraftPolicy, "count", count)
    schema = Schema("s", (Module("doc", (Text("The red tower. The red tower. The red tower."),)),))
    prompt = Prompt("s", (Import("doc"), Text(" The red")))
    cache = PromptCache(tiny_in("llama", "int4", tokenizer))
    cache.add_schema(schema)
    result = cache.generate(prompt, max_new_tokens=12, keep_logits=12)
    assert seen and all(p is not None and 0 < p <= 1 for p in seen)
    picks = torch.stack(list(result.step_logits)).softmax(-1).max(-1).values  # each emitted token's pick
    assert all(float((picks - p).abs().min()) < 1e-6 for p in seen)  # each the top probability of a pick's row
    assert len(set(seen)) > 1  # not one constant
