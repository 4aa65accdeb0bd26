"""A splice adapter: low-rank corrections applied only to the tokens computed at query time.

Chunks encoded separately never attended to each other. A splice adapter is a set
of LoRA pairs ``(A, B)`` on chosen linear layers of every decoder layer (``q_proj``
and ``o_proj`` by default) that adds ``scale * B(A(x))`` to their output, trained
by self-distillation so that a question computed over spliced chunk KV behaves as
after a full prefill. It is attached to a model with forward hooks, or for serving a frozen
adapter with each pair folded once into a copy of its layer's weight, so an adapted call costs what
a plain one does (the model's own weights and parameter names are untouched either way). It acts
only inside ``applied()``:
full prefill never sees it. An adapter may also have an *encoding side* (``AdapterConfig.encoding``:
``"shared"``, the same pairs, or ``"separate"``, pairs of its own), acting inside ``encoding_applied()``
while chunks are encoded, as Block-Attention and KVLink train the model to write blocks a reader can
splice. Chunk KV made that way is only valid for this adapter: ``encoding_digest`` names it, and stores
and chunks record it. ``applied()`` and ``encoding_applied()`` set a context variable for the calling thread
only (and name the adapter, so two adapters hooked into one model never act together); wrap each model
call in one, never a generator's whole life (a context variable set across a ``yield`` leaks into whatever
the consumer runs next).

Weights are saved as safetensors with the configuration and the model fingerprint
in the metadata; loading under another fingerprint is refused. This module knows
nothing about chunks, prompts or training data.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from pc_rag.errors import PCRagError
from pc_rag.weights import QuantizedLinear, dense_linear

# (adapter, side, rows left unadapted at the start of each call's sequence) while ``applied()`` or
# ``encoding_applied()``
_APPLIED: contextvars.ContextVar[tuple[object, str, int] | None] = contextvars.ContextVar(
    "pc_rag_splice_adapter", default=None
)
FORMAT = "pc-rag-splice-adapter/1"
ENCODINGS = ("none", "shared", "separate")  # the encoding side: none, the query side's pairs, pairs of its own
QUERY, ENCODE = "query", "encode"


class AdapterError(PCRagError):
    """An adapter file that is unreadable, malformed or made for another model."""


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA ``rank`` and ``alpha`` (scale = alpha / rank) on the linear layers named ``targets`` of each layer;
    ``encoding`` says what acts while chunks are encoded (``ENCODINGS``)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "o_proj")
    encoding: str = "none"

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.targets:
            msg = f"an adapter needs rank >= 1 and at least one target, got {self}"
            raise AdapterError(msg)
        if self.encoding not in ENCODINGS:
            msg = f"unknown adapter encoding side {self.encoding!r}; known: {', '.join(ENCODINGS)}"
            raise AdapterError(msg)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class SpliceAdapter(nn.Module):
    """LoRA pairs for ``model``'s decoder layers; ``attach`` hooks them in, ``applied()`` turns on the query side
    and ``encoding_applied()`` the encoding side."""

    def __init__(self, model: PreTrainedModel, config: AdapterConfig, fingerprint: str) -> None:
        super().__init__()
        self.config, self.fingerprint = config, fingerprint
        self._targets = _target_modules(model, config.targets)
        ref = next(model.parameters())
        if any(isinstance(linear, QuantizedLinear) for linear in self._targets.values()):
            ref = ref.float()  # the pairs of a quantized model keep float32: the file's values, and its digest
        self.lora_a, self.lora_b = _lora_pairs(self._targets, config.rank, ref)
        if config.encoding == "separate":
            self.encode_a, self.encode_b = _lora_pairs(self._targets, config.rank, ref)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._merged: list[nn.Linear] = []

    @property
    def encodes(self) -> bool:
        """Whether chunks are encoded with this adapter (it has an encoding side)."""
        return self.config.encoding != "none"

    def _pairs(self, side: str) -> tuple[nn.ParameterDict, nn.ParameterDict]:
        if side == ENCODE and self.config.encoding == "separate":
            return self.encode_a, self.encode_b
        return self.lora_a, self.lora_b

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
        weights, pairs = {}, {}
        with torch.no_grad():
            for side in (QUERY, ENCODE) if self.encodes else (QUERY,):
                lora_a, lora_b = self._pairs(side)
                a, b = lora_a[key].detach().float(), lora_b[key].detach().float() * self.config.scale
                weights[side] = (linear.weight.float() + b @ a).to(linear.weight.dtype)
                pairs[side] = a, b
        plain = linear.forward

        def adapted(x: torch.Tensor, side: str) -> torch.Tensor:
            if isinstance(linear, QuantizedLinear) and linear.takes_kernel(x):
                from pc_rag.runtime.low_rank import LowRankTerm  # the store loads this module, never the runtime

                return LowRankTerm(*pairs[side])(plain(x), x)
            return dense_linear(x, weights[side], linear.bias)

        def forward(x: torch.Tensor) -> torch.Tensor:
            state = self._state()
            if state is None:
                return plain(x)
            side, skip = state
            if not skip:
                return adapted(x, side)
            return torch.cat((plain(x[:, :skip]), adapted(x[:, skip:], side)), dim=1)

        def kernel_correction() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
            state = self._state()
            if state is None or state[1] or not isinstance(linear, QuantizedLinear):
                return None  # off, or plain rows lead the call: only the module can split them
            from pc_rag.runtime.low_rank import LowRankTerm

            return LowRankTerm(*pairs[state[0]])

        # decode_step.kernel_corrections: whether this forward acts now, and what it adds to a kernel's rows
        forward.acts = lambda: self._state() is not None  # type: ignore[attr-defined]
        forward.kernel_correction = kernel_correction  # type: ignore[attr-defined]
        linear.forward = forward
        self._merged.append(linear)

    def _hook(self, key: str):
        scale = self.config.scale
        sides = {side: (pairs[0][key], pairs[1][key]) for side in (QUERY, ENCODE) for pairs in [self._pairs(side)]}

        def add_low_rank(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            state = self._state()
            if state is None:
                return output
            side, skip = state
            a, b = sides[side]
            x = inputs[0][:, skip:]  # [B, Q - skip, in]
            delta = (x @ a.to(x.dtype).T) @ (b.to(x.dtype).T * scale)
            return output + delta if not skip else torch.cat((output[:, :skip], output[:, skip:] + delta), dim=1)

        return add_low_rank

    @property
    def digest(self) -> str:
        """A short sha256 of the model fingerprint, configuration and weights: which adapter answers assume."""
        config = asdict(self.config)
        if not self.encodes:  # as before the encoding side existed: a query-only adapter keeps its digest
            del config["encoding"]
        return _digest(f"{FORMAT}|{self.fingerprint}|{config}", self.state_dict())

    @property
    def encoding_digest(self) -> str:
        """A short sha256 of what acts on chunks while they are encoded (model, rank, targets and the encoding
        side's pairs): the KV they get is valid for exactly this. Empty without an encoding side."""
        if not self.encodes:
            return ""
        lora_a, lora_b = self._pairs(ENCODE)
        pairs = {f"{k}.a": p for k, p in lora_a.items()} | {f"{k}.b": p for k, p in lora_b.items()}
        c = self.config
        return _digest(f"{FORMAT}|encode|{self.fingerprint}|{c.rank}|{c.alpha}|{sorted(c.targets)}", pairs)

    def save(self, path: str | Path) -> None:
        """Write the pairs and their configuration as safetensors (float32)."""
        tensors = {f"{k}.{suffix}": p.detach().float().cpu().contiguous() for suffix, k, p in self._named_pairs()}
        config = asdict(self.config) | {"targets": list(self.config.targets)}
        meta = {"format": FORMAT, "config": json.dumps(config), "fingerprint": self.fingerprint}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, model: PreTrainedModel, fingerprint: str | Sequence[str]) -> SpliceAdapter:
        """Read an adapter saved by ``save`` for a model with ``fingerprint`` (or one of several: a quantized
        model also takes its float32 weights' adapter, ``LoadedModel.fitted_fingerprints``); ``AdapterError``
        otherwise. The adapter keeps the fingerprint it was fitted for."""
        accepted = (fingerprint,) if isinstance(fingerprint, str) else tuple(fingerprint)
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
        if meta.get("fingerprint") not in accepted:
            msg = (
                f"splice adapter {path} was trained for model {meta.get('fingerprint')}, not "
                f"{' or '.join(accepted)}; train one for this model with `pc-rag tune`"
            )
            raise AdapterError(msg)
        try:
            raw = json.loads(meta["config"])
            config = AdapterConfig(
                rank=int(raw["rank"]), alpha=float(raw["alpha"]), targets=tuple(raw["targets"]),
                encoding=str(raw.get("encoding", "none")),  # files written before the encoding side have none
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            msg = f"splice adapter {path} has a malformed configuration: {e}"
            raise AdapterError(msg) from e
        adapter = cls(model, config, str(meta["fingerprint"]))
        named = {f"{k}.{suffix}": p for suffix, k, p in adapter._named_pairs()}
        got = {k: t.shape for k, t in tensors.items()}
        if got != {k: p.shape for k, p in named.items()}:
            msg = f"splice adapter {path} does not fit this model ({len(got)} tensors, {len(named)} expected)"
            raise AdapterError(msg)
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(tensors[k])
        return adapter.requires_grad_(False)

    def _named_pairs(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(file suffix, key, parameter) of every pair: ``a``/``b`` on the query side, ``encode_a``/``encode_b``
        on a separate encoding side."""
        groups = [("a", self.lora_a), ("b", self.lora_b)]
        if self.config.encoding == "separate":
            groups += [("encode_a", self.encode_a), ("encode_b", self.encode_b)]
        for suffix, group in groups:
            for key, p in group.items():
                yield suffix, key, p

    @contextmanager
    def applied(self, skip_rows: int = 0) -> Iterator[None]:
        """Turn the query side on for model calls made by this thread inside the block, except on the first
        ``skip_rows`` tokens of each call (recomputed chunk tokens that should run as the plain model)."""
        token = _APPLIED.set((self, QUERY, skip_rows))
        try:
            yield
        finally:
            _APPLIED.reset(token)

    @contextmanager
    def encoding_applied(self) -> Iterator[None]:
        """Turn the encoding side on for model calls made by this thread inside the block (chunk encoding)."""
        if not self.encodes:
            msg = "this splice adapter has no encoding side (AdapterConfig.encoding is 'none')"
            raise AdapterError(msg)
        token = _APPLIED.set((self, ENCODE, 0))
        try:
            yield
        finally:
            _APPLIED.reset(token)

    def _state(self) -> tuple[str, int] | None:
        """(side, rows left plain) in the current call when this adapter is applied, else None (off, or another
        adapter of the same model is applied)."""
        state = _APPLIED.get()
        return state[1:] if state is not None and state[0] is self else None


def _lora_pairs(
    targets: dict[str, nn.Linear], rank: int, ref: torch.Tensor
) -> tuple[nn.ParameterDict, nn.ParameterDict]:
    """LoRA's ``A`` (random) and ``B`` (zero: the start is the identity) for each target linear layer."""
    lora_a, lora_b = nn.ParameterDict(), nn.ParameterDict()
    for name, linear in targets.items():
        a = torch.empty(rank, linear.in_features, dtype=ref.dtype, device=ref.device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        lora_a[_key(name)] = nn.Parameter(a)
        lora_b[_key(name)] = nn.Parameter(torch.zeros(linear.out_features, rank, dtype=ref.dtype, device=ref.device))
    return lora_a, lora_b


def _digest(header: str, tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(header.encode())
    for name, tensor in sorted(tensors.items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _target_modules(model: PreTrainedModel, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """``{qualified name: linear}`` of every decoder layer's modules whose last name is in ``targets`` (dense or
    weight-only quantized: both hold the layer's ``weight``)."""
    found = {
        name: module
        for name, module in model.get_decoder().layers.named_modules()
        if isinstance(module, nn.Linear | QuantizedLinear) and name.rsplit(".", 1)[-1] in targets
    }
    missing = set(targets) - {name.rsplit(".", 1)[-1] for name in found}
    if missing:
        msg = f"the model's decoder layers have no linear layer named {sorted(missing)}"
        raise AdapterError(msg)
    return found


def _key(name: str) -> str:
    return name.replace(".", "_")  # ParameterDict keys cannot contain dots
