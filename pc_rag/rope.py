"""RoPE facts about a model, and re-rotation of cached keys to new positions.

Keys are cached *after* RoPE at absolute positions. Because RoPE is a rotation
per frequency, ``R(a + d) = R(d) R(a)``: a key cached at position ``a`` moves to
``a + d`` by rotating it by ``d``. A constant attention scaling (YaRN) factors
out of that product, so it composes too; RoPE whose frequencies depend on the
sequence length (dynamic NTK, LongRoPE) does not, and is refused.

This module knows nothing about PML or caches: it maps a model to a ``RopeSpec``
and rotates tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from pc_rag.errors import UnsupportedModelError

# Architectures whose attention applies RoPE as `x*cos + rotate_half(x)*sin` to keys before caching.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
        "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "olmo2", "granite", "smollm3",
    }
)  # fmt: skip
_UNSUPPORTED_REASONS = {
    "gpt2": "learned absolute position embeddings: a cached module cannot be moved or shared",
    "opt": "learned absolute position embeddings: a cached module cannot be moved or shared",
    "gpt_bigcode": "learned absolute position embeddings: a cached module cannot be moved or shared",
    "bloom": "ALiBi biases are added inside attention, not stored in keys",
    "mpt": "ALiBi biases are added inside attention, not stored in keys",
    "falcon": "some Falcon variants use ALiBi or non-standard rotary layouts",
    "gptj": "interleaved (GPT-J style) rotary layout is not implemented",
}
_NON_COMPOSING_ROPE = {
    "dynamic": "dynamic NTK scaling changes frequencies with the sequence length",
    "longrope": "LongRoPE switches frequency tables with the sequence length",
}


@dataclass(frozen=True)
class RopeSpec:
    """Per-layer RoPE frequencies. ``inv_freq[layer_freq[i]]`` is layer i's table of ``rotary_dim // 2``."""

    inv_freq: tuple[torch.Tensor, ...]
    layer_freq: tuple[int, ...]
    head_dim: int
    # float64 copies of the tables per device, made once: a re-rotation on a GPU then copies nothing from the host
    _on_device: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def table(self, index: int, device: torch.device) -> torch.Tensor:
        """Frequency table ``index`` in float64 on ``device`` (copied there once)."""
        key = (index, str(device))
        found = self._on_device.get(key)
        if found is None:
            found = self._on_device[key] = self.inv_freq[index].to(device=device, dtype=torch.float64)
        return found

    @property
    def num_layers(self) -> int:
        return len(self.layer_freq)

    def rotate(self, keys: torch.Tensor, delta: int | torch.Tensor, layer: int) -> torch.Tensor:
        """Return ``keys`` ([..., S, D], post-RoPE) moved by ``delta`` positions (int or [S])."""
        return rotate_keys(keys, delta, self.table(self.layer_freq[layer], keys.device))

    def rotate_differentiable(self, keys: torch.Tensor, delta: int, layer: int) -> torch.Tensor:
        """``rotate`` by ``delta`` with gradients flowing back to ``keys``."""
        return rotate_keys_differentiable(keys, delta, self.inv_freq[self.layer_freq[layer]])

    def rotate_all(self, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Rotate stacked keys [L, ..., S, D] by ``delta``, layer by layer (frequencies may differ)."""
        if delta == 0 if isinstance(delta, int) else bool((delta == 0).all()):
            return keys
        out = torch.empty_like(keys)
        self.rotate_into(out, keys, delta)
        return out

    def rotate_into(self, out: torch.Tensor, keys: torch.Tensor, delta: int | torch.Tensor) -> None:
        """Write stacked keys [L, ..., S, D] rotated by ``delta`` into ``out`` (same shape, e.g. a view of a cache
        buffer), in one pass when every layer shares a frequency table."""
        if len(self.inv_freq) == 1:
            rotate_keys_into(out, keys, delta, self.table(0, keys.device))
            return
        for table_index in range(len(self.inv_freq)):
            idx = torch.tensor([i for i, t in enumerate(self.layer_freq) if t == table_index], device=keys.device)
            out[idx] = rotate_keys(keys[idx], delta, self.table(table_index, keys.device))


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [..., S, D] rotated by ``delta`` positions (int or [S]), as a new tensor (see
    ``rotate_keys_into``)."""
    out = torch.empty_like(keys)
    rotate_keys_into(out, keys, delta, inv_freq)
    return out


def rotate_keys_differentiable(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """``rotate_keys`` by out-of-place operations, so gradients flow back to ``keys`` (training the chunk side)."""
    half = inv_freq.shape[0]
    rotary_dim = 2 * half
    angles = float(delta) * inv_freq.to(device=keys.device, dtype=torch.float64)
    cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
    k1, k2, rest = keys[..., :half], keys[..., half:rotary_dim], keys[..., rotary_dim:]
    return torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin, rest), dim=-1)


