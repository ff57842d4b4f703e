"""The OpenAI API's shapes as `dlmrt serve` speaks them: requests, replies and errors.

A request takes every field of OpenAI's Completions or Chat Completions request, and the diffusion
knobs (`gen_length`, `block_length`, `policy`, `threshold`, `cache`, `steps`) as extra top-level
fields; any other field is refused (400, naming it). Of OpenAI's fields, dlmrt honours `model`, the
prompt or messages, `max_tokens` (`max_completion_tokens`), `temperature`, `seed`, `stop`, `stream`,
`stream_options.include_usage`, `logprobs` and `top_logprobs` (`alternatives`), and Completions'
`echo` with `max_tokens: 0`, which scores the prompt (docs/logprobs.md);
identifiers and hints (`user`, `metadata`, `safety_identifier`, the `prompt_cache_*` fields,
`parallel_tool_calls`) change nothing and are taken as they come. Every other field is in
NO_OP_ONLY: taken at the values that ask for nothing, refused at any other with a 400 that says why
(`code` "unsupported_value", `param` the field). Every error is one JSON object in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`.

dlmrt's own streaming field, `stream_provisional`, is top-level beside the knobs (docs/streaming.md).

Types are JSON's as OpenAI documents them, strictly (pydantic's strict mode): a string is never taken
for a number or a boolean (`"max_tokens": "16"` is a 400), while a JSON integer is a number where a
float is asked for (`"temperature": 1`).

The body must say it is JSON: `Content-Type: application/json` (any parameters, as a charset, are taken
and ignored: JSON is UTF-8) or a `+json` type of RFC 6839 (`application/merge-patch+json`), as FastAPI
takes them. Any other type, and a body without one, is a 415 (`require_json`). A browser sends a
"simple" cross-site request (`text/plain`, a form, or a body with no type) without asking the server
first, so taking such bodies as JSON would let any web page send completions to a server on
localhost; FastAPI refuses a missing type for the same reason, and OpenAI's clients always send it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dlmrt.core import limits

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap on a Completions request's logprobs

# dlmrt's finish reasons as OpenAI names them: a row that committed end-of-sequence stopped
FINISH_REASONS = {"eos": "stop", "length": "length"}
MAX_STOP_STRINGS = 4  # as OpenAI


@dataclass(frozen=True)
class NoOpOnly:
    """An OpenAI field dlmrt cannot honour: it takes null and the values in `accepted` (which ask for
    nothing), and answers any other with 400 and `why`."""

    accepted: tuple
    why: str


NO_TOOLS = "dlmrt's models do not call tools"
NO_OP_ONLY: dict[str, NoOpOnly] = {
    "top_p": NoOpOnly((1.0,), "dlmrt samples from the whole distribution (no nucleus sampling): leave top_p "
                              "out or 1, and set temperature"),
    "frequency_penalty": NoOpOnly((0.0,), "dlmrt applies no penalties: leave frequency_penalty out or 0"),
    "presence_penalty": NoOpOnly((0.0,), "dlmrt applies no penalties: leave presence_penalty out or 0"),
    "logit_bias": NoOpOnly(({},), "dlmrt does not bias logits: leave logit_bias out or {}"),
    "n": NoOpOnly((1,), "dlmrt returns one choice a request: leave n out or 1, and send n requests (with "
                        "different seeds for different choices)"),
    "best_of": NoOpOnly((1,), "dlmrt returns one choice a request and ranks none: leave best_of out or 1"),
    "suffix": NoOpOnly(("",), "dlmrt does not fill in before a suffix: leave suffix out"),
    "tools": NoOpOnly(([],), f"{NO_TOOLS}: leave tools out"),
    "tool_choice": NoOpOnly(("none", "auto"), f"{NO_TOOLS}: leave tool_choice out, or none"),
    "functions": NoOpOnly(([],), f"{NO_TOOLS}: leave functions out"),
    "function_call": NoOpOnly(("none", "auto"), f"{NO_TOOLS}: leave function_call out, or none"),
    "response_format": NoOpOnly(({"type": "text"},), 'dlmrt does not constrain its output to JSON: leave '
                                                     'response_format out or {"type": "text"}'),
    "modalities": NoOpOnly((["text"],), 'dlmrt generates text only: leave modalities out or ["text"]'),
    "audio": NoOpOnly((), "dlmrt generates text only: leave audio out"),
    "prediction": NoOpOnly((), "dlmrt does not use predicted outputs: leave prediction out"),
    "web_search_options": NoOpOnly((), "dlmrt does not search the web: leave web_search_options out"),
    "moderation": NoOpOnly((), "dlmrt does not moderate: leave moderation out"),
    "store": NoOpOnly((False,), "dlmrt keeps no completions: leave store out or false"),
    "service_tier": NoOpOnly(("auto", "default"), "dlmrt serves every request alike: leave service_tier out, "
                                                  "auto or default"),
    "reasoning_effort": NoOpOnly(("none",), "dlmrt's models do not reason before they answer: leave "
                                            "reasoning_effort out, or none"),
    "verbosity": NoOpOnly(("medium",), "dlmrt's models take no verbosity: leave verbosity out, or medium"),
    "stream_options.include_obfuscation": NoOpOnly((False,), "dlmrt does not pad stream events: leave "
                                                             "include_obfuscation out or false"),
}


def _asks_nothing(value: Any, accepted: tuple) -> bool:
    # by type too: a completion's logprobs=0 is no `false`, though 0 == False in Python
    return value is None or any(type(value) is type(ok) and value == ok for ok in accepted)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class OpenAIRequest(BaseModel):
    """The fields both endpoints take: OpenAI's common ones, then the diffusion knobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=limits.FLOAT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=limits.MAX_SEED)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default=[], max_length=MAX_STOP_STRINGS)
    user: str | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    gen_length: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    block_length: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    policy: str | None = None
    threshold: float | None = None
    cache: Literal["none", "prefix", "dual"] | None = None
    steps: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    # dlmrt's own, top-level as the knobs are (not in stream_options, which is OpenAI's): stream the
    # block's provisional tokens too (docs/streaming.md)
    stream_provisional: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        """OpenAI's stop is null, a string, or a list of strings."""
        return [] if stop is None else [stop] if isinstance(stop, str) else stop

    def refuse_unsupported(self) -> None:
        """Raise a 400 for the first value dlmrt cannot honour (NO_OP_ONLY)."""
        for field, rule in NO_OP_ONLY.items():
            outer, _, inner = field.partition(".")
            value = getattr(self, outer, None)
            if not _asks_nothing(getattr(value, inner, None) if inner else value, rule.accepted):
                raise ApiError(400, f"{field}: {rule.why}", param=field, code="unsupported_value")
        for field, given in (("stream_options", self.stream_options is not None),
                             ("stream_provisional", self.stream_provisional)):
            if given and not self.stream:
                raise ApiError(400, f"{field}: only allowed with stream: true", param=field, code="invalid_value")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    """`POST /v1/completions`."""

    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0, le=limits.MAX_POSITIONS)  # 0: with echo, scores the prompt
    suffix: str | None = None
    echo: bool | None = Field(default=None, strict=True)
    best_of: int | None = None
    logprobs: int | None = Field(default=None, strict=True)  # the alternatives a token comes with; 0 asks for none

    def alternatives(self) -> int | None:
        """The alternatives each token's logprob comes with, or None where logprobs are not asked for."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs: a completion's tokens come with 0 to {MAX_COMPLETION_LOGPROBS} "
                                f"alternatives, as in OpenAI's API; got {self.logprobs}", param="logprobs",
                           code="invalid_value")
        return self.logprobs

    @property
    def scores(self) -> bool:
        """Whether the request scores its prompt (echo with max_tokens 0) instead of generating; the
        combinations dlmrt does not run are refused."""
        if self.echo and self.stream:
            raise ApiError(400, "echo: a scored prompt comes in one reply, not streamed: leave stream out with echo",
                           param="echo", code="unsupported_value")
        if self.echo and self.max_tokens != 0:
            raise ApiError(400, "echo: dlmrt echoes a prompt only to score it: give max_tokens 0 with echo, or "
                                "leave echo out and prepend the prompt to the completion yourself", param="echo",
                           code="unsupported_value")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: 0 generates nothing: give at least 1, or echo: true to score the "
                                "prompt", param="max_tokens", code="invalid_value")
        return bool(self.echo)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(OpenAIRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=limits.MAX_POSITIONS)
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, strict=True)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None

    @property
    def most_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def alternatives(self) -> int | None:
        """The alternatives each token's logprob comes with (top_logprobs), or None where logprobs are not
        asked for."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= limits.MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs: a token comes with 0 to {limits.MAX_TOP_LOGPROBS} alternatives, as "
                                f"in OpenAI's API; got {top}", param="top_logprobs", code="invalid_value")
        if top and not self.logprobs:
            raise ApiError(400, "top_logprobs: alternatives come with logprobs: set logprobs to true, or leave "
                                "top_logprobs out", param="top_logprobs", code="invalid_value")
        return (top or 0) if self.logprobs else None


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


