"""A splice adapter: low-rank corrections applied only to the tokens computed at query time.

Chunks encoded separately never attended to each other. A splice adapter is a set
of LoRA pairs ``(A, B)`` on chosen linear layers of every decoder layer (``q_proj``
and ``o_proj`` by default) that adds ``scale * B(A(x))`` to their output, trained
by self-distillation so that a question computed over spliced chunk KV behaves as
after a full prefill. It is attached to a model with forward hooks, or for serving a frozen
adapter with each pair folded once into a copy of its layer's weight, so an adapted call costs what
a plain one does (the model's own weights and parameter names are untouched either way). It acts
only inside ``applied()``:
chunk encoding and full prefill never see it, so stored chunk KV stays valid.
``applied()`` sets a context variable for the calling thread only (and names the adapter, so two
adapters hooked into one model never act together); wrap each model call in it, never a generator's
whole life (a context variable set across a ``yield`` leaks into whatever the consumer runs next).

Weights are saved as safetensors with the configuration and the model fingerprint
in the metadata; loading under another fingerprint is refused. This module knows
nothing about chunks, prompts or training data.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from pc_rag.errors import PCRagError

# (adapter, rows left unadapted at the start of each call's sequence) while ``applied()``
_APPLIED: contextvars.ContextVar[tuple[object, int] | None] = contextvars.ContextVar(
    "pc_rag_splice_adapter", default=None
)
FORMAT = "pc-rag-splice-adapter/1"


class AdapterError(PCRagError):
    """An adapter file that is unreadable, malformed or made for another model."""


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA ``rank`` and ``alpha`` (scale = alpha / rank) on the linear layers named ``targets`` of each layer."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "o_proj")

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.targets:
            msg = f"an adapter needs rank >= 1 and at least one target, got {self}"
            raise AdapterError(msg)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class SpliceAdapter(nn.Module):
    """LoRA pairs for ``model``'s decoder layers; ``attach`` hooks them in, ``applied()`` turns them on."""

    def __init__(self, model: PreTrainedModel, config: AdapterConfig, fingerprint: str) -> None:
        super().__init__()
        self.config, self.fingerprint = config, fingerprint
        self._targets = _target_modules(model, config.targets)
        ref = next(model.parameters())
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for name, linear in self._targets.items():
            key = _key(name)
            a = torch.empty(config.rank, linear.in_features, dtype=ref.dtype, device=ref.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as LoRA: A random, B zero, so the start is the identity
            self.lora_a[key] = nn.Parameter(a)
            b = torch.zeros(linear.out_features, config.rank, dtype=ref.dtype, device=ref.device)
            self.lora_b[key] = nn.Parameter(b)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._merged: list[nn.Linear] = []

    def attach(self, *, merged: bool = False) -> SpliceAdapter:
        """Hook the pairs into the model (idempotent); they act only inside ``applied()``.

        ``merged``: fold each pair into a copy of its layer's weight now, for serving a frozen adapter at the
        plain layer's cost; later changes to the pairs are not seen. Training needs the unmerged hooks.
        """
        if not self._hooks and not self._merged:
            for name, linear in self._targets.items():
                if merged:
                    self._merge_into(linear, _key(name))
                else:
                    self._hooks.append(linear.register_forward_hook(self._hook(_key(name))))
        return self

    def detach(self) -> None:
        """Remove the hooks or merged weights: the model is exactly as before ``attach``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for linear in self._merged:
            del linear.forward  # the instance attribute set by _merge_into; the class's forward shows again
        self._merged.clear()

    def _merge_into(self, linear: nn.Linear, key: str) -> None:
        if "forward" in linear.__dict__:
            msg = "another merged splice adapter is attached to this model: detach it first"
            raise AdapterError(msg)
        with torch.no_grad():
            delta = self.lora_b[key].float() @ self.lora_a[key].float() * self.config.scale
            weight = (linear.weight.float() + delta).to(linear.weight.dtype)
        plain = linear.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            skip = self._skipped_rows()
            if skip is None:
                return plain(x)
            if not skip:
                return F.linear(x, weight, linear.bias)
            return torch.cat((plain(x[:, :skip]), F.linear(x[:, skip:], weight, linear.bias)), dim=1)

        linear.forward = forward
        self._merged.append(linear)

    def _hook(self, key: str):
        a, b, scale = self.lora_a[key], self.lora_b[key], self.config.scale

        def add_low_rank(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            skip = self._skipped_rows()
            if skip is None:
                return output
            x = inputs[0][:, skip:]  # [B, Q - skip, in]
            delta = (x @ a.to(x.dtype).T) @ (b.to(x.dtype).T * scale)
            return output + delta if not skip else torch.cat((output[:, :skip], output[:, skip:] + delta), dim=1)

        return add_low_rank

    @property
    def digest(self) -> str:
        """A short sha256 of the model fingerprint, configuration and weights: which adapter answers assume."""
        h = hashlib.sha256(f"{FORMAT}|{self.fingerprint}|{asdict(self.config)}".encode())
        for name, tensor in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        """Write the pairs and their configuration as safetensors (float32)."""
        tensors = {f"{k}.a": p.detach().float().cpu().contiguous() for k, p in self.lora_a.items()}
        tensors |= {f"{k}.b": p.detach().float().cpu().contiguous() for k, p in self.lora_b.items()}
        config = asdict(self.config) | {"targets": list(self.config.targets)}
        meta = {"format": FORMAT, "config": json.dumps(config), "fingerprint": self.fingerprint}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, model: PreTrainedModel, fingerprint: str) -> SpliceAdapter:
        """Read an adapter saved by ``save`` for a model with ``fingerprint``; ``AdapterError`` otherwise."""
        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        except (OSError, SafetensorError) as e:
            msg = f"cannot read splice adapter {path}: {e}"
            raise AdapterError(msg) from e
        if meta.get("format") != FORMAT:
            msg = f"{path} is not a pc-rag splice adapter (format {meta.get('format')!r}, expected {FORMAT!r})"
            raise AdapterError(msg)
        if meta.get("fingerprint") != fingerprint:
            msg = (
                f"splice adapter {path} was trained for model {meta.get('fingerprint')}, not {fingerprint}; "
                "train one for this model with `pc-rag tune`"
            )
            raise AdapterError(msg)
        try:
            raw = json.loads(meta["config"])
            config = AdapterConfig(rank=int(raw["rank"]), alpha=float(raw["alpha"]), targets=tuple(raw["targets"]))
        except (KeyError, TypeError, ValueError) as e:
            msg = f"splice adapter {path} has a malformed configuration: {e}"
            raise AdapterError(msg) from e
        adapter = cls(model, config, fingerprint)
        pairs = (("a", adapter.lora_a), ("b", adapter.lora_b))
        expected = {f"{k}.{side}": p.shape for side, d in pairs for k, p in d.items()}
        got = {k: t.shape for k, t in tensors.items()}
        if got != expected:
            msg = f"splice adapter {path} does not fit this model ({len(got)} tensors, {len(expected)} expected)"
            raise AdapterError(msg)
        with torch.no_grad():
            for k, p in [*adapter.lora_a.items()]:
                p.copy_(tensors[f"{k}.a"])
            for k, p in [*adapter.lora_b.items()]:
                p.copy_(tensors[f"{k}.b"])
        return adapter.requires_grad_(False)

    @contextmanager
    def applied(self, skip_rows: int = 0) -> Iterator[None]:
        """Turn the pairs on for model calls made by this thread inside the block, except on the first
        ``skip_rows`` tokens of each call (recomputed chunk tokens that should run as the plain model)."""
        token = _APPLIED.set((self, skip_rows))
        try:
            yield
        finally:
            _APPLIED.reset(token)

    def _skipped_rows(self) -> int | None:
        """Rows left plain in the current call when this adapter is applied, else None (off, or another
        adapter of the same model is applied)."""
        state = _APPLIED.get()
        return state[1] if state is not None and state[0] is self else None


def _target_modules(model: PreTrainedModel, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """``{qualified name: linear}`` of every decoder layer's modules whose last name is in ``targets``."""
    found = {
        name: module
        for name, module in model.get_decoder().layers.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    missing = set(targets) - {name.rsplit(".", 1)[-1] for name in found}
    if missing:
        msg = f"the model's decoder layers have no linear layer named {sorted(missing)}"
        raise AdapterError(msg)
    return found


def _key(name: str) -> str:
    return name.replace(".", "_")  # ParameterDict keys cannot contain dots
