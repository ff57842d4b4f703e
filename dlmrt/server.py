"""The OpenAI-compatible HTTP API over a Generator (`dlmrt serve`).

    app = create_app(model, Generator(backend), ServerLimits())
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions` (JSON, or server-sent events with
one event per committed block, ending in `data: [DONE]`). The diffusion knobs are extra top-level
fields of a completion request (`gen_length`, `block_length`, `policy`, `threshold`, `cache`,
`steps`); what a request leaves out comes from the model's generation_config.json, as on the
command line.

This first step runs one request at a time: requests wait in a bounded queue (429 when it is full)
and a single worker decodes them in turn. Continuous batching at block boundaries is the next step.

Every error is one JSON object in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
malformed JSON, an unknown field, a bad value or prompt (400, naming the field), an unknown model
(404), a body over the limit (413), a full queue (429), a request over its time limit (504). A
client that disconnects from a stream cancels its request at the next block boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from dlmrt import limits
from dlmrt.errors import DlmrtError
from dlmrt.runtime import Generator, text


@dataclass(frozen=True)
class ServerLimits:
    max_queue: int = 64  # requests waiting beyond the one being decoded
    request_timeout_s: float = 600.0  # from arrival to the last token
    max_body_bytes: int = 1 << 20


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: OpenAI's fields that dlmrt honours, and the diffusion knobs."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int] = Field(min_length=1)
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


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class _Cancel:
    """The Generator's cancel token, set from the event loop when a client goes away."""

    def __init__(self):
        self.event = threading.Event()

    def is_set(self) -> bool:
        return self.event.is_set()


def create_app(model, generator: Generator, server_limits: ServerLimits = ServerLimits(),
               model_name: str | None = None) -> FastAPI:
    """The API over `generator`; `model` encodes and decodes text and gives the defaults."""
    name = model_name or model.name
    app = FastAPI(title="dlmrt", docs_url=None, redoc_url=None)
    worker = asyncio.Lock()  # one request decodes at a time
    waiting = 0
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        # one request failed, not the server: the worker is released by `turn`, and the next request runs
        return ApiError(500, f"the request failed inside dlmrt ({type(error).__name__}: {error})",
                        code="internal_error", kind="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json").response()
        field = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = ("unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid"))
        return ApiError(400, f"{field}: {message}" if field else message, param=field,
                        code=first.get("type")).response()

    @app.middleware("http")
    async def body_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > server_limits.max_body_bytes:
            return ApiError(413, f"the body has {length} bytes, more than the limit of "
                                 f"{server_limits.max_body_bytes}", code="body_too_large").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "dlmrt"}]}

    @contextlib.asynccontextmanager
    async def turn():
        """Wait in the queue for the worker, then hold it."""
        nonlocal waiting
        waiting += 1
        try:
            await worker.acquire()
        finally:
            waiting -= 1
        try:
            yield
        finally:
            worker.release()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        if request.model != name:
            raise ApiError(404, f"the model {request.model!r} does not exist: this server runs {name!r}",
                           param="model", code="model_not_found")
        prompt, settings, most = _prepare(model, generator, request)
        if waiting >= server_limits.max_queue:
            raise ApiError(429, f"the queue is full ({server_limits.max_queue} requests wait): retry later",
                           code="queue_full", kind="rate_limit_error")
        reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                 "model": name}
        deadline = time.monotonic() + server_limits.request_timeout_s
        if request.stream:
            return StreamingResponse(_events(model, generator, turn, prompt, settings, most, reply, deadline,
                                             _timeout(server_limits)), media_type="text/event-stream")
        async with turn():
            cancel = _Cancel()
            task = asyncio.ensure_future(asyncio.to_thread(generator.generate, [prompt], settings, cancel=cancel))
            try:
                result = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                cancel.event.set()
                await task  # it stops at its next block boundary; the worker is free after that
                raise _timeout(server_limits) from None
        row = result.rows[0]
        ids, reason = _cut(row.token_ids, row.finish_reason, most)
        return {**reply, "choices": [_choice(model, ids, reason)],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    return app


def _prepare(model, generator: Generator, request: CompletionRequest):
    """(prompt ids, settings, the most tokens to return) for a request; every check before any compute."""
    from dlmrt.cli import settings_from_options
    from dlmrt.runtime.settings import check_request

    if request.max_tokens is not None and request.gen_length is not None:
        raise ApiError(400, "give max_tokens or gen_length, not both", param="gen_length")
    block = request.block_length or model.generation_config.get("block_length") or model.default_block_length
    wanted = request.max_tokens or request.gen_length
    gen_length = None if wanted is None else (-(-wanted // block) * block if block else wanted)
    try:
        prompt = text.encode(model, request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        settings = settings_from_options(
            model, gen_length=gen_length, block_length=request.block_length, policy=request.policy,
            steps=request.steps, remasking="low_confidence", threshold=request.threshold, factor=None,
            confidence="prob", minimal_topk=1, editing_threshold=None, max_post_steps=None, preset=None,
            entropy_bound=None, cache=request.cache or "none", max_block_steps=None,
            temperature=request.temperature or 0.0, cfg_scale=0.0, seed=request.seed or 0, steps_per_sync=None)
        check_request(generator.spec, [prompt], settings)
    except DlmrtError as error:
        raise ApiError(400, str(error), code="invalid_value") from None
    if not prompt:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    return prompt, settings, wanted or settings.gen_length


def _cut(ids: list[int], reason: str, most: int) -> tuple[list[int], str]:
    """At most `most` tokens (gen_length is rounded up to whole blocks); cut ones end for 'length'."""
    return (ids[:most], "length") if len(ids) > most else (ids, reason)


def _choice(model, ids: list[int], reason: str | None) -> dict:
    return {"index": 0, "text": text.decode(model, ids) or "", "token_ids": ids, "finish_reason": reason,
            "logprobs": None}


def _timeout(server_limits: ServerLimits) -> ApiError:
    return ApiError(504, f"the request took longer than its limit of {server_limits.request_timeout_s:g} s",
                    code="timeout", kind="timeout_error")


async def _events(model, generator: Generator, turn, prompt, settings, most: int, reply: dict, deadline: float,
                  timeout: ApiError) -> AsyncIterator[str]:
    """Server-sent events: one per block that committed tokens, then `[DONE]`. Closing the stream (the
    client went away) or passing the deadline cancels the request at its next block boundary."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()
    cancel = _Cancel()

    def decode() -> None:
        try:
            for update in generator.stream([prompt], settings, cancel=cancel):
                loop.call_soon_threadsafe(updates.put_nowait, update)
        finally:
            loop.call_soon_threadsafe(updates.put_nowait, None)

    sent = 0
    async with turn():
        task = loop.run_in_executor(None, decode)
        try:
            while True:
                try:
                    update = await asyncio.wait_for(updates.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    yield f"data: {json.dumps(timeout.body())}\n\n"
                    break
                if update is None:
                    break
                ids = update.token_ids[:max(0, most - sent)]
                sent += len(ids)
                reason = update.finish_reason or ("length" if sent >= most else None)
                if ids or reason:
                    yield f"data: {json.dumps({**reply, 'choices': [_choice(model, ids, reason)]})}\n\n"
                if reason is not None:
                    break
            yield "data: [DONE]\n\n"
        finally:
            cancel.event.set()
            await task

