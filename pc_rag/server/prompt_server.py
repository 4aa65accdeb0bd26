"""Answer from a document store or a Prompt Cache: the one entry point the CLI, the HTTP server and both
framework adapters call.

A question is answered from the store's retrieved modules (``answer``; ``answer_full`` is the same retrieval
by full prefill). A prompt string is served by the cheapest correct path: a PML ``<prompt …>`` goes to the
Prompt Cache engine (its schema's modules are reused) when the caller gave one; text with signed module
references splices the referenced chunks from the store; any other text is served by full prefill through
the model's chat template, so the adapters are always correct LLMs. A text completion (``request_text``) is the
one exception: it continues the raw text, with no template around it. Requests run alone or, with a
``Scheduler``, batched with everyone else's. The store only stores: answering lives here. This module knows
nothing about LangChain or LlamaIndex.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pc_rag.baseline import full_request
from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.model import LoadedModel
from pc_rag.rag.chunk import Chunk
from pc_rag.rag.condense import standalone_query
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.markers import split_module_prompt
from pc_rag.rag.order import DEFAULT_ORDER, reorder
from pc_rag.rag.prompt import RagPrompt
from pc_rag.runtime.executor import check_length
from pc_rag.runtime.generate import GenerationResult, ReplyStream, SamplingParams
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.runtime.request import Request
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.handles import ModuleHandle
from pc_rag.store.intact_chunks import intact_chunks

# what a framework user may set; keep_logits is a measurement switch of the eval, not a generation setting
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) - {"keep_logits"}

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    """An answer, the handles it was read from, and its generation stats."""

    text: str
    sources: tuple[ModuleHandle, ...]
    result: GenerationResult
    skipped: tuple[ModuleHandle, ...] = ()  # retrieved, but left out: their KV fails its checksum


@dataclass
class PromptServer:
    """Answer questions from ``store``; serve prompt strings from ``store`` (module references), ``prompt_cache``
    (PML) or full prefill.

    Only a server given a ``prompt_cache`` parses PML: for a store's server, user text that starts with
    ``<prompt`` is a plain question. Thread-safe as its engines are; with a ``scheduler``, concurrent requests
    decode together.
    """

    store: DocumentStore | None = None
    prompt_cache: PromptCache | None = None
    mode: str | None = None  # recovery mode for module prompts; None: the store's default
    scheduler: Scheduler | None = None  # when set, requests are batched through it; else each is served alone
    # when set, the KV of each prompt's head (a conversation's history) is kept and reused by the next request
    prefix_cache: PrefixCache | None = None

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

    def answer(
        self, question: str, k: int = 5, mode: str | None = None, *, order: str = DEFAULT_ORDER, **sampling: object
    ) -> Answer:
        """Retrieve ``k`` chunks, lay them out in ``order`` and answer from their cached KV with ``mode``'s
        recovery (default: this server's, else the store's); ``sampling`` are ``SamplingParams`` fields."""
        return self._answer(lambda: self.rag_request(question, k, mode, order=order, **sampling))

    def answer_full(self, question: str, k: int = 5, *, order: str = DEFAULT_ORDER, **sampling: object) -> Answer:
        """The same retrieval and layout as ``answer``, answered by full prefill (the baseline)."""
        return self._answer(lambda: self.rag_request(question, k, order=order, full=True, **sampling))

    def rag_request(
        self,
        question: str,
        k: int = 5,
        mode: str | None = None,
        *,
        order: str = DEFAULT_ORDER,
        full: bool = False,
        **sampling: object,
    ) -> tuple[tuple[ModuleHandle, ...], Request, tuple[ModuleHandle, ...]]:
        """The handles answered from, best first whatever the layout ``order``, ``answer``'s request (``full``: by
        full prefill of the same tokens), and the retrieved handles skipped because their KV is damaged."""
        store = self._require_store("answering a question")
        _check_settings(sampling, SamplingParams.__dataclass_fields__)
        if not full:
            store.check_mode(self._mode(mode))  # chunks encoded otherwise than the mode reads them: before retrieval
        ranked = tuple(store.search(question, k))  # best first: how sources are listed
        chunks, skipped = intact_chunks(store, reorder(ranked, order))  # how the prompt lays them out
        lost = {h.chunk_id for h in skipped}
        used = tuple(h for h in ranked if h.chunk_id not in lost)
        if full:
            return used, store.engine.request_full(chunks, question, **sampling), skipped
        return used, store.engine.request(chunks, question, self._mode(mode), **sampling), skipped

    def answer_chat(
        self,
        turns: Sequence[tuple[str, str]],
        system: str | None = None,
        k: int = 5,
        mode: str | None = None,
        **options: object,
    ) -> Answer:
        """``rag_chat_request`` answered: the conversation's last user turn from the store."""
        return self._answer(lambda: self.rag_chat_request(turns, system, k, mode, **options))  # type: ignore[arg-type]

    def rag_chat_request(
        self,
        turns: Sequence[tuple[str, str]],
        system: str | None = None,
        k: int = 5,
        mode: str | None = None,
        *,
        condense: bool = True,
        order: str = DEFAULT_ORDER,
        **sampling: object,
    ) -> tuple[tuple[ModuleHandle, ...], Request, tuple[ModuleHandle, ...]]:
        """The answer to a conversation's last user turn from the store: retrieval for that turn made standalone
        (``condense``: ``rag.condense``), the chunks spliced after ``system`` and the earlier ``(role, text)``
        turns, whose KV the prefix cache keeps from turn to turn (``RagEngine.request_chat``). Returns the handles
        answered from, the request, and the retrieved handles skipped because their KV is damaged."""
        store = self._require_store("answering a question")
        _check_settings(sampling, SamplingParams.__dataclass_fields__)
        store.check_mode(self._mode(mode))
        ranked = tuple(store.search(standalone_query(turns, condense=condense), k))
        chunks, skipped = intact_chunks(store, reorder(ranked, order))
        lost = {h.chunk_id for h in skipped}
        history, question = turns[:-1], turns[-1][1]
        request = store.engine.request_chat(
            system, history, chunks, question, self._mode(mode), prefix_cache=self.prefix_cache, **sampling
        )
        return tuple(h for h in ranked if h.chunk_id not in lost), request, skipped

    def stream(self, prompt: str, *, mode: str | None = None, full: bool = False, **sampling: object) -> ReplyStream:
        """Text deltas of the reply to ``prompt``; ``sampling`` are ``SamplingParams`` fields (see ``request``)."""
        return self._serve(lambda: self.request(prompt, mode=mode, full=full, **sampling))

    def request(self, prompt: str, *, mode: str | None = None, full: bool = False, **sampling: object) -> Request:
        """``prompt`` as a serving ``Request``: module references spliced with ``mode``'s recovery (default: this
        server's, else the store's), PML from the Prompt Cache, plain text by full prefill. ``full=True`` serves
        the same tokens by full prefill."""
        _check_settings(sampling)
        if self.prompt_cache is not None and prompt.lstrip().startswith("<prompt"):
            if full:
                ids = self.prompt_cache.full_prompt_ids(prompt)
                return full_request(ids, SamplingParams(**sampling))  # type: ignore[arg-type]
            return self.prompt_cache.request(prompt, **sampling)
        if self.store is not None:
            if not full and split_module_prompt(prompt).refs:
                self.store.check_mode(self._mode(mode))
            before, chunks, after = self.store.prompt_chunks(prompt)
            return self.store.engine.request_around(
                before, chunks, after, None if full else self._mode(mode), **sampling
            )
        return self._turns_request(self.system, [("user", prompt)], sampling)

    def request_text(self, text: str, **sampling: object) -> Request:
        """``text`` continued as it stands (a text completion): the tokenizer's own encoding of it, leading special
        tokens included and no chat template, by full prefill. PML goes to the Prompt Cache as ``request`` does;
        module references are refused (they are spliced into a chat turn: ``request``/``request_chat``)."""
        _check_settings(sampling)
        if self.prompt_cache is not None and text.lstrip().startswith("<prompt"):
            return self.request(text, **sampling)
        if split_module_prompt(text).refs:
            msg = "module references are served in a chat turn, not continued as raw text: send them as a chat message"
            raise PCRagError(msg)
        ids = self.lm.tokenizer(text)["input_ids"]
        if not ids:
            msg = "the prompt is empty and this tokenizer adds no start token: send text to continue"
            raise PCRagError(msg)
        return self._full_request(ids, sampling)

    def _full_request(self, ids: Sequence[int], sampling: dict[str, object]) -> Request:
        """Full prefill of ``ids``, all but the last token from the prefix cache where it holds them (and kept
        there for the next request that starts the same way)."""
        params = SamplingParams(**sampling)  # type: ignore[arg-type]
        if self.prefix_cache is None or len(ids) < 2:
            return full_request(ids, params)
        check_length(self.lm, len(ids))  # refused before any work
        prefix = self.prefix_cache.encode(self.lm.model, ids[:-1])
        request = full_request(ids, params, prefix.kv)
        request.own_tokens = prefix.computed
        return request

    def _mode(self, mode: str | None) -> str:
        return mode or self.mode or self._require_store("a recovery mode").mode

    def _require_store(self, what: str) -> DocumentStore:
        if self.store is None:
            msg = f"{what} needs a document store; this server has only a PromptCache"
            raise PCRagError(msg)
        return self.store

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
        unknown_roles = sorted({role for role, _ in turns} - {"system", "user", "assistant"})
        if unknown_roles:
            msg = f"chat roles {unknown_roles} are not supported; use system, user and assistant turns"
            raise PCRagError(msg)
        system = self.system if system is None else system
        if len(turns) == 1 and turns[0][0] == "user" and system == self.system:
            return self.request(turns[0][1], **sampling)
        _check_settings(sampling)
        if any(split_module_prompt(text).refs for text in (system, *(content for _, content in turns))):
            return self._spliced_chat(system, list(turns), sampling)
        return self._turns_request(system, list(turns), sampling)

    def _spliced_chat(self, system: str, turns: list[tuple[str, str]], sampling: dict[str, object]) -> Request:
        """A conversation whose turns (the system turn included) carry module references: every referenced chunk
        is spliced once, in order of appearance, before the last user turn's question, where this turn's own
        references sit (``RagEngine.request_chat``); the turns keep their text around the references."""
        if self.store is None:
            msg = "module references are spliced from a document store, and this server has none: send plain text"
            raise PCRagError(msg)
        store = self.store
        store.check_mode(self._mode(None))
        chunks: dict[object, Chunk] = {}

        def take(text: str) -> tuple[str, str]:
            before, found, after = store.prompt_chunks(text)
            chunks.update((chunk.source or id(chunk), chunk) for chunk in found)
            return before, after

        system_text = "".join(take(system))
        history = [(role, "".join(take(content))) for role, content in turns[:-1]]
        around = take(turns[-1][1])
        return store.engine.request_chat(
            system_text, history, list(chunks.values()), "", self._mode(None), around=around,
            prefix_cache=self.prefix_cache, **sampling,
        )  # fmt: skip

    def _turns_request(self, system: str, turns: list[tuple[str, str]], sampling: dict[str, object]) -> Request:
        """Full prefill of the conversation rendered through the model's chat template, then decoding."""
        w = self._backend.wrappers
        text = w.wrap("system", system) + "".join(w.wrap(role, c) for role, c in turns) + w.generation_prompt  # type: ignore[arg-type]
        return self._full_request(self._backend.tokenize(text), sampling)

    def _answer(
        self, build: Callable[[], tuple[tuple[ModuleHandle, ...], Request, tuple[ModuleHandle, ...]]]
    ) -> Answer:
        handles, request, skipped = self._built(build)
        reply = self._submit(request)
        for _ in reply:
            pass
        assert reply.result is not None, "the reply ended without a result"
        return Answer(reply.result.text, handles, reply.result, skipped)

    def _serve(self, build: Callable[[], Request]) -> ReplyStream:
        return self._submit(self._built(build))

    def _built(self, build: Callable[[], T]) -> T:
        """``build()`` on the scheduler's thread, where all model work runs (``Scheduler.call``), or here."""
        return self.scheduler.call(build) if self.scheduler is not None else build()

    def _submit(self, request: Request) -> ReplyStream:
        """Serve ``request``: batched by the scheduler, or alone."""
        if self.scheduler is not None:
            return self.scheduler.stream(request)
        return self._backend.serve(request)

    @property
    def _backend(self) -> RagEngine | PromptCache:
        """The engine that tokenizes and serves alone: the store's, else the Prompt Cache."""
        return self.engine if self.engine is not None else self.prompt_cache  # type: ignore[return-value]


def _check_settings(sampling: dict[str, object], known: Iterable[str] = SAMPLING_FIELDS) -> None:
    unknown = set(sampling) - set(known)
    if unknown:
        msg = f"unknown generation settings {sorted(unknown)}; known: {sorted(known)}"
        raise PCRagError(msg)
