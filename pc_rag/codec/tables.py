"""CacheGen tables: fitted once per model on a sample of modules, stored next to the store.

A table file holds the ``Transform`` (per keys/values, layer and head: mean, principal axes, RMS; per
layer whether token groups code deltas against their anchor) and, per quality level, the symbol
frequencies (``rans.PROB_BITS`` fixed point) of every lane (keys|values, layer, head, component) over the
symbol range the level uses.
Levels are recorded with their steps, so a store decodes with the levels it was encoded with even if
the defaults change. ``digest`` names the exact content; every compressed chunk records the digest
it needs. Safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pc_rag.codec import rans
from pc_rag.codec.entropy import SymbolCoder
from pc_rag.codec.levels import LEVELS, Level
from pc_rag.codec.quantize import GROUP_TOKENS, Transform, quantize
from pc_rag.errors import CodecCorruptedError, CodecError

TABLE_FORMAT = "pc-rag-cachegen-tables/1"
_SYMBOL_MARGIN = 4  # steps beyond the largest symbol seen in fitting that a level can still code
MAX_SHARED = 16  # shared first tokens kept in the tables
METRIC_FLOOR = 1e-2  # a metric's eigenvalues are floored at this x their mean: no direction is free


@dataclass
class CodecTables:
    """One model's ``transform`` and per-level symbol frequencies ``freq`` [2, L, H, D, 2 * limit + 1] (uint16)."""

    fingerprint: str
    transform: Transform
    levels: dict[int, Level]
    freq: dict[int, torch.Tensor]
    shared: torch.Tensor | None = None  # [n, 2, L, H, D]: first tokens many chunks share, referenced, not stored
    _coders: dict[int, SymbolCoder] = field(default_factory=dict, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of the model."""
        _, layers, heads, dim = self.transform.mean.shape
        return layers, heads, dim

    @cached_property
    def digest(self) -> str:
        """16 hex digits naming this exact content."""
        h = hashlib.sha256(json.dumps(self._metadata(), sort_keys=True).encode())
        for name, tensor in sorted(self._tensors().items()):
            h.update(name.encode())
            h.update(tensor.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def level(self, number: int) -> Level:
        if number not in self.levels:
            msg = f"the CacheGen tables {self.digest} have no level {number}; they have {sorted(self.levels)}"
            raise CodecError(msg)
        return self.levels[number]

    def coder(self, number: int) -> SymbolCoder:
        """The entropy coder of level ``number`` (built once)."""
        if number not in self._coders:
            self._coders[number] = SymbolCoder(self.freq[number].numpy(), self.level(number).limit)
        return self._coders[number]

    def save(self, path: str | Path) -> None:
        info = {**self._metadata(), "digest": self.digest}
        save_file(self._tensors(), str(path), metadata={"pc_rag": TABLE_FORMAT, "json": json.dumps(info)})

    @classmethod
    def load(cls, path: str | Path) -> CodecTables:
        """Read a table file; ``CodecCorruptedError`` if it is not one or is damaged."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except (OSError, SafetensorError) as e:
            raise CodecCorruptedError(f"CacheGen tables {path} cannot be read: {e}") from e
        if meta.get("pc_rag") != TABLE_FORMAT:
            raise CodecCorruptedError(f"{path} is not a CacheGen table file of format {TABLE_FORMAT}")
        try:
            info = json.loads(meta["json"])
            levels = {int(n): Level(int(n), float(d["step"]), int(d["limit"])) for n, d in info["levels"].items()}
            transform = Transform(
                tensors["mean"], tensors["basis"], tensors["rms"], tensors["anchored"], tensors.get("allocation"),
                tensors.get("synthesis"),
            )  # fmt: skip
            freq = {n: tensors[f"level{n}.freq"] for n in levels}
            tables = cls(info["fingerprint"], transform, levels, freq, tensors.get("shared"))
        except (KeyError, TypeError, ValueError) as e:
            raise CodecCorruptedError(f"CacheGen tables {path} are malformed: {e!r}") from e
        if info.get("digest") != tables.digest:
            raise CodecCorruptedError(f"CacheGen tables {path} do not match their digest: the file is damaged")
        return tables

    def _metadata(self) -> dict:
        levels = {str(n): {"step": lv.step, "limit": lv.limit} for n, lv in sorted(self.levels.items())}
        return {"fingerprint": self.fingerprint, "levels": levels}

    def _tensors(self) -> dict[str, torch.Tensor]:
        t = self.transform
        tensors = {"mean": t.mean, "basis": t.basis, "rms": t.rms, "anchored": t.anchored}
        if t.allocation is not None:  # tables fitted before allocations existed keep their digest
            tensors["allocation"] = t.allocation
        if t.synthesis is not None:  # as do tables fitted without a metric
            tensors["synthesis"] = t.synthesis
        if self.shared is not None:
            tensors["shared"] = self.shared
        tensors.update({f"level{n}.freq": self.freq[n] for n in self.levels})
        return {name: tensor.contiguous() for name, tensor in tensors.items()}


def fit_tables(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]], fingerprint: str, levels: Iterable[Level] = LEVELS.values(),
    allocation: torch.Tensor | None = None, metric: torch.Tensor | None = None,
) -> CodecTables:  # fmt: skip
    """Fit tables on ``samples`` of (keys, values) [L, H, S, D], keys as stored (after RoPE), with steps spent
    by ``allocation`` [2, L] (``Transform``; None: the same step everywhere) and errors measured in ``metric``
    [2, L, H, D, D] (``fit_transform``).

    Counts start at one, so every symbol in a level's range stays codable; a level's range is what the
    sample needed plus a margin (tokens beyond it are kept exactly).
    """
    if not samples:
        raise CodecError("fitting CacheGen tables needs at least one sample module")
    layers, heads, _, dim = samples[0][0].shape
    if allocation is not None and (allocation.shape != (2, layers) or not bool((allocation > 0).all())):
        raise CodecError(f"an allocation is [2, {layers}] positive steps, got {tuple(allocation.shape)}")
    if metric is not None and metric.shape != (2, layers, heads, dim, dim):
        raise CodecError(f"a metric is [2, {layers}, {heads}, {dim}, {dim}], got {tuple(metric.shape)}")
    kv = [torch.stack([k, v]).float() for k, v in samples]  # [2, L, H, S, D] each
    transform = fit_transform(kv, metric)
    if allocation is not None:
        transform.allocation = allocation.float().contiguous()
    freq, fitted = {}, {}
    for lv in levels:
        symbols = [quantize(x, transform, lv.step, lv.limit).symbols for x in kv]
        limit = min(lv.limit, max(int(s.abs().max()) for s in symbols if s.numel()) + _SYMBOL_MARGIN)
        fitted[lv.number] = Level(lv.number, lv.step, limit)
        counts = _count([quantize(x, transform, lv.step, limit).symbols for x in kv], limit)
        freq[lv.number] = torch.from_numpy(rans.quantize_probabilities(counts.flatten(0, 3).numpy())).view(counts.shape)
    return CodecTables(fingerprint, transform, fitted, freq, _shared_first_tokens(kv))


