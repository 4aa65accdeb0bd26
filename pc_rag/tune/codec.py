"""``pc-rag tune-codec``: fit a model's CacheGen tables on passages of the tuning split.

Passages are encoded the way stores encode chunks, alternately alone and after the preamble, so the
tables see both kinds of KV the recovery modes store. The tables are written where stores look for
them (``<fingerprint>.cachegen.safetensors``). This module knows nothing about serving.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from pc_rag.codec import CodecTables, fit_tables
from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import Example, load_examples, tuning_split
from pc_rag.rag.engine import ENCODE_BATCH, RagEngine
from pc_rag.rag.modes import MODES
from pc_rag.tune.kv_metric import kv_metric

DEFAULT_PASSAGES = 200
METRIC_QUESTIONS = 8  # full prompts whose queries measure what a key's error costs (kv_metric)
# Where each level's step is spent (CacheGen's layer-wise quantization), chosen on the tuning split (HotpotQA
# questions 340-355) with examples/codec_allocation.py, whose JSON is examples/results/codec_allocation*.json.
# Doubling the steps of one sixth of the layers raised the default mode's first-token KL by about
# 0.033 / 0.085 / 0.005 / 0.003 / 0.007 / 0.001 (first sixth to last); the factors go as 1/sqrt of that,
# normalised to keep the size and capped to [0.35, 2]. The layers the default mode's deviation probe reads
# get PROBE_LAYERS_STEP: its choice of tokens to recompute follows their values (alone, 0.35 cut that KL
# from 0.089 to 0.025 at step 0.7; 0.2 did no better).
DEPTH_STEPS = (0.5, 0.35, 1.3, 1.6, 1.1, 2.0)
PROBE_LAYERS_STEP = 0.35


def fit_codec(
    engine: RagEngine, dataset: Path, passages: int = DEFAULT_PASSAGES, *, metric_questions: int = METRIC_QUESTIONS,
    progress: bool = True,
) -> CodecTables:  # fmt: skip
    """Tables fitted on the first ``passages`` passages of the tuning split in ``dataset``, in the metric of the
    model's attention (``kv_metric``) measured on the full prompts of its first ``metric_questions`` (0: none)."""
    split = tuning_split(load_examples(dataset))
    texts = [t for e in split for t in _texts(engine, e)][:passages]
    if not texts:
        msg = f"{dataset} holds no passages of the tuning split to fit CacheGen tables on"
        raise PCRagError(msg)
    samples = encode_samples(engine, texts, progress=progress)
    metric = None
    if metric_questions:
        prompts = [engine.plain_ids(_texts(engine, e), e.question) for e in split[:metric_questions]]
        metric = kv_metric(engine.lm, tqdm(prompts, desc="metric", unit="prompt", disable=not progress))
    return fit_tables(samples, engine.lm.fingerprint(), allocation=allocation(samples[0][0].shape[0]), metric=metric)


def encode_samples(
    engine: RagEngine, texts: list[str], *, progress: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of ``texts`` encoded alternately alone and after the preamble."""
    samples = []
    for start in tqdm(range(0, len(texts), ENCODE_BATCH), desc="encode", unit="batch", disable=not progress):
        batch = texts[start : start + ENCODE_BATCH]
        ids = [engine.tokenize(t) for t in batch]
        chunks = engine.encode_token_ids(ids[::2], conditioned=False) + engine.encode_token_ids(
            ids[1::2], conditioned=True
        )
        samples.extend((c.kv.keys, c.kv.values) for c in chunks)
    return samples


def allocation(layers: int) -> torch.Tensor:
    """Per keys/values and layer, the factor on each level's step (``CodecTables``): ``DEPTH_STEPS`` by sixths of
    the depth, ``PROBE_LAYERS_STEP`` up to the default mode's probe layer."""
    out = torch.tensor([DEPTH_STEPS[i * len(DEPTH_STEPS) // layers] for i in range(layers)]).repeat(2, 1)
    out[:, : MODES["default"].probe_layer + 1] = PROBE_LAYERS_STEP
    return out


def _texts(engine: RagEngine, example: Example) -> list[str]:
    return [engine.passage_text(i + 1, p.title, p.text) for i, p in enumerate(example.passages)]
