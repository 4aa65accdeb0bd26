"""Attention for cached serving: causal attention over a cache, never a [queries, keys] mask.

Every query's own key sits at a known cache index: new tokens follow the cache
(the mask is causal, aligned bottom-right; ``_mask`` returns None instead of
building it), or stale entries refreshed in place come first, at scattered
ascending indices (``QueryBlocks``, passed as the attention kwarg
``query_blocks``). The query at index ``c`` sees keys ``<= c`` (and ``> c - window``
in a sliding-window layer). Queries are cut into blocks: a block sees every key
before its smallest index unmasked and only the band up to its largest index is
masked ([rows, band] per block, made once per forward and window); the two parts
are merged by log-sum-exp. Query heads sharing a KV head are folded into the
query axis ([B, H, Q, D] -> [B, H_kv, n_rep*Q, D]) so the cache is never repeated
per head. The fused kernel is CPU's; other devices get one dense mask per forward
and plain SDPA. Explicit masks (reference tests, padding, sliding windows outside
a refresh) and full prefills take transformers' SDPA. This module knows nothing
about PML or caches beyond the tensors and indices it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from pc_rag.calibration import KWARG as SEGMENTS
from pc_rag.calibration import Segments, calibrated_attention, trailing_rows_mask
from pc_rag.probe import KWARG as PROBE
from pc_rag.probe import QUERIES_KWARG as QUERIES_PROBE
from pc_rag.probe import VALUES_KWARG as VALUES_PROBE

ATTENTION = "pc_rag_sdpa"

FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class _Piece:
    """Keys ``start:end`` of one block, with an additive mask [n_rep*rows, end-start] or None (all visible)."""

    start: int
    end: int
    mask: torch.Tensor | None


@dataclass(eq=False)
class QueryBlocks:
    """Queries by the cache index of their own key (strictly ascending), cut into blocks of consecutive queries.

    Built once per forward and passed to every layer (``model(..., query_blocks=...)``);
    the masks of the bands are made on first use per (window, query heads per KV head, dtype).
    """

    index: torch.Tensor  # [Q] long, ascending: where query i's key lives
    bounds: tuple[tuple[int, int, int, int], ...]  # per block: first query, end query, smallest and largest index
    _pieces: dict[tuple[int | None, int, torch.dtype], list[tuple[_Piece, ...]]] = field(default_factory=dict)
    _dense: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, index: torch.Tensor, size: int | None = None) -> QueryBlocks:
        """Blocks of ``size`` queries; by default 64 below 2K queries, 128 below 4K, then 256.

        Bands cost about ``size`` x (cache length) per layer in all (against ~queries x length / 2 for
        the rest); larger blocks run the CPU kernel in larger tiles (1-thread timings, SmolLM2 shapes).
        """
        size = size or 64 << min(2, len(index) // 2048)
        at = index.tolist()
        assert all(a < b for a, b in pairwise(at)), "query cache indices must be strictly ascending"
        starts = range(0, len(at), size)
        return cls(index, tuple((a, min(a + size, len(at)), at[a], at[min(a + size, len(at)) - 1]) for a in starts))

    @classmethod
    def after(cls, cached: int, new: int, device: torch.device) -> QueryBlocks:
        """``new`` tokens appended after ``cached`` entries (a bottom-right causal mask)."""
        return cls.of(torch.arange(cached, cached + new, device=device))

    def pieces(self, window: int | None, n_rep: int, dtype: torch.dtype) -> list[tuple[_Piece, ...]]:
        """Per block: an unmasked piece before its smallest index, then its masked band."""
        key = (window, n_rep, dtype)
        if key not in self._pieces:
            tiles: dict[int, torch.Tensor] = {}  # contiguous blocks share one causal tile per size
            self._pieces[key] = [self._block(a, b, lo, hi, window, n_rep, dtype, tiles) for a, b, lo, hi in self.bounds]
        return self._pieces[key]

    def _block(
        self,
        a: int,
        b: int,
        lo: int,
        hi: int,
        window: int | None,
        n_rep: int,
        dtype: torch.dtype,
        tiles: dict[int, torch.Tensor],
    ) -> tuple[_Piece, ...]:
        if window is not None and hi >= window:  # the window cuts: one masked piece, both bounds
            start = max(0, lo - window + 1)
            return (_Piece(start, hi + 1, self._band(a, b, start, hi + 1, window, n_rep, dtype)),)
        if hi - lo == b - a - 1:  # contiguous: the band is causal
            band = tiles.get(b - a)
            if band is None:
                band = tiles[b - a] = self._band(a, b, lo, hi + 1, None, n_rep, dtype)
        else:
            band = self._band(a, b, lo, hi + 1, None, n_rep, dtype)
        head = (_Piece(0, lo, None),) if lo > 0 else ()
        return (*head, _Piece(lo, hi + 1, band))

    def _band(
        self, a: int, b: int, start: int, end: int, window: int | None, n_rep: int, dtype: torch.dtype
    ) -> torch.Tensor:
        allowed = _allowed(self.index[a:b], start, end, window)  # [rows, band]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return mask.repeat(n_rep, 1)  # [n_rep*rows, band]: packed row r*rows + i is query i

    def dense(self, keys: int, window: int | None) -> torch.Tensor:
        """The equivalent bool mask [1, 1, Q, keys] (for devices without the fused CPU kernel)."""
        if (keys, window) not in self._dense:
            self._dense[keys, window] = _allowed(self.index, 0, keys, window)[None, None]
        return self._dense[keys, window]


def _allowed(index: torch.Tensor, start: int, end: int, window: int | None) -> torch.Tensor:
    """Bool [len(index), end-start]: which keys ``start:end`` the queries whose own keys are at ``index`` see."""
    query = index[:, None]
    key = torch.arange(start, end, device=index.device)
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    return allowed


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, S], bool (True = attend) or additive float; None = causal
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Blocked attention for ``query_blocks`` (which replace any mask) or a causal run after a cache;
    otherwise SDPA with the given mask, the query-head groups folded into the query axis."""
    probe, segments = kwargs.pop(PROBE, None), kwargs.pop(SEGMENTS, None)
    if probe is not None:  # query-aware selection scores the cache (and may stop the forward here)
        probe.add(module.layer_idx, query, key, _scaling(module, scaling), kwargs.get("sliding_window"))
    value_probe = kwargs.pop(VALUES_PROBE, None)
    if value_probe is not None:  # the deviation probe reads fresh values (and stops the forward at its layer)
        value_probe.capture(module.layer_idx, value)
    query_probe = kwargs.pop(QUERIES_PROBE, None)
    if query_probe is not None:  # the codec's key metric reads the queries (after RoPE)
        query_probe.capture(module.layer_idx, query, key)
    if segments is not None or (torch.is_grad_enabled() and query.requires_grad):
        return _query_time(module, query, key, value, attention_mask, scaling, segments, **kwargs), None
    blocks = kwargs.pop("query_blocks", None)
    q_len, k_len = query.shape[2], key.shape[2]
    window: int | None = kwargs.get("sliding_window")  # type: ignore[assignment]
    if blocks is None and attention_mask is None and 1 < q_len < k_len:
        if window is None and FLASH_CPU is not None and query.device.type == "cpu" and not kwargs.get("softcap"):
            return attend_after_cache(query, key, value, scaling), None
        blocks = QueryBlocks.after(k_len - q_len, q_len, query.device)
    if isinstance(blocks, QueryBlocks):
        assert not dropout and not kwargs.get("softcap"), "serving attention has no dropout or softcap"
        if FLASH_CPU is None or query.device.type != "cpu":
            mask = blocks.dense(k_len, window)
            return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
        return _blocked(query, key, value, blocks, window, scaling), None
    batch, heads, _, dim = query.shape
    n_rep = heads // key.shape[1]
    if n_rep == 1 or q_len == k_len or attention_mask is None or kwargs.get("softcap") or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q = query.reshape(batch, key.shape[1], n_rep * q_len, dim)  # head h = g * n_rep + r shares KV head g
    mask = attention_mask[:, :, None].expand(-1, -1, n_rep, -1, -1).reshape(batch, 1, n_rep * q_len, -1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def _blocked(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,
    blocks: QueryBlocks,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:  # [B, Q, H, D]
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, n_rep, q_len, dim)
    out = query.new_empty(batch, q_len, kv_heads, n_rep, dim)
    for (a, b, _, _), pieces in zip(blocks.bounds, blocks.pieces(window, n_rep, query.dtype), strict=True):
        q = grouped[:, :, :, a:b].reshape(batch, kv_heads, n_rep * (b - a), dim)
        parts = [
            FLASH_CPU(q, key[:, :, p.start : p.end], value[:, :, p.start : p.end], attn_mask=p.mask, scale=scaling)
            for p in pieces
        ]
        target = out[:, a:b].movedim(1, 3)  # [B, H_kv, n_rep, rows, D], a view of the output
        if len(parts) == 1:
            target.copy_(parts[0][0].view(target.shape))
        else:  # one softmax over both key sets: part b's output moved toward part a's by a's share of the mass
            (out_a, lse_a), (out_b, lse_b) = parts
            share_a = torch.sigmoid(lse_a - lse_b).to(out_a.dtype).view(*target.shape[:-1], 1)
            torch.lerp(out_b.view(target.shape), out_a.view(target.shape), share_a, out=target)
    return out.view(batch, q_len, heads, dim)


def attend_after_cache(
    query: torch.Tensor,  # [B, H, Q, D]: the last Q keys' own queries
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:  # [B, Q, H, D]
    """New tokens after a cache: every query sees the whole cache (one unmasked pass, heads folded) and the
    new keys causally (the causal kernel of a full prefill), merged by log-sum-exp. No mask is built."""
    batch, heads, q_len, dim = query.shape
    kv_heads, cached = key.shape[1], key.shape[2] - q_len
    n_rep = heads // kv_heads
    folded = query.reshape(batch, kv_heads, n_rep * q_len, dim)
    out_a, lse_a = FLASH_CPU(folded, key[:, :, :cached], value[:, :, :cached], scale=scaling)
    new_k, new_v = key[:, :, cached:], value[:, :, cached:]
    if n_rep > 1:  # the causal kernel has no grouped heads: repeat the new keys only (O(Q), not O(Q^2))
        new_k, new_v = new_k.repeat_interleave(n_rep, dim=1), new_v.repeat_interleave(n_rep, dim=1)
    out_b, lse_b = FLASH_CPU(query, new_k, new_v, is_causal=True, scale=scaling)
    share_a = torch.sigmoid(lse_a.reshape(batch, heads, q_len) - lse_b).to(out_b.dtype).unsqueeze(-1)
    out = torch.lerp(out_b, out_a.reshape(batch, heads, q_len, dim), share_a)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous()


def _mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: object = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: object,
) -> torch.Tensor | None:
    """transformers' SDPA mask, except a plain causal one without padding, which is not built: None
    (``packed_gqa_attention`` reads None as causal with the queries at the end of the keys)."""
    plain = allow_is_causal_skip and mask_function is causal_mask_function and local_size is None
    if (
        plain
        and isinstance(q_offset, int)
        and q_offset + q_length == kv_offset + kv_length
        and (attention_mask is None or bool(attention_mask.all()))
    ):
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


AttentionInterface.register(ATTENTION, packed_gqa_attention)
AttentionMaskInterface.register(ATTENTION, _mask)


def _scaling(module: torch.nn.Module, scaling: float | None) -> float:
    return scaling if scaling is not None else module.head_dim**-0.5


def _query_time(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    segments: Segments | None,
    **kwargs: object,
) -> torch.Tensor:  # [B, Q, H, D]
    """Query-time rows with APE calibration (``segments``) or with gradients (training a splice adapter).

    Recomputed rows (the first ``segments.exact_rows``) attend exactly through the serving path; the
    rows after them are the last keys' own queries (question, decode steps) and attend causally, with
    stale chunk keys calibrated. With gradients every row is such a row (training recomputes nothing),
    computed by differentiable tensor ops: the fused kernel's log-sum-exp has no gradient.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    exact = segments.exact_rows if segments is not None else 0
    window = kwargs.get("sliding_window")
    allowed = trailing_rows_mask(q_len - exact, k_len, key.device, window)  # type: ignore[arg-type]
    if segments is None:
        mask = allowed.expand(query.shape[0], -1, -1, -1)
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]
    t, s = segments.calibration.at(module.layer_idx)
    stale = segments.stale_mask(k_len, key.device)
    rows = calibrated_attention(query[:, :, exact:], key, value, allowed, stale, _scaling(module, scaling), t, s)
    if not exact:
        return rows
    out, _ = packed_gqa_attention(module, query, key, value, attention_mask, 0.0, scaling, **kwargs)
    out[:, exact:] = rows
    return out
