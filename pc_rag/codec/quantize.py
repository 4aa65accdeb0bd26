"""Transform quantization of one chunk's KV (CacheGen sections 5.1-5.2, adapted to what this model's KV shows).

Each head's vectors are centred and turned into their principal axes (``Transform``, fitted per (keys|values,
layer, head) on a sample; if the tables were fitted in a metric of what an error costs the model, the axes are
those of the whitened vectors and ``synthesis`` inverts them), then quantized with one uniform step per head:
``step`` times the head's RMS times its layer's ``allocation`` for keys or values (CacheGen's layer-wise
quantization, with the weights chosen by what the model's answers are sensitive to). Within a head, in the
transform domain, a uniform step is the MSE-optimal allocation (components with little variance cost almost
nothing). Each chunk's first token (a sink of attention for the chunk's own tokens) is kept exactly ("raw").
A symbol beyond ``[-limit, limit]`` is coded clamped and its remainder kept as an ``Escapes`` entry (a token
needing more than ``ESCAPE_LIMIT`` is kept exactly). A layer may be ``anchored``: the other tokens form groups
of ``GROUP_TOKENS`` and each but the group's first (its anchor) codes its difference from the reconstructed
anchor (CacheGen's token-wise locality; fitting turns it on only where that leaves less variance)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_TOKENS = 10
ESCAPE_LIMIT = 32767  # the largest remainder an escape holds (int16)


@dataclass
class Transform:
    """Per keys/values, layer and head: ``mean`` [2, L, H, D], analysis ``basis`` [2, L, H, D, D] (columns: the
    coefficients are ``(x - mean) @ basis``), ``rms`` [2, L, H] of the coefficients; ``anchored`` [2, L] bool;
    ``allocation`` [2, L], each layer's keys' and values' step in units of the level's (None: 1 everywhere);
    ``synthesis`` [2, L, H, D, D], the inverse of ``basis`` (None: ``basis`` is orthonormal, its transpose)."""

    mean: torch.Tensor
    basis: torch.Tensor
    rms: torch.Tensor
    anchored: torch.Tensor
    allocation: torch.Tensor | None = None
    synthesis: torch.Tensor | None = None

    @property
    def inverse_basis(self) -> torch.Tensor:
        """[2, L, H, D, D]: ``x = mean + c @ inverse_basis``."""
        return self.basis.transpose(-1, -2) if self.synthesis is None else self.synthesis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Coefficients [2, L, H, S, D] of KV ``x`` [2, L, H, S, D]."""
        return torch.matmul(x - self.mean[:, :, :, None], self.basis)

    def inverse(self, c: torch.Tensor) -> torch.Tensor:
        return torch.matmul(c, self.inverse_basis).add_(self.mean[:, :, :, None])

    def steps(self, step: float) -> torch.Tensor:
        """Per-head quantization steps [2, L, H, 1, 1]."""
        steps = step * self.rms if self.allocation is None else step * self.rms * self.allocation[..., None]
        return steps[..., None, None]


@dataclass
class Escapes:
    """Symbols beyond the coded range: at flat index ``lane * coded_tokens + token`` (lanes as the entropy coder
    orders them: keys|values, layer, head, component), the ``remainder`` beyond the clamped symbol."""

    index: torch.Tensor  # int64
    remainder: torch.Tensor  # int16

    def add_to(self, lanes: torch.Tensor, columns: torch.Tensor, scale: torch.Tensor) -> None:
        """Add each remainder times its lane's ``scale`` [lanes] to ``lanes`` [lanes, S] (in place), at the token
        ``columns`` [coded tokens] of the coded tokens."""
        if self.index.numel():
            lane, token = self.index // columns.numel(), self.index % columns.numel()
            lanes.index_put_((lane, columns[token]), self.remainder.float() * scale[lane], accumulate=True)


@dataclass
class Quantized:
    """``symbols`` [2, L, H, S_coded, D] int8 of the coded tokens, clamped to the level's range, with their
    ``escapes``; ``raw``: indices of the exact tokens."""

    symbols: torch.Tensor
    raw: torch.Tensor
    escapes: Escapes


