"""One entry point both framework adapters call: serve a prompt string by the cheapest correct path.

A PML ``<prompt …>`` goes to the Prompt Cache engine (its schema's modules are
reused) when the caller gave one, asking for PML; otherwise it is plain text.
Text with signed module references goes to the document store, which splices
the referenced chunks; any other text is served by full prefill through the
model's chat template, so the adapters are always correct LLMs. This module
knows nothing about LangChain or LlamaIndex.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pc_rag.baseline import full_request
from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.generate import ReplyStream, SamplingParams
from pc_rag.model import LoadedModel
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.markers import split_module_prompt
from pc_rag.rag.prompt import RagPrompt
from pc_rag.serving.request import Request
from pc_rag.serving.scheduler import Scheduler
from pc_rag.store.document_store import DocumentStore

# what a framework user may set; keep_logits is a measurement switch of the eval, not a generation setting
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) - {"keep_logits"}


@dataclass
class PromptServer:
    """Serve prompt strings from ``store`` (module references), ``prompt_cache`` (PML) or full prefill.

    Only a server given a ``prompt_cache`` parses PML: for a store's server, user text that starts with
    ``<prompt`` is a plain question.
    """

    store: DocumentStore | None = None
    prompt_cache: PromptCache | None = None
    mode: str | None = None  # recovery mode for module prompts; None: the store's default
    scheduler: Scheduler | None = None  # when set, requests are batched through it; else each is served alone

    def __post_init__(self) -> None:
        if self.store is None and self.prompt_cache is None:
            msg = "PromptServer needs a DocumentStore, a PromptCache, or both"
            raise PCRagError(msg)
        if (
            self.store is not None
            and self.prompt_cache is not None
            and self.store.engine.lm is not self.prompt_cache.lm
        ):
            msg = "the DocumentStore and the PromptCache of a PromptServer must share one loaded model"
            raise PCRagError(msg)
        if self.scheduler is not None and self.scheduler.lm is not self.lm:
            msg = "the scheduler of a PromptServer must run the model its store or PromptCache uses"
            raise PCRagError(msg)

    @property
    def engine(self) -> RagEngine | None:
        return self.store.engine if self.store is not None else None

    @property
    def lm(self) -> LoadedModel:
        return self.store.engine.lm if self.store is not None else self.prompt_cache.lm  # type: ignore[union-attr]

    @property
    def model_name(self) -> str:
        return self.lm.name

    def stream(self, prompt: str, **sampling: object) -> ReplyStream:
        """Text deltas of the reply to ``prompt``; ``sampling`` are ``SamplingParams`` fields."""
        return self._serve(lambda: self.request(prompt, **sampling))

    def request(self, prompt: str, **sampling: object) -> Request:
        """``prompt`` as a serving ``Request`` (see ``stream``)."""
        _check_settings(sampling)
        if self.prompt_cache is not None and prompt.lstrip().startswith("<prompt"):
            return self.prompt_cache.request(prompt, **sampling)
        if self.store is not None:
            before, chunks, after = self.store.prompt_chunks(prompt)
            return self.store.engine.request_around(before, chunks, after, self.mode or self.store.mode, **sampling)
        return self._turns_request(self.system, [("user", prompt)], sampling)

    @property
    def system(self) -> str:
        """The system turn put before a user-turn prompt (explicit: chat templates insert a default one otherwise)."""
        return self.engine.prompt.system if self.engine is not None else RagPrompt().system

    def stream_chat(
        self, turns: Sequence[tuple[str, str]], system: str | None = None, **sampling: object
    ) -> ReplyStream:
        """Reply to a conversation of ``(role, content)`` turns (user/assistant) after ``system`` (default: ours).

        A lone user turn under the default system prompt is served like ``stream`` (module references
        included); any other conversation is rendered with the chat template and served by full prefill.
        """
        return self._serve(lambda: self.request_chat(turns, system, **sampling))

    def request_chat(self, turns: Sequence[tuple[str, str]], system: str | None = None, **sampling: object) -> Request:
        """The conversation as a serving ``Request`` (see ``stream_chat``)."""
        unknown_roles = sorted({role for role, _ in turns} - {"user", "assistant"})
        if unknown_roles:
            msg = f"chat roles {unknown_roles} are not supported; use system, user and assistant turns"
            raise PCRagError(msg)
        system = self.system if system is None else system
        if len(turns) == 1 and turns[0][0] == "user" and system == self.system:
            return self.request(turns[0][1], **sampling)
        if any(split_module_prompt(content).refs for _, content in turns):
            msg = (
                "module references are served in a single user turn under the default system prompt; "
                "this conversation has other turns or another system prompt"
            )
            raise PCRagError(msg)
        _check_settings(sampling)
        return self._turns_request(system, list(turns), sampling)

    def _turns_request(self, system: str, turns: list[tuple[str, str]], sampling: dict[str, object]) -> Request:
        """Full prefill of the conversation rendered through the model's chat template, then decoding."""
        backend = self.engine if self.engine is not None else self.prompt_cache
        assert backend is not None
        w = backend.wrappers
        text = w.wrap("system", system) + "".join(w.wrap(role, c) for role, c in turns) + w.generation_prompt  # type: ignore[arg-type]
        return full_request(backend.tokenize(text), SamplingParams(**sampling))  # type: ignore[arg-type]

    def _serve(self, build: Callable[[], Request]) -> ReplyStream:
        """Build the request and serve it: batched by the scheduler (built on its thread, where all model work
        runs, see ``Scheduler.call``) or alone."""
        if self.scheduler is not None:
            return self.scheduler.stream(self.scheduler.call(build))
        backend = self.engine if self.engine is not None else self.prompt_cache
        assert backend is not None
        return backend.serve(build())


def _check_settings(sampling: dict[str, object]) -> None:
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        msg = f"unknown generation settings {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}"
        raise PCRagError(msg)