def completion_choice(text: str, ids: list[int], reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "text": text, "token_ids": ids, "finish_reason": FINISH_REASONS.get(reason, reason),
            "logprobs": logprobs}


def chat_choice(text: str, reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH_REASONS.get(reason, reason), "logprobs": logprobs}


def chat_delta(text: str | None, reason: str | None, first: bool, logprobs: dict | None = None) -> dict:
    delta = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    return {"index": 0, "delta": delta, "finish_reason": FINISH_REASONS.get(reason, reason), "logprobs": logprobs}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


JSON_TYPE = "application/json"


def require_json(content_type: str | None) -> None:
    """A 415 unless `content_type` (the request's header) says the body is JSON."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    top, _, sub = media_type.partition("/")
    if media_type == JSON_TYPE or (top == "application" and sub.endswith("+json")):
        return
    given = f"Content-Type {content_type.strip()[:100]!r}" if content_type and content_type.strip() \
        else "no Content-Type"
    raise ApiError(415, f"the body is JSON, so the request needs Content-Type: {JSON_TYPE}, and it has {given} "
                        f"(with curl: -H 'Content-Type: {JSON_TYPE}')", code="unsupported_media_type")


def parse_request(kind: type[OpenAIRequest], body: bytes) -> OpenAIRequest:
    """The request in `body`, or an ApiError that names what is wrong with it."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as error:
        raise _invalid(error.errors(include_url=False)) from None


