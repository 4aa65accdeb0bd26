"""The OpenAI wire format: request bodies (pydantic, unknown fields ignored), the JSON and SSE replies, and error
bodies (``{"error": {"message", "type", "param", "code"}}``).

Only what this server honours is read: prompt or messages, ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream`` (and ``stream_options.include_usage``), and ``k`` (chunks to retrieve, for the RAG model ids).
Fields whose meaning this server does not carry out (``n`` above 1, log-probabilities, tools, penalties, ...) are
refused by validation, naming the field, rather than silently ignored; fields that change nothing (``user``,
``stream_options``, ...) are accepted. This module knows nothing about models or scheduling.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pc_rag.errors import PCRagError
from pc_rag.rag.modes import MODES, is_mode
from pc_rag.runtime.generate import GenerationResult

INVALID = "invalid_request_error"
DEFAULT_K = 5  # chunks retrieved when a RAG request names no k


class RequestError(PCRagError):
    """A request this server refuses, with the body field at fault (``param``): an HTTP server answers 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _unsupported(why: str) -> PydanticCustomError:
    """A validation error for a value this server does not serve (the field is named where it is reported)."""
    return PydanticCustomError("unsupported", "{why}", {"why": why})


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
    # accepted only at the value that changes nothing: what this server does not do is refused, naming the field
    n: int = 1
    best_of: int = 1
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[object] | None = None
    functions: list[object] | None = None
    response_format: dict[str, object] | None = None

    @field_validator("n", "best_of")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise _unsupported("this server returns one choice per request")
        return value

    @field_validator(
        "logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "presence_penalty", "frequency_penalty",
        "tools", "functions",
    )  # fmt: skip
    @classmethod
    def _not_done(cls, value: object) -> object:
        if value:
            raise _unsupported("not supported by this server; leave it out")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, object] | None) -> dict[str, object] | None:
        if value and value.get("type", "text") != "text":
            raise _unsupported(f"{value.get('type')!r} is not supported; this server answers text")
        return value

    def sampling(self, default_max_tokens: int) -> dict[str, object]:
        """``SamplingParams`` fields."""
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

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise _unsupported(f"{len(value)} prompts in one request; send one prompt per request")
        return value

    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[dict[str, object]]

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, object]]) -> str | list[dict[str, object]]:
        if isinstance(value, list) and any(p.get("type") != "text" for p in value):
            raise _unsupported("only text parts are supported")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    k: int | None = Field(default=None, ge=1, le=100)  # chunks to retrieve, for the RAG model ids

    @field_validator("messages")
    @classmethod
    def _one_conversation(cls, messages: list[Message]) -> list[Message]:
        if messages and messages[-1].role != "user":
            raise _unsupported("the conversation must end with a user message")
        if any(m.role == "user" and not m.text().strip() for m in messages):
            raise PydanticCustomError("empty", "a user message is empty: send the question as text")
        return messages

    def conversation(self) -> tuple[str | None, list[tuple[str, str]]]:
        """(the leading system prompt or None, the turns after it: user, assistant, and later system turns)."""
        turns = [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]
        if turns[0][0] == "system":
            return turns[0][1], turns[1:]
        return None, turns


class RagBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1)
    k: int = Field(default=DEFAULT_K, ge=1, le=100)
    mode: str | None = None
    max_tokens: int = Field(default=64, ge=1)

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str | None) -> str | None:
        if mode is not None and not is_mode(mode):
            raise _unsupported(f"unknown recovery mode; use a mode such as {', '.join(MODES)} or edge:32")
        return mode


def finish_reason(result: GenerationResult, max_new_tokens: int) -> str:
    return "length" if result.stats.new_tokens >= max_new_tokens else "stop"


def usage(result: GenerationResult) -> dict[str, object]:
    stats = result.stats
    prompt = stats.cached_tokens + stats.computed_tokens
    return {
        "prompt_tokens": prompt, "completion_tokens": stats.new_tokens, "total_tokens": prompt + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }  # fmt: skip


class Reply:
    """One response's identity and the builders of its JSON bodies (``chat`` or text completion); ``extra``
    fields (a RAG answer's sources, chat only) go into the whole body, or the first chunk of a stream."""

    def __init__(self, model: str, chat: bool, extra: Mapping[str, object] | None = None) -> None:
        self.model, self.chat, self.extra = model, chat, dict(extra or {})
        assert chat or not self.extra, "a text completion's stream has no opening chunk for extra fields"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self, result: GenerationResult, max_new_tokens: int) -> dict[str, object]:
        choice: dict[str, object] = {"index": 0, "finish_reason": finish_reason(result, max_new_tokens)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice |= {"text": result.text, "logprobs": None}
        return self._body(self.object, [choice]) | {"usage": usage(result)} | self.extra

    def events(
        self, deltas: Iterator[str], result: Callable[[], GenerationResult], max_new_tokens: int, with_usage: bool
    ) -> Iterator[str]:
        """Server-sent events: a chunk per text delta, a last chunk with the finish reason, usage if asked, [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            opener = [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]
            yield _event(self._body(kind, opener) | self.extra)
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


def error_body(
    message: str, kind: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error_body(errors: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """The first of pydantic's validation ``errors`` of a request body as an OpenAI error naming its field."""
    error = errors[0]
    where = [p for p in error["loc"] if not _is_type_tag(p)][1:]  # type: ignore[attr-defined]  # after "body"
    kind = str(error["type"])
    if kind == "json_invalid":
        reason = error.get("ctx", {}).get("error", error["msg"])  # type: ignore[attr-defined]
        at = f" at character {where[0]}" if where else ""
        return error_body(f"the request body is not valid JSON: {reason}{at}", code="invalid_json")
    if not where:
        return error_body(f"the request body must be a JSON object: {error['msg']}", code="invalid_type")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".")
    if kind == "missing":
        return error_body(f"{param} is required", param=param, code="missing_required_parameter")
    got = error.get("input")
    shown = f" (got {json.dumps(got)})" if isinstance(got, int | float | str | bool) else ""
    code = "unsupported_value" if kind == "unsupported" else "invalid_value"
    return error_body(f"{param}: {error['msg']}{shown}", param=param, code=code)


def _is_type_tag(part: object) -> bool:
    """Whether a location part names a member of a union (``str``, ``list[str]``) rather than a field."""
    return isinstance(part, str) and (not part.isidentifier() or part in {"str", "int", "float", "bool", "list"})


def _event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body)}\n\n"