def _shared_first_tokens(kv: list[torch.Tensor]) -> torch.Tensor | None:
    """The first tokens [n, 2, L, H, D] that at least two samples start with, most common first (at most
    ``MAX_SHARED``): chunks in one prompt format all start with the same token at the same position."""
    counts: dict[bytes, tuple[int, torch.Tensor]] = {}
    for x in kv:
        first = x[:, :, :, 0].contiguous()
        key = first.numpy().tobytes()
        counts[key] = (counts.get(key, (0, first))[0] + 1, first)
    common = sorted((c for c in counts.values() if c[0] >= 2), key=lambda c: -c[0])[:MAX_SHARED]
    return torch.stack([first for _, first in common]) if common else None


def fit_transform(kv: list[torch.Tensor], metric: torch.Tensor | None = None) -> Transform:
    """Per head: mean, principal axes (largest variance first, signs fixed) and RMS; per layer: whether coding
    deltas against group anchors leaves less variance than coding the centred coefficients.

    With a ``metric`` M [2, L, H, D, D] (symmetric, positive semi-definite: how much an error ``e`` costs is
    ``e M e^T``), the axes are those of the vectors whitened by ``M^(1/2)``, so a uniform step spends bits
    where errors cost; a floor of ``METRIC_FLOOR`` x M's mean eigenvalue keeps it invertible."""
    tokens = sum(x.shape[3] for x in kv)
    mean = sum(x.sum(dim=3) for x in kv) / tokens
    centred = [x - mean[:, :, :, None] for x in kv]
    cov = sum(torch.matmul(c.transpose(-1, -2), c) for c in centred).double() / tokens
    root = inverse_root = None
    if metric is not None:
        root, inverse_root = _roots(metric.double())
        cov = root @ cov @ root
    eigenvalues, basis = torch.linalg.eigh(cov)  # ascending
    eigenvalues, basis = eigenvalues.flip(-1), basis.flip(-1)
    signs = torch.sign(basis.gather(-2, basis.abs().argmax(dim=-2, keepdim=True)))
    basis = basis * signs
    rms = eigenvalues.clamp(min=1e-12).mean(dim=-1).sqrt().float()
    synthesis = None
    if root is not None:
        basis, synthesis = root @ basis, (basis.transpose(-1, -2) @ inverse_root).float().contiguous()
    plain = Transform(mean, basis.float().contiguous(), rms, torch.zeros(mean.shape[:2], dtype=torch.bool),
                      synthesis=synthesis)  # fmt: skip
    alone = delta = torch.zeros(mean.shape[:2], dtype=torch.float64)
    for x in kv:
        c = plain.forward(x)[:, :, :, 1:]  # token 0 is kept exactly, in no group
        anchors = c[:, :, :, ::GROUP_TOKENS].repeat_interleave(GROUP_TOKENS, dim=3)[:, :, :, : c.shape[3]]
        follower = torch.ones(c.shape[3], dtype=torch.bool)
        follower[::GROUP_TOKENS] = False
        alone = alone + c[:, :, :, follower].square().sum(dim=(2, 3, 4))
        delta = delta + (c - anchors)[:, :, :, follower].square().sum(dim=(2, 3, 4))
    plain.anchored = delta < alone
    return plain


