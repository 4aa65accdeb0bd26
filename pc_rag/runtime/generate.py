"""Token-by-token decoding on a prepared cache: greedy or sampled, with EOS and stop strings.

The decoder knows nothing about how the cache was filled (spliced modules or a
full prefill): it receives the logits of the last prompt token, a cache whose
length is the prompt's, and the position of the first generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from pc_rag.runtime.decode_step import STEP_ROWS, rows_exact
from pc_rag.runtime.draft_policy import DraftPolicy
from pc_rag.runtime.model_call import PLAIN, ModelCall, with_cache
from pc_rag.runtime.model_runner import ModelRunner
from pc_rag.runtime.speculation import PromptLookup, accept
from pc_rag.runtime.threads import adapt_threads_at


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters.

    ``keep_logits``: the result keeps the logits of the first that many decoding steps (fidelity metrics).
    ``speculative``: verify drafts looked up in the prompt with each decode step (``runtime.speculation``) where
    the fused step runs. A speculative request's rows attend in calls of fixed shapes and its dense GEMMs run
    ``STEP_ROWS`` rows, drafts or not, so greedy output is bit-identical to the same steps without drafts, and
    sampled output equally distributed; against plain decoding (off) it differs by float rounding in float32 and
    bfloat16 and not at all in int8 and int4. ``True`` verifies every draft the lookup finds (up to
    ``STEP_ROWS - 1``). ``None`` (the default): on where it measured faster, int8 and int4 models on their CPU
    kernels (``ModelRunner.speculates_by_default``), each step verifying the drafts whose expected kept tokens
    pay for their rows' measured cost (``runtime.draft_policy``); float32 and bfloat16 steps of 4 rows cost about
    what the drafts they kept saved (docs/decoding.md).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    keep_logits: int = 0
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.keep_logits < 0:
            raise ValueError(f"invalid sampling settings: {self}")


@dataclass
class GenerationStats:
    """Timings in milliseconds and token counts of one request; ``decode_steps`` forwards ran after the first
    token, ``drafted`` draft tokens were verified in them and ``accepted`` kept."""

    ttft_ms: float
    total_ms: float
    cached_tokens: int
    computed_tokens: int
    new_tokens: int
    decode_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first token (None with fewer than two tokens)."""
        seconds = (self.total_ms - self.ttft_ms) / 1000
        return (self.new_tokens - 1) / seconds if self.new_tokens > 1 and seconds > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each decode step produced: its own and the drafts it kept (exactly 1 without speculation)."""
        return 1 + self.accepted / self.decode_steps if self.decode_steps else None


@dataclass
class GenerationResult:
    """Generated text (stop string excluded), its token ids, stats, and the first step's logits.

    ``step_logits`` [steps, V] (float32, CPU) is kept only when asked: row j holds the logits given the
    prompt and the first j generated tokens (``SamplingParams.keep_logits``), or the first j tokens of a
    reference the caller forced (``RagEngine.answer(reference_ids=...)``).
    """

    text: str
    token_ids: list[int]
    stats: GenerationStats
    first_logits: torch.Tensor = field(repr=False)
    step_logits: torch.Tensor | None = field(default=None, repr=False)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``logits`` [V] under ``params``."""
    if params.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params).cpu(), 1, generator=generator))


def top_probability(logits: torch.Tensor) -> float:
    """The largest softmax probability of one row of logits [V]: how sure the model is of its greedy pick."""
    row = logits.float()
    return float(torch.exp(row.max() - torch.logsumexp(row, -1)))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [V] that sampling with ``params`` (temperature > 0) draws from after ``logits`` [V]."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """All ids that end a reply: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class DecodedTokens(Iterator[int]):
    """Token ids as they are decoded; ``step_logits`` collects the logits of the first ``keep_logits`` tokens, and
    ``steps``, ``drafted``, ``accepted`` count decode forwards and draft tokens (``GenerationStats``).

    The logits are kept as they come (references, no copy): ``run_generation`` converts them after timing.
    """

    def __init__(self, step_logits: list[torch.Tensor]) -> None:
        self._tokens: Iterator[int] = iter(())
        self.step_logits = step_logits
        self.steps = self.drafted = self.accepted = 0

    def __next__(self) -> int:
        return next(self._tokens)