def rotate_keys_into(out: torch.Tensor, keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Write post-RoPE keys [..., S, D] rotated by ``delta`` positions with frequencies ``inv_freq`` [R/2] into
    ``out`` (same shape, e.g. a cache buffer's slice; it must not overlap ``keys``), without temporaries the
    size of ``keys``. Only the first ``R = 2 * len(inv_freq)`` dims rotate (partial rotary); angles are
    computed in float64 so re-rotation adds no error beyond the cast back."""
    half = inv_freq.shape[0]
    rotary_dim = 2 * half
    table = inv_freq.to(device=keys.device, dtype=torch.float64)  # no copy for ``RopeSpec.table``'s
    if isinstance(delta, int):  # a host scalar: no host-to-device copy
        angles = (table * float(delta))[None]  # [1, R/2]
    else:
        angles = delta.to(device=keys.device, dtype=torch.float64).reshape(-1, 1) * table  # [S, R/2]
    cos, sin = angles.cos().to(keys.dtype), angles.sin().to(keys.dtype)
    k1, k2 = keys[..., :half], keys[..., half:rotary_dim]
    o1, o2 = out[..., :half], out[..., half:rotary_dim]
    torch.mul(k1, cos, out=o1)
    o1.addcmul_(k2, sin, value=-1)  # k1 cos - k2 sin
    torch.mul(k2, cos, out=o2)
    o2.addcmul_(k1, sin)  # k2 cos + k1 sin
    if rotary_dim < keys.shape[-1]:
        out[..., rotary_dim:] = keys[..., rotary_dim:]


def rope_spec_for(model: PreTrainedModel) -> RopeSpec:
    """Read the RoPE frequencies a model uses per layer; raise ``UnsupportedModelError`` if we cannot serve it."""
    config = model.config.get_text_config()
    model_type = config.model_type
    if model_type in _UNSUPPORTED_REASONS:
        msg = f"model type {model_type!r} is not supported: {_UNSUPPORTED_REASONS[model_type]}"
        raise UnsupportedModelError(msg)
    if model_type not in SUPPORTED_MODEL_TYPES:
        msg = (
            f"model type {model_type!r} is not supported: Prompt Cache needs RoPE applied to keys before "
            f"caching in the standard half-split layout; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
        raise UnsupportedModelError(msg)
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        msg = f"model type {model_type!r} has no shared rotary embedding module; cannot re-rotate keys"
        raise UnsupportedModelError(msg)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    rope_types = rotary.rope_type if isinstance(rotary.rope_type, dict) else None
    tables: list[torch.Tensor] = []
    table_of: dict[str, int] = {}
    for layer_type in dict.fromkeys(layer_types):
        kind = rope_types[layer_type] if rope_types else rotary.rope_type
        if kind in _NON_COMPOSING_ROPE:
            msg = f"RoPE type {kind!r} of {model_type!r} cannot re-rotate cached keys: {_NON_COMPOSING_ROPE[kind]}"
            raise UnsupportedModelError(msg)
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None) if rope_types else rotary.inv_freq
        assert inv_freq is not None, f"no inv_freq for layer type {layer_type}"
        table_of[layer_type] = len(tables)
        tables.append(inv_freq.detach().to("cpu", torch.float64).clone())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return RopeSpec(inv_freq=tuple(tables), layer_freq=tuple(table_of[t] for t in layer_types), head_dim=head_dim)