def _invalid(errors: list[dict]) -> ApiError:
    """A 400 for pydantic's errors: `param` the first one's field, the message every error about that field."""
    first = errors[0]
    if first["type"] == "json_invalid":
        why = first["msg"].removeprefix("Invalid JSON: ")
        return ApiError(400, f"the body is not valid JSON in UTF-8: {why}", code="invalid_json")
    if not first["loc"]:
        return ApiError(400, f"the body must be a JSON object: {first['msg']}", code=first["type"])
    param = _param(first)
    told = dict.fromkeys(f"{_param(e)}: {'unknown field' if e['type'] == 'extra_forbidden' else e['msg']}"
                         for e in errors if e["loc"] and e["loc"][0] == first["loc"][0])
    return ApiError(400, "; ".join(told), param=param, code=first["type"])


def _param(error: dict) -> str:
    """The request's own path to the field, as `messages.0.content`: without the member types pydantic puts
    in the location of a union's errors (`prompt.str`); an unknown field is named as sent."""
    loc = error["loc"]
    kept = [str(part) for part in loc[:-1] if isinstance(part, int) or part in _FIELD_NAMES]
    last = loc[-1]
    if isinstance(last, int) or last in _FIELD_NAMES or error["type"] == "extra_forbidden":
        kept.append(str(last))
    return ".".join(kept)


_FIELD_NAMES = frozenset(name for kind in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions)
                         for name in kind.model_fields)