def quantize(x: torch.Tensor, transform: Transform, step: float, limit: int) -> Quantized:
    """Quantize KV ``x`` [2, L, H, S, D] (float32) with ``step`` x each head's RMS."""
    length = x.shape[3]
    c = transform.forward(x)
    steps = transform.steps(step)
    anchors = c[:, :, :, 1::GROUP_TOKENS]
    anchor_symbols = torch.round(anchors / steps)
    raw = torch.zeros(length, dtype=torch.bool)
    raw[0] = True
    raw[1::GROUP_TOKENS] |= _outside(anchor_symbols, limit + ESCAPE_LIMIT)
    anchor_hat = torch.where(raw[1::GROUP_TOKENS, None], anchors, anchor_symbols * steps)
    symbols = torch.round((c - _prediction(anchor_hat, transform.anchored, length)) / steps)
    raw |= _outside(symbols, limit + ESCAPE_LIMIT)
    coded = symbols[:, :, :, ~raw]
    clamped = coded.clamp(-limit, limit)
    rest = (coded - clamped).transpose(3, 4).flatten()  # lane-major, as the entropy coder reads the symbols
    index = rest.nonzero().flatten()
    escapes = Escapes(index, rest[index].to(torch.int16))
    return Quantized(clamped.to(torch.int8), raw.nonzero().flatten(), escapes)


def dequantize(q: Quantized, transform: Transform, step: float, raw_values: torch.Tensor) -> torch.Tensor:
    """The reconstruction [2, L, H, S, D] float32 of ``q``; ``raw_values`` [2, L, H, n_raw, D] the exact tokens."""
    kinds, layers, heads, coded, dim = q.symbols.shape
    length = coded + q.raw.numel()
    c = torch.empty(kinds, layers, heads, dim, length)
    steps = transform.steps(step)
    columns = coded_columns(q.raw, length)
    c[..., columns] = (q.symbols.float() * steps).transpose(3, 4)
    q.escapes.add_to(c.view(-1, length), columns, steps.expand(kinds, layers, heads, 1, dim).flatten())
    return reconstruct(c, q.raw, transform, raw_values)


def coded_columns(raw: torch.Tensor, length: int) -> torch.Tensor:
    """The indices of the tokens that are coded, not kept exactly (``raw``), in order."""
    is_raw = torch.zeros(length, dtype=torch.bool)
    is_raw[raw] = True
    return (~is_raw).nonzero().flatten()


def reconstruct(c: torch.Tensor, raw: torch.Tensor, transform: Transform, raw_values: torch.Tensor) -> torch.Tensor:
    """KV [2, L, H, S, D] float32 from coefficients ``c`` [2, L, H, D, S] (dequantized at the coded tokens; the
    columns of ``raw`` are filled here, and ``c`` is changed in place) and the exact tokens ``raw_values``."""
    kinds, layers, heads, dim, length = c.shape
    raw_values = raw_values.float()
    if raw.numel():
        c[..., raw] = transform.forward(raw_values).transpose(3, 4)
    if bool(transform.anchored.any()):
        follows = torch.ones(length, dtype=torch.bool)
        follows[0] = False
        follows[1::GROUP_TOKENS] = False
        follows[raw] = False
        anchors = c[..., 1::GROUP_TOKENS].transpose(3, 4)
        c[..., follows] += _prediction(anchors, transform.anchored, length).transpose(3, 4)[..., follows]
    batch = kinds * layers * heads
    out = torch.baddbmm(
        transform.mean.reshape(batch, 1, dim),
        c.reshape(batch, dim, length).transpose(1, 2),
        transform.inverse_basis.reshape(batch, dim, dim),
    ).view(kinds, layers, heads, length, dim)
    out[:, :, :, raw] = raw_values  # as given, not through the transform's rounding
    return out


def _prediction(anchor_hat: torch.Tensor, anchored: torch.Tensor, length: int) -> torch.Tensor:
    """What each token's coefficients are coded against [2, L, H, S, D]: in anchored layers its group's
    reconstructed anchor ``anchor_hat`` [2, L, H, groups, D] (not for the anchor itself, nor for token 0,
    which is kept exactly and in no group), zero elsewhere."""
    pred = torch.zeros(*anchor_hat.shape[:3], length, anchor_hat.shape[4])
    pred[:, :, :, 1:] = anchor_hat.repeat_interleave(GROUP_TOKENS, dim=3)[:, :, :, : length - 1]
    pred[:, :, :, 1::GROUP_TOKENS] = 0
    return pred * anchored[:, :, None, None, None]


def _outside(symbols: torch.Tensor, limit: int) -> torch.Tensor:
    """Per token: whether any of its symbols [2, L, H, S, D] falls outside ``[-limit, limit]``."""
    return symbols.abs().amax(dim=(0, 1, 2, 4)) > limit
