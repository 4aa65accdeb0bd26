"""Train a splice adapter by self-distillation against full prefill.

The student is the serving path of ``prefix``: chunk KV encoded after the preamble,
re-rotated to its slot and frozen; only the question and the teacher's answer tokens
are computed, with the adapter applied, and only they carry gradients. The loss is
KL(teacher || student) summed over the teacher's answer steps, with the teacher's
top-k tokens and the remaining mass as one bucket. No labels are used. The best
adapter on the validation pairs (mean KL over the steps) is kept, and training stops
when it has not improved for ``patience`` evaluations. With ``recompute`` shares the
student may also be a recompute mode's serving path (``selective:<share>+adapter-question``): the
chunk tokens whose values deviate most are recomputed first by the plain model (no gradients, as
serving does), then the question and answer run adapted over the refreshed cache; pairs cycle through
the shares, so one adapter learns every budget it will serve. With gradients on, the
serving attention computes query-time rows by differentiable tensor ops (its fused
kernel's log-sum-exp has no gradient). An adapter with an encoding side trains both sides jointly: the
student encodes its chunks in each step with the encoding side (``chunk_side``), so the KL reaches those
weights through the chunk keys and values, at the cost of a forward and backward over the chunks. This
module knows nothing about how pairs or teacher records are produced.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from pc_rag.assemble import splice
from pc_rag.calibration import KWARG as SEGMENTS
from pc_rag.calibration import Calibration, Segments
from pc_rag.errors import PCRagError
from pc_rag.kv import KVBuffer, allocate
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.rag.modes import MODES
from pc_rag.rag.select import deviation_indices
from pc_rag.recompute import recompute_and_prefill
from pc_rag.runtime.model_call import with_cache
from pc_rag.tune.chunk_side import encoded_chunk_cache
from pc_rag.tune.pairs import Pair
from pc_rag.tune.teacher import TeacherRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and schedule: AdamW at ``lr``, ``accumulate`` pairs per step, validation every ``eval_every`` pairs."""

    epochs: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    accumulate: int = 8
    eval_every: int = 400
    patience: int = 3
    seed: int = 0
    recompute: tuple[float, ...] = (0.0,)  # shares of chunk tokens recomputed before the student's question

    def share(self, index: int) -> float:
        """The recompute share of the ``index``-th pair seen (training) or validated."""
        return self.recompute[index % len(self.recompute)]


@dataclass
class Validation:
    """Mean KL(teacher || student) over validation pairs: at the first step and over all teacher steps."""

    pairs_seen: int
    first_kl: float
    mean_kl: float


@dataclass
class TrainReport:
    """The validation history (the first entry is the starting adapter: adapter-free unless ``init``), the best
    entry kept, and the cost: wall seconds and pair steps trained."""

    history: list[Validation] = field(default_factory=list)
    best: Validation | None = None
    seconds: float = 0.0
    pair_steps: int = 0


