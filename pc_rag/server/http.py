"""An OpenAI-compatible HTTP server over a ``PromptServer`` and a ``Scheduler`` (FastAPI).

Routes: ``GET /health``, ``GET /metrics`` (Prometheus text, ``metrics``), ``GET /v1/models``,
``POST /v1/completions`` (continues the raw prompt), ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream``; usage counts), and ``POST /v1/rag`` (a question answered from retrieved modules, with its sources
and timings). Chat with a RAG model id (``model_ids``) answers the question from the store as ``/v1/rag`` does,
its sources in the reply's ``sources``. Building a request (retrieval, the chunks' KV) is model work and runs on
the scheduler's thread (``Scheduler.call``); decoding is batched across requests by the scheduler.

Bad input (validation included) answers 400 naming the field, an unknown model or route 404, a missing or wrong
API key 401 (``api_key``: every ``/v1`` route asks for it; ``/health`` and ``/metrics`` do not, as in vLLM), a
full queue 429 with ``Retry-After``, a closed scheduler 503, a module store that is unreachable or lost modules
503 with ``Retry-After``, a mode the store's chunks were not encoded for 409 (``pc-rag store reencode`` fixes it),
always as an OpenAI error body. ``max_tokens`` beyond the model's context is clipped to it (``finish_reason:
"length"``). A streaming client that goes away cancels its request: its row leaves the batch at the next decode
step. This module knows nothing about attention or storage formats.
"""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from pc_rag.errors import ModuleStoreError, PCRagError, ServerBusyError
from pc_rag.rag.engine import ChunkEncodingError
from pc_rag.runtime.generate import GenerationResult, ReplyStream, collect
from pc_rag.runtime.request import Request
from pc_rag.server.metrics import ServerMetrics
from pc_rag.server.model_ids import ModelIds, ModelNotFoundError
from pc_rag.server.openai_api import (
    DEFAULT_K,
    ChatBody,
    CompletionBody,
    RagBody,
    Reply,
    RequestError,
    error_body,
    finish_reason,
    validation_error_body,
)
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.handles import ModuleHandle

DEFAULT_MAX_TOKENS = 64


