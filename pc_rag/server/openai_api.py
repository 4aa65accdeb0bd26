"""The OpenAI wire format: request bodies (pydantic, unknown fields ignored) and the JSON and SSE replies.

Only what this server honours is read: prompt or messages, ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream`` (and ``stream_options.include_usage``). ``n`` above 1 and log-probabilities are refused
rather than silently ignored. This module knows nothing about models or scheduling.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pc_rag.errors import PCRagError
from pc_rag.generate import GenerationResult


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, object] | None = None
    n: int = 1
    logprobs: bool | int | None = None

    def sampling(self, default_max_tokens: int) -> dict[str, object]:
        """``SamplingParams`` fields; ``PCRagError`` for what this server does not do."""
        if self.n != 1:
            raise PCRagError(f"n={self.n}: this server returns one choice per request")
        if self.logprobs:
            raise PCRagError("log-probabilities are not returned by this server")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        settings: dict[str, object] = {
            "max_new_tokens": self.max_completion_tokens or self.max_tokens or default_max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stop": stop,
        }  # fmt: skip
        if self.seed is not None:
            settings["seed"] = self.seed
        return settings

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionBody(_Body):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise PCRagError(f"{len(self.prompt)} prompts in one request: send one prompt per request")
            return self.prompt[0]
        return self.prompt


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, object]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content):
            raise PCRagError("only text content is supported")
        return "".join(str(p.get("text", "")) for p in parts)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)

    def conversation(self) -> tuple[str | None, list[tuple[str, str]]]:
        """(system prompt or None, the user/assistant turns)."""
        messages = self.messages
        system = None
        if messages[0].role == "system":
            system, messages = messages[0].text(), messages[1:]
        if any(m.role == "system" for m in messages):
            raise PCRagError("a system message is only supported first")
        if not messages or messages[-1].role != "user":
            raise PCRagError("the conversation must end with a user message")
        return system, [(m.role, m.text()) for m in messages]


class RagBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    k: int = Field(default=5, ge=1, le=100)
    mode: str | None = None
    max_tokens: int = Field(default=64, ge=1)


def finish_reason(result: GenerationResult, max_new_tokens: int) -> str:
    return "length" if result.stats.new_tokens >= max_new_tokens else "stop"


def usage(result: GenerationResult) -> dict[str, int]:
    stats = result.stats
    prompt = stats.cached_tokens + stats.computed_tokens
    return {"prompt_tokens": prompt, "completion_tokens": stats.new_tokens, "total_tokens": prompt + stats.new_tokens}


class Reply:
    """One response's identity and the builders of its JSON bodies (``chat`` or text completion)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self, result: GenerationResult, max_new_tokens: int) -> dict[str, object]:
        choice: dict[str, object] = {"index": 0, "finish_reason": finish_reason(result, max_new_tokens)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice |= {"text": result.text, "logprobs": None}
        return self._body(self.object, [choice]) | {"usage": usage(result)}

    def events(
        self, deltas: Iterator[str], result: Callable[[], GenerationResult], max_new_tokens: int, with_usage: bool
    ) -> Iterator[str]:
        """Server-sent events: a chunk per text delta, a last chunk with the finish reason, usage if asked, [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield _event(self._body(kind, [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]))
        for delta in deltas:
            yield _event(self._body(kind, [self._delta(delta, None)]))
        final: GenerationResult = result()
        yield _event(self._body(kind, [self._delta("", finish_reason(final, max_new_tokens))]))
        if with_usage:
            yield _event(self._body(kind, []) | {"usage": usage(final)})
        yield "data: [DONE]\n\n"

    def _delta(self, text: str, finish: str | None) -> dict[str, object]:
        if self.chat:
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _body(self, kind: str, choices: list[dict[str, object]]) -> dict[str, object]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def error_body(message: str, kind: str) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body)}\n\n"
