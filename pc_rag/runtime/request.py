"""One request type for every way of serving: Prompt Cache prompts, RAG answers and full-prefill baselines.

A request is the KV to splice (``Part``: a span, the shift of its keys, and the key under which other requests
may share it), the tokens to compute after it at their positions, how the model is called for them, an
optional recovery step that recomputes some spliced entries first (``Refresh``), and sampling settings.
``PromptCache``, ``RagEngine`` and the baselines build one; ``execute`` and the ``Scheduler`` run it. This
module knows nothing about PML, chunks or retrieval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pc_rag.kv import KVBuffer, SpanKV
from pc_rag.runtime.generate import SamplingParams, Stopwatch
from pc_rag.runtime.model_call import PLAIN, ModelCall
from pc_rag.runtime.shared_pool import SegmentKey


@dataclass(frozen=True)
class Part:
    """A span spliced into the cache: ``kv`` with its keys rotated by ``shift`` positions; ``share`` names it for
    other requests when its KV (after the shift) is the same for all of them, as a schema's module or a preamble."""

    kv: SpanKV
    shift: int = 0
    share: SegmentKey | None = None


class QueryCalls(Protocol):
    """How the tokens computed at query time call the model, given the spliced entries recomputed with them."""

    def first(self, recomputed: Sequence[int]) -> ModelCall:
        """The forward of the recomputed entries followed by the new tokens."""
        ...

    def later(self, recomputed: Sequence[int]) -> ModelCall:
        """Decode steps and teacher-forced scoring."""
        ...


class PlainCalls:
    """The model's own forward for every query-time token."""

    def first(self, recomputed: Sequence[int]) -> ModelCall:
        return PLAIN

    def later(self, recomputed: Sequence[int]) -> ModelCall:
        return PLAIN


@dataclass(frozen=True)
class Refresh:
    """Recovery: ``choose(buffer, length)`` picks the spliced cache entries to recompute (sorted indices) from the
    ``length`` entries spliced into ``buffer``; ``token_ids(indices)`` are their tokens, ``positions(indices)``
    their positions."""

    choose: Callable[[KVBuffer, int], list[int]]
    token_ids: Callable[[Sequence[int]], list[int]]
    positions: Callable[[Sequence[int]], list[int]]


@dataclass
class Request:
    """What serving one prompt takes; see the module docstring.

    ``next_position`` is the position of the first generated token. ``own_tokens`` counts tokens of ``parts``
    computed for this request alone (a preamble of its own), reported as computed rather than cached.
    ``reference_ids``: after the answer, score this continuation teacher-forced (fidelity metrics).
    ``watch`` starts when the request is built, so work done building it counts in its TTFT.
    ``context_ids``: the prompt's token ids in order (spliced parts and new tokens), where speculative decoding
    looks up its drafts; empty: drafts come from the answer alone.
    """

    parts: Sequence[Part]
    new_ids: Sequence[int]
    new_positions: Sequence[int]
    next_position: int
    params: SamplingParams
    refresh: Refresh | None = None
    calls: QueryCalls = field(default_factory=PlainCalls)
    own_tokens: int = 0
    reference_ids: Sequence[int] | None = None
    watch: Stopwatch = field(default_factory=Stopwatch)
    context_ids: Sequence[int] = ()

    @property
    def spliced(self) -> int:
        """Cache entries the parts fill."""
        return sum(part.kv.length for part in self.parts)