def decode_tokens(
    model: PreTrainedModel,
    cache: Cache,
    first_logits: torch.Tensor,
    next_position: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    call: ModelCall = PLAIN,
    context_ids: Sequence[int] = (),
) -> DecodedTokens:
    """Generated token ids (EOS excluded) until EOS or ``max_new_tokens``.

    Where the model runner's fused step serves ``cache`` under ``call`` (``ModelRunner.serves``), each step runs
    through it, inside ``call``'s context; with ``params.speculative`` and a runner that verifies drafts, the
    step also verifies drafts looked up in ``context_ids`` (the prompt's tokens) and the answer so far
    (``runtime.speculation``): as many as the lookup found with ``params.speculative``, as many as pay for their
    rows (``runtime.draft_policy``) when it is left unset. Elsewhere each step's forward runs through ``call``."""
    decoded = DecodedTokens([])
    runner = ModelRunner.of(model)
    fused = runner.serves(cache, call)
    wanted = runner.speculates_by_default if params.speculative is None else params.speculative
    drafts = wanted and fused and runner.speculates
    # a step runs as many rows as it has tokens where a row's bits do not depend on the row count (quantized
    # kernels, and no adapter or a merged one); elsewhere every step runs STEP_ROWS rows
    exact_rows = False
    if drafts and runner.rows_agree:
        with call.context():
            exact_rows = rows_exact(model)
    # unless asked for, a step verifies the drafts that pay for their rows: each row costs its matmuls and its
    # attention over the whole cache, so at 8K four rows cost about two one-row steps (where every step runs
    # STEP_ROWS rows, drafts cost nothing more: all are verified)
    policy = DraftPolicy(runner.step_costs, runner.keep_rates) if params.speculative is None and exact_rows else None

    def keep(step: int, logits: torch.Tensor) -> None:
        if step < params.keep_logits:
            decoded.step_logits.append(logits)  # logits [V] given the prompt and the tokens of steps < step

    @torch.inference_mode()
    def forward(tokens: list[int], position: int) -> torch.Tensor:
        decoded.steps += 1
        adapt_threads_at(decoded.steps)
        if fused:
            with call.context():
                if drafts:
                    rows = len(tokens) if exact_rows else STEP_ROWS
                    length, start = cache.get_seq_length(), time.perf_counter()
                    logits = runner.verify(tokens, position, cache, rows=rows)
                    runner.step_costs.record(rows, length, (time.perf_counter() - start) * 1000)
                    return logits
                return runner.decode(tokens[0], position, cache)[None]
        out = call(
            model,
            input_ids=torch.tensor([tokens], device=first_logits.device),
            position_ids=torch.tensor([[position]], device=first_logits.device),
            **with_cache(cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1:]

    @torch.inference_mode()
    def steps() -> Iterator[int]:
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        lookup = PromptLookup(context_ids, phrases=runner.answer_phrases) if drafts else None
        keep(0, first_logits)
        picked = [sample(first_logits, params, generator)]
        confidence = top_probability(first_logits) if policy is not None else None  # of the fed token's pick
        emitted = 0
        while True:
            for token in picked:
                if token in stop_ids:
                    return
                yield token
                emitted += 1
                if emitted == params.max_new_tokens:
                    return
                if lookup is not None:
                    lookup.append(token)
            fed = picked[-1]  # the one token of the step not yet in the cache
            proposed = []
            if lookup is not None:
                proposed = lookup.propose(min(STEP_ROWS - 1, params.max_new_tokens - emitted - 1))
                if policy is not None and proposed:
                    length = cache.get_seq_length()
                    proposed = proposed[
                        : policy.count(lookup.matched, len(proposed), length, lookup.agreed, lookup.source, confidence)
                    ]
            logits = forward([fed, *proposed], next_position + emitted - 1)
            if not proposed:
                keep(emitted, logits[0])
                picked = [sample(logits[0], params, generator)]
            else:
                picked = accept(
                    logits, proposed, params.temperature == 0, lambda row: probabilities(row, params), generator
                )
                for t in range(len(picked)):
                    keep(emitted + t, logits[t])
                rejected = len(proposed) - (len(picked) - 1)
                decoded.drafted += len(proposed)
                decoded.accepted += len(proposed) - rejected
                if policy is not None and lookup is not None:
                    kept = len(proposed) - rejected
                    policy.observe(lookup.matched, len(proposed), kept, lookup.agreed, lookup.source, confidence)
                if rejected:
                    for layer in cache.layers:
                        layer.crop(-rejected)
            if policy is not None:
                confidence = top_probability(logits[len(picked) - 1])  # the row that picked the next fed token

    decoded._tokens = steps()
    return decoded


class IncrementalDetokenizer:
    """Text of each new token id, without decoding the reply again at every step.

    Fast tokenizers use ``tokenizers.decoders.DecodeStream``; others decode a short window of ids (the
    offsets vLLM uses). A step returns ``None`` while a multi-byte character is incomplete.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read] is context only; text after it is new

    def step(self, token: int) -> str | None:
        if self._backend is not None:
            return self._stream.step(self._backend, token)
        self._ids.append(token)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        text = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


def stream_text(
    tokens: Iterator[int], tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], on_token: Callable[[int], None]
) -> Iterator[str]:
    """Turn token ids into text deltas, ending before the first stop string (held back until disambiguated).

    Each step costs the new token's text, not the reply's: pieces come from an ``IncrementalDetokenizer``
    and stop strings are searched only where a new piece could complete one.
    """
    detokenizer = IncrementalDetokenizer(tokenizer)
    longest = max((len(s) for s in stop), default=0)
    text, emitted = "", 0
    for token in tokens:
        on_token(token)
        piece = detokenizer.step(token)
        if not piece:
            continue
        searched = max(0, len(text) - longest + 1)
        text += piece
        cut = min((i for i in (text.find(s, searched) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            if cut > emitted:
                yield text[emitted:cut]
            return
        safe = len(text) - _longest_stop_prefix_suffix(text, stop)
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
    if len(text) > emitted:
        yield text[emitted:]


def _longest_stop_prefix_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Stopwatch:
    """Milliseconds since construction; ``mark()`` records the first-token time once."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def mark(self) -> None:
        if self.first is None:
            self.first = self.elapsed_ms()


class ReplyStream:
    """Text deltas of a reply as they are decoded; ``result`` is set when iteration ends."""

    def __init__(self, items: Iterator[str | GenerationResult]) -> None:
        self._items = items
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        for item in self._items:
            if isinstance(item, GenerationResult):
                self.result = item
            else:
                yield item


def run_generation(
    tokens: DecodedTokens,
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
    watch: Stopwatch,
    logits: torch.Tensor,
    cached: int,
    computed: int,
) -> Iterator[str | GenerationResult]:
    """Drive ``tokens`` to text deltas, timing the first token; end with the ``GenerationResult``.

    Kept step logits are copied to float32 on the CPU after the clock stops.
    """
    ids: list[int] = []

    def on_token(token: int) -> None:
        watch.mark()
        ids.append(token)

    pieces: list[str] = []
    for piece in stream_text(tokens, tokenizer, params.stop, on_token):
        pieces.append(piece)
        yield piece
    total = watch.elapsed_ms()
    first = watch.first if watch.first is not None else total
    stats = GenerationStats(first, total, cached, computed, len(ids), tokens.steps, tokens.drafted, tokens.accepted)
    steps = torch.stack([s.detach().float().cpu() for s in tokens.step_logits]) if tokens.step_logits else None
    yield GenerationResult("".join(pieces), ids, stats, logits.detach().float().cpu(), steps)


def collect(stream: Iterator[str | GenerationResult]) -> GenerationResult:
    """Exhaust a ``run_generation`` stream and return its result."""
    *_, result = stream
    assert isinstance(result, GenerationResult)
    return result