def create_app(server: PromptServer, *, api_key: str | None = None) -> Any:
    """The FastAPI app serving ``server`` through its scheduler; ``api_key``: the bearer token ``/v1`` asks for."""
    scheduler = server.scheduler
    if scheduler is None:
        raise PCRagError("the HTTP app serves through a scheduler: build the PromptServer with one")
    try:
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError as e:
        msg = "the HTTP server needs FastAPI and uvicorn: pip install 'pc-rag[serve]'"
        raise ImportError(msg) from e

    app = FastAPI(title="pc-rag", description="Prompt Cache RAG server, OpenAI-compatible")
    ids = ModelIds(server.model_name, store=server.store is not None)
    metrics = ServerMetrics(scheduler, server.model_name, server.prefix_cache)

    class CancellingStream(StreamingResponse):
        """A stream that cancels its request however it stops: finished, failed, or its client gone."""

        def __init__(self, events: Iterator[str], cancel: Callable[[], None]) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.cancel = cancel

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.cancel()

    if api_key:

        @app.middleware("http")
        async def authorize(request: Any, call_next: Any) -> Any:
            if not request.url.path.startswith("/v1"):
                return await call_next(request)
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
                return await call_next(request)
            metrics.refused(401)
            message = "a missing or wrong API key: send the server's key as 'Authorization: Bearer <key>'"
            return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401)

    @app.exception_handler(RequestValidationError)
    def invalid(_: object, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(e.errors()), status_code=400)

    @app.exception_handler(HTTPException)
    def http_error(request: Any, e: HTTPException) -> JSONResponse:  # no such route or method
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, code=str(e.status_code)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    def internal(_: object, e: Exception) -> JSONResponse:  # a bug: logged with its traceback by the server too
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), status_code=500)

    @app.exception_handler(RequestError)
    def refused(_: object, e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(e), param=e.param, code=e.code), status_code=400)

    @app.exception_handler(ModelNotFoundError)
    def no_model(_: object, e: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(error_body(str(e), param="model", code="model_not_found"), status_code=404)

    @app.exception_handler(ServerBusyError)
    def busy(_: object, e: ServerBusyError) -> JSONResponse:
        metrics.refused(429)
        return JSONResponse(error_body(str(e), "server_busy"), status_code=429, headers={"Retry-After": "1"})

    @app.exception_handler(ModuleStoreError)
    def store_unavailable(_: object, e: ModuleStoreError) -> JSONResponse:  # the module store, not the request
        return JSONResponse(error_body(str(e), "unavailable"), status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(ChunkEncodingError)
    def wrong_encoding(_: object, e: ChunkEncodingError) -> JSONResponse:  # the store's state, not the request
        return JSONResponse(error_body(str(e), code="chunk_encoding_mismatch"), status_code=409)

    @app.exception_handler(PCRagError)
    def bad_request(_: object, e: PCRagError) -> JSONResponse:
        closed = "scheduler is closed" in str(e)
        kind, status = ("unavailable", 503) if closed else ("invalid_request_error", 400)
        return JSONResponse(error_body(str(e), kind), status_code=status)

    @app.get("/health")
    def health() -> JSONResponse:
        if scheduler.closed:
            return JSONResponse(error_body("the scheduler is closed", "unavailable"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def scrape() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    def models() -> dict[str, object]:
        listed = [{"id": i, "object": "model", "created": 0, "owned_by": "pc-rag"} for i in ids.listed()]
        return {"object": "list", "data": listed}

    @app.post("/v1/completions")
    def completions(body: CompletionBody) -> Any:
        route = ids.route(body.model)
        if route.rag:
            msg = f"the model {route.id} answers chat: use /v1/chat/completions, or the model {ids.model} here"
            raise RequestError(msg, "model")
        sampling = body.sampling(DEFAULT_MAX_TOKENS)
        request = scheduler.call(lambda: server.request_text(body.text(), **sampling))
        return _respond(Reply(route.id, chat=False), request, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    def chat(body: ChatBody) -> Any:
        route = ids.route(body.model)
        sampling = body.sampling(DEFAULT_MAX_TOKENS)
        system, turns = body.conversation()
        if route.rag:
            k = body.k or DEFAULT_K
            handles, request, skipped = scheduler.call(
                lambda: server.rag_chat_request(turns, system, k, route.mode, **sampling)
            )
            metadata = {"sources": _sources(handles), "skipped_damaged": _sources(skipped)}
            return _respond(Reply(route.id, True, metadata), request, body.stream, body.include_usage)
        if body.k is not None:
            raise RequestError(f"k retrieves from the store: use the model {ids.model}+rag", "k")
        request = scheduler.call(lambda: server.request_chat(turns, system, **sampling))
        return _respond(Reply(route.id, chat=True), request, body.stream, body.include_usage)

    @app.post("/v1/rag")
    def rag(body: RagBody) -> dict[str, object]:
        if server.store is None:
            raise PCRagError("this server has no document store: /v1/rag needs `pc-rag serve --store DIR`")
        answer = server.answer(body.question, body.k, body.mode, max_new_tokens=body.max_tokens)
        result = answer.result
        return {
            "answer": answer.text,
            "sources": _sources(answer.sources),
            "skipped_damaged": _sources(answer.skipped),  # retrieved, left out: their KV fails its checksum
            "timings": {"ttft_ms": result.stats.ttft_ms, "total_ms": result.stats.total_ms},
            "usage": {
                "cached_tokens": result.stats.cached_tokens, "computed_tokens": result.stats.computed_tokens,
                "completion_tokens": result.stats.new_tokens,
            },
        }  # fmt: skip

    def _respond(reply: Reply, request: Request, stream: bool, with_usage: bool) -> Any:
        _fit_context(request, server.lm.max_positions)
        limit = request.params.max_new_tokens
        submitted = scheduler.submit(request)
        if not stream:
            result = collect(submitted)
            metrics.finished(result, finish_reason(result, limit))
            return reply.whole(result, limit)
        replies = ReplyStream(submitted)
        deltas = iter(replies)
        first = next(deltas, None)  # a request that fails (too long for the model) fails here, as a 400
        chained = itertools.chain([first] if first is not None else [], deltas)

        def result() -> GenerationResult:
            done = _result_of(replies)()
            metrics.finished(done, finish_reason(done, limit))
            return done

        def cancel() -> None:
            if replies.result is None:  # the client left before the end
                metrics.aborted()
            submitted.cancel()

        return CancellingStream(reply.events(chained, result, limit, with_usage), cancel)

    return app


def _fit_context(request: Request, max_positions: int) -> None:
    """Clip ``request``'s ``max_new_tokens`` to the positions left after its prompt (OpenAI: ``finish_reason``
    ``length``); a prompt with no room left is refused when it is served."""
    room = max_positions - request.next_position
    if 1 <= room < request.params.max_new_tokens:
        request.params = replace(request.params, max_new_tokens=room)


def _sources(handles: Sequence[ModuleHandle]) -> list[dict[str, object]]:
    return [{"chunk_id": h.chunk_id, "doc_id": h.doc_id, "score": h.score, "text": h.text} for h in handles]


def _result_of(stream: ReplyStream) -> Callable[[], GenerationResult]:
    def result() -> GenerationResult:
        assert stream.result is not None, "the stream ended without a result"
        return stream.result

    return result