def topk_kl(teacher_logp: torch.Tensor, teacher_index: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per step [S] from the teacher's top-k ``logp``/``index`` [S, K] and the student's log-probs [S, V].

    Mass outside the teacher's top k is one bucket on both sides, so this is a (tight) lower bound of the full KL.
    """
    q_top = student_logp.gather(-1, teacher_index)
    p = teacher_logp.exp()
    rest_p = (1 - p.sum(-1)).clamp_min(1e-12)
    rest_q = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    return (p * (teacher_logp - q_top)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())


def student_logprobs(
    engine: RagEngine,
    adapter: SpliceAdapter | None,
    chunks: Sequence[Chunk],
    question: str,
    record: TeacherRecord,
    calibration: Calibration | None = None,
    recompute: float = 0.0,
) -> torch.Tensor:
    """Log-probs [steps, V] of the spliced prompt teacher-forced with the teacher's answer, adapter applied.

    With ``calibration`` the question and answer rows attend to the chunks APE-calibrated; with
    ``recompute`` that share of chunk tokens is first refreshed as ``selective`` serving does.
    """
    model = engine.lm.model
    query = engine.layout(chunks, question)  # the slots and positions serving gives these chunks
    head, cursor = query.head, query.chunks_end
    if adapter is not None and adapter.encodes:  # the chunk side trains too: chunks are encoded in this step
        if recompute > 0:
            msg = "an adapter with an encoding side trains without recompute (--recompute 0)"
            raise PCRagError(msg)
        cache = encoded_chunk_cache(engine, adapter, chunks, query.slots())
    else:
        buffer = allocate(model, cursor)
        moved = [(c.kv, start - int(c.kv.positions[0])) for c, (start, _) in zip(chunks, query.slots(), strict=True)]
        splice(buffer, engine.lm.rope, [(engine.head_kv, 0), *moved])
        if recompute > 0:
            _refresh(model, buffer, head, [t for c in chunks for t in c.token_ids], recompute)
        layers = range(buffer.keys.shape[0])
        cache = DynamicCache(ddp_cache_data=[(buffer.keys[i], buffer.values[i]) for i in layers], config=model.config)
    inputs = [*query.plan.new_ids, *record.answer_ids[: record.steps - 1]]
    device = engine.lm.device
    extra = {} if calibration is None else {SEGMENTS: Segments(head, cursor, calibration)}
    with adapter.applied() if adapter is not None else nullcontext():
        out = model(
            input_ids=torch.tensor([inputs], device=device),
            position_ids=torch.arange(cursor, cursor + len(inputs), device=device)[None],
            **with_cache(cache),
            use_cache=True,
            logits_to_keep=record.steps,
            **extra,
        )
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _refresh(model: PreTrainedModel, buffer: KVBuffer, head: int, ids: Sequence[int], share: float) -> None:
    """Recompute in place, with the plain model, the ``share`` of chunk tokens (cache ``head...``) whose values
    deviate most at the probe layer: what ``selective:<share>`` serving recomputes."""
    chosen = sorted(deviation_indices(model, buffer, head, ids, share, MODES["selective"].probe_layer))
    recompute_and_prefill(model, buffer, head + len(ids), chosen, [ids[i - head] for i in chosen], chosen, [], [])


def validate(
    engine: RagEngine,
    adapter: SpliceAdapter | None,
    pairs: Sequence[Pair],
    chunks: Callable[[Pair], list[Chunk]],
    teacher: Callable[[str], TeacherRecord],
    pairs_seen: int = 0,
    calibration: Calibration | None = None,
    recompute: Callable[[int], float] = lambda index: 0.0,
) -> Validation:
    """Mean first-step and all-step KL(teacher || student) over ``pairs``, without gradients; pair i's student
    recomputes the share ``recompute(i)``."""
    firsts, means = [], []
    with torch.no_grad():
        for index, pair in enumerate(pairs):
            record = teacher(pair.key)
            logp = student_logprobs(engine, adapter, chunks(pair), pair.question, record, calibration, recompute(index))
            kl = topk_kl(record.logp, record.index, logp)
            firsts.append(float(kl[0]))
            means.append(float(kl.mean()))
    return Validation(pairs_seen, math.fsum(firsts) / len(firsts), math.fsum(means) / len(means))


def train_adapter(
    engine: RagEngine,
    train_pairs: Sequence[Pair],
    val_pairs: Sequence[Pair],
    chunks: Callable[[Pair], list[Chunk]],
    teacher: Callable[[str], TeacherRecord],
    adapter_config: AdapterConfig,
    config: TrainConfig,
    *,
    progress: bool = True,
    init: Path | None = None,
) -> tuple[SpliceAdapter, TrainReport]:
    """Train an adapter on ``train_pairs``; return the best one on ``val_pairs`` (detached) and the history.

    ``init``: start from the adapter in this file (same rank and targets): its query side, and its encoding side
    when it has one and ``adapter_config`` asks for the same kind; an encoding side it lacks starts as the identity.
    """
    torch.manual_seed(config.seed)
    clock = time.perf_counter()
    model = engine.lm.model
    adapter = SpliceAdapter(model, adapter_config, engine.lm.fingerprint())
    if init is not None:
        _start_from(adapter, SpliceAdapter.load(init, model, engine.lm.fingerprint()), init)
    adapter.attach()
    params = [*adapter.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    report = TrainReport()
    best_state: dict[str, torch.Tensor] = {}

    def checkpoint(seen: int) -> bool:
        """Validate; keep the adapter if it is the best so far. Returns whether it was."""
        nonlocal best_state
        result = validate(engine, adapter, val_pairs, chunks, teacher, seen, recompute=config.share)
        report.history.append(result)
        if report.best is not None and result.mean_kl >= report.best.mean_kl:
            return False
        report.best, best_state = result, {k: v.detach().clone() for k, v in adapter.state_dict().items()}
        return True

    seen, stale = 0, 0
    try:
        checkpoint(0)  # the starting point: adapter-free (B starts at zero), or the ``init`` adapter
        start = "no adapter" if init is None else f"from {init}"
        logger.info("start (%s): first KL %.4f, mean KL %.4f", start, report.best.first_kl, report.best.mean_kl)
        bar = tqdm(total=config.epochs * len(train_pairs), desc="tune", unit="pair", disable=not progress)
        for pair in _shuffled_epochs(train_pairs, config.epochs, random.Random(config.seed)):
            record = teacher(pair.key)
            logp = student_logprobs(engine, adapter, chunks(pair), pair.question, record, recompute=config.share(seen))
            # clones: records made under inference mode cannot be saved for backward
            loss = topk_kl(record.logp.clone(), record.index.clone(), logp).sum() / config.accumulate
            loss.backward()
            seen += 1
            bar.update()
            if seen % config.accumulate == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if seen % config.eval_every == 0:
                stale = 0 if checkpoint(seen) else stale + 1
                bar.set_postfix(val_kl=f"{report.history[-1].mean_kl:.4f}", first=f"{report.history[-1].first_kl:.4f}")
                if stale >= config.patience:
                    break
        bar.close()
        if seen % config.eval_every:  # the pairs since the last validation count too
            checkpoint(seen)
    finally:
        adapter.detach()
        for p in frozen:
            p.requires_grad_(True)
    adapter.load_state_dict(best_state)
    report.seconds, report.pair_steps = time.perf_counter() - clock, seen
    return adapter.requires_grad_(False), report


def _start_from(adapter: SpliceAdapter, start: SpliceAdapter, path: Path) -> None:
    """Copy ``start``'s pairs into ``adapter`` (both sides where they match); ``PCRagError`` if they do not fit."""
    mine, theirs = adapter.config, start.config
    if (mine.rank, mine.alpha, sorted(mine.targets)) != (theirs.rank, theirs.alpha, sorted(theirs.targets)):
        msg = (
            f"--init {path} has rank {theirs.rank}, alpha {theirs.alpha}, targets {','.join(theirs.targets)}; "
            f"this run asks for rank {mine.rank}, alpha {mine.alpha}, targets {','.join(mine.targets)}"
        )
        raise PCRagError(msg)
    state = start.state_dict()
    if theirs.encoding != mine.encoding:  # only the query side carries over
        state = {k: v for k, v in state.items() if k.startswith(("lora_a.", "lora_b."))}
    missing = adapter.load_state_dict(state, strict=False).missing_keys
    assert all(k.startswith(("encode_a.", "encode_b.")) for k in missing), missing


def _shuffled_epochs(pairs: Sequence[Pair], epochs: int, rng: random.Random) -> Iterator[Pair]:
    """``pairs`` ``epochs`` times, each pass in a new shuffled order."""
    order = list(pairs)
    for _ in range(epochs):
        rng.shuffle(order)
        yield from order