def _roots(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``M^(1/2)`` and ``M^(-1/2)`` of each metric, its eigenvalues floored at ``METRIC_FLOOR`` x their mean."""
    eigenvalues, vectors = torch.linalg.eigh((metric + metric.transpose(-1, -2)) / 2)
    floor = METRIC_FLOOR * eigenvalues.clamp(min=0).mean(dim=-1, keepdim=True)
    if not bool((floor > 0).all()):
        raise CodecError("a metric has no positive eigenvalue: errors would cost nothing")
    eigenvalues = eigenvalues.clamp(min=floor)
    vectors_t = vectors.transpose(-1, -2)
    root = (vectors * eigenvalues.sqrt()[..., None, :]) @ vectors_t
    return root, (vectors * eigenvalues.rsqrt()[..., None, :]) @ vectors_t


def _count(symbols: list[torch.Tensor], limit: int) -> torch.Tensor:
    """Symbol counts per lane [2, L, H, D, 2 * limit + 1] (+1 each) of ``symbols`` [2, L, H, S, D] each."""
    kinds, layers, heads, _, dim = symbols[0].shape
    width = 2 * limit + 1
    lanes = kinds * layers * heads * dim
    counts = torch.ones(lanes * width, dtype=torch.int64)
    offsets = torch.arange(lanes)[:, None] * width
    for s in symbols:
        flat = s.transpose(3, 4).reshape(lanes, -1).long() + limit + offsets
        counts += torch.bincount(flat.flatten(), minlength=lanes * width)
    return counts.view(kinds, layers, heads, dim, width)
