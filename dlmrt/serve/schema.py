"""The OpenAI API's shapes as `dlmrt serve` speaks them: requests, replies and errors.

A request's fields are OpenAI's that dlmrt honours, and the diffusion knobs (`gen_length`,
`block_length`, `policy`, `threshold`, `cache`, `steps`) as extra top-level fields; any other field
is refused (400, naming it). Every error is one JSON object in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dlmrt.core import limits

# dlmrt's finish reasons as OpenAI names them: a row that committed end-of-sequence stopped
FINISH_REASONS = {"eos": "stop", "length": "length"}


class DiffusionKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=limits.FLOAT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=limits.MAX_SEED)
    n: Literal[1] = 1
    user: str | None = None
    gen_length: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    block_length: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    policy: str | None = None
    threshold: float | None = None
    cache: Literal["none", "prefix", "dual"] | None = None
    steps: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)


class CompletionRequest(DiffusionKnobs):
    """`POST /v1/completions`."""

    prompt: str | list[int] = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(DiffusionKnobs):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)

    @property
    def most_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def reply_header(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"], model: str) -> dict:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def completion_choice(text: str, ids: list[int], reason: str | None) -> dict:
    return {"index": 0, "text": text, "token_ids": ids, "finish_reason": FINISH_REASONS.get(reason, reason),
            "logprobs": None}


def chat_choice(text: str, reason: str | None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH_REASONS.get(reason, reason), "logprobs": None}


def chat_delta(text: str | None, reason: str | None, first: bool) -> dict:
    delta = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    return {"index": 0, "delta": delta, "finish_reason": FINISH_REASONS.get(reason, reason), "logprobs": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
