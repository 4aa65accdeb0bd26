"""How one request calls the model at query time: extra attention kwargs and a context around each call.

Serving a spliced prompt may change how the tokens computed at query time run: a splice
adapter is applied around each call (``SpliceAdapter.applied``), and attention
calibration travels as an attention kwarg. A ``ModelCall`` carries both so that the
prefill of the new tokens, every decode step and any teacher-forced scoring run alike.
The context wraps one call at a time, never a generator across its ``yield``. This
module knows nothing about adapters or calibration: it receives them as values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import transformers
from packaging.version import Version
from transformers import PreTrainedModel


def cache_keyword(version: str) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.24 (``past_key_values`` warns there and
    goes in 5.40), ``past_key_values`` before (a GPU image may ship an older transformers)."""
    return "cache" if Version(version).release >= (5, 24) else "past_key_values"


CACHE_KEYWORD = cache_keyword(transformers.__version__)


def with_cache(cache: object) -> dict[str, object]:
    """``model(..., **with_cache(cache))``: the cache under the installed transformers' name for it."""
    return {CACHE_KEYWORD: cache}


@dataclass(frozen=True)
class ModelCall:
    """``model(**inputs, **kwargs)`` inside ``context()``."""

    kwargs: Mapping[str, object] = field(default_factory=dict)
    context: Callable[[], AbstractContextManager[Any]] = nullcontext

    @property
    def is_plain(self) -> bool:
        """Whether this call is the model's own forward, untouched (no kwargs, no context)."""
        return not self.kwargs and self.context is nullcontext

    @property
    def context_key(self) -> Hashable:
        """Equal for calls whose contexts do the same thing: the context callable, or for a ``functools.partial``
        its function and arguments (each request builds its own partial of the same adapter's ``applied``).
        Calls without kwargs and with equal keys may run as one batched forward inside one context."""
        context = self.context
        if isinstance(context, partial):
            return (context.func, context.args, tuple(sorted(context.keywords.items())))
        return context

    def __call__(self, model: PreTrainedModel, **inputs: Any) -> Any:
        with self.context():
            return model(**inputs, **self.kwargs)


PLAIN = ModelCall()
