"""The OpenAI-compatible HTTP API over a backend (`dlmrt serve`).

    limits = ServerLimits()
    app = create_app(model, backend, limits, chat_template=load_chat_template(model_dir))
    uvicorn.Server(server_config(app, limits, host="127.0.0.1", port=8000)).run()  # dlmrt.serve.transport

Endpoints: `GET /health`, `GET /v1/models`, `GET /metrics` (Prometheus), `POST /v1/completions` and
`POST /v1/chat/completions` (JSON, or server-sent events with one event per committed block, ending
in `data: [DONE]`). Shapes, knobs and errors: `dlmrt.serve.schema`. What a request leaves out comes
from the model's generation_config.json, as on the command line. A completion ends before its first
`stop` string (`dlmrt.serve.stop_strings`), and its row then leaves the batch; a stream holds back
the text that may begin a stop string until the next block shows it does not.

With `stream_provisional`, a stream also carries the block's provisional tokens at every K-step
boundary, in a `dlmrt` extension object of otherwise empty chunks (`dlmrt.serve.provisional`).

A POST's body must have a JSON content type (415 otherwise: `dlmrt.serve.schema.require_json`), and
no web page of another origin may call the API from a browser unless its origin is allowed
(`dlmrt.serve.cors`).

Requests are decoded by continuous batching (`dlmrt.runtime.scheduler`): a request joins the running
batch at the next block boundary and leaves it at the boundary after it ends, so it never waits for
a whole batch; its tokens are those it would get alone. Chat renders the messages with the model's
chat template (tokenizer_config.json, `dlmrt.core.chat_template`); a model without one answers chat with 400.

Limits and faults: the transport's limits (body size, header and body deadlines, open connections,
the shutdown deadline) are `dlmrt.serve.transport`'s; a full queue answers 429; a request past its
time limit answers 504 and leaves the batch; a client that disconnects from a stream cancels its row
at its next K-step boundary; an exception inside one request answers 500 for it alone. At shutdown
(SIGTERM, through uvicorn) the server stops listening, the requests it holds finish (until the
shutdown deadline), then the worker stops. At startup it logs what it serves (the `dlmrt.serve.app`
logger; `dlmrt serve` puts it beside uvicorn's).

A request's body is parsed, validated, tokenized and (chat) templated in a worker thread, so a large
prompt never holds the event loop, and with it `/health` and the streams of other requests. Every
error, the framework's own (404, 405) included, is OpenAI's error object (`dlmrt.serve.schema`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from dlmrt.serve.schema import (ApiError, ChatRequest, CompletionRequest, OpenAIRequest, chat_choice, chat_delta,
                                completion_choice, parse_request, reply_header, require_json, usage)
from dlmrt.core.chat_template import ChatTemplate
from dlmrt.core.errors import DlmrtError
from dlmrt.runtime import text
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.running_batch import BlockProgress
from dlmrt.runtime.scheduler import Failed, Finished, QueueFull, Scheduler, ShuttingDown
from dlmrt.runtime.scoring import Scorer
from dlmrt.serve.cors import Cors
from dlmrt.serve.logprobs import CompletionLogprobs, chat_logprobs
from dlmrt.serve.metrics import ServerMetrics
from dlmrt.serve.provisional import Provisional, ProvisionalView
from dlmrt.serve.stop_strings import StopScan, tokens_spanning
from dlmrt.serve.transport import BodyLimit

if TYPE_CHECKING:
    from dlmrt.parallel.lockstep import Leader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    max_queue: int = 64  # requests waiting to join the batch; one more gets 429
    request_timeout_s: float = 600.0  # from arrival to the last token
    # the transport's (dlmrt.serve.transport)
    max_body_bytes: int = 1 << 20  # one more byte gets 413, chunked or not
    header_timeout_s: float = 10.0  # from a connection's start (or a later request's first byte) to its headers
    body_timeout_s: float = 30.0  # from a request's headers to the end of its body; past it, 408
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    max_connections: int = 512  # open connections; one more gets 503
    shutdown_timeout_s: float = 25.0  # after SIGTERM, requests still running then are cancelled


class _Decoding:
    """One request in the scheduler, seen from the event loop: its events, up to its deadline."""

    def __init__(self, scheduler: Scheduler, prompt: list[int], settings, most: int, stops: list[str],
                 decode: Callable[[list[int]], str], limits: ServerLimits, provisional: bool = False):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrived, self.limits, self.most = time.monotonic(), limits, most
        self.stop, self.decode = StopScan(stops), decode
        self.provisional = ProvisionalView(decode, most)
        self.alternatives = settings.logprobs  # None: the request asks for no logprobs
        self.token_logprobs: list = []  # of the completion's ids so far, where it asks (TokenLogprob)
        try:
            self.ticket = scheduler.submit(prompt, settings,
                                           lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event),
                                           provisional)
        except QueueFull as error:
            raise ApiError(429, str(error), code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as error:
            raise ApiError(503, str(error), code="shutting_down", kind="server_error") from None

    async def pieces(self) -> AsyncIterator[tuple[str, list[int], str | None] | Provisional]:
        """(new text, its token ids, finish reason) per committed block: cut at the most tokens asked for
        and before the first stop string (`StopScan`: text that may begin one waits for the next block);
        between them, for a request with `provisional`, each new snapshot of the block being decoded."""
        ids, released = [], 0  # the completion's ids so far, and how many of them went out
        try:
            while True:
                event = await self._next()
                if isinstance(event, Failed):
                    raise _failure(event.error)
                if isinstance(event, Finished):
                    return
                if isinstance(event, BlockProgress):
                    shown = self.provisional.show(event, ids)
                    if shown is not None:
                        yield shown
                    continue
                new = event.token_ids[:max(0, self.most - len(ids))]
                ids += new
                self.token_logprobs += (event.logprobs or [])[:len(new)]
                cut = len(new) < len(event.token_ids)
                reason = "length" if cut else event.finish_reason or ("length" if len(ids) >= self.most else None)
                so_far = self.decode(ids)
                piece, stopped = self.stop.release(so_far, done=reason is not None)
                reason = "stop" if stopped else reason
                upto = len(ids) if self.stop.sent == len(so_far) else tokens_spanning(self.decode, ids, self.stop.sent)
                if piece or upto > released or reason:
                    yield piece, ids[released:upto], reason
                released = upto
                if reason is not None:
                    return
        finally:
            self.ticket.cancel()  # a row still running (cut, stopped, timed out, or its client gone) leaves the batch

    async def _next(self):
        left = self.arrived + self.limits.request_timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(self.events.get(), max(0.0, left))
        except TimeoutError:
            raise ApiError(504, f"the request took longer than its limit of {self.limits.request_timeout_s:g} s",
                           code="timeout", kind="timeout_error") from None


def _failure(error: BaseException) -> ApiError:
    if isinstance(error, DlmrtError):
        return ApiError(400, str(error), code="invalid_value")
    return ApiError(500, f"the request failed inside dlmrt ({type(error).__name__}: {error})", code="internal_error",
                    kind="server_error")


def create_app(model, backend: Backend, server_limits: ServerLimits = ServerLimits(), model_name: str | None = None,
               chat_template: ChatTemplate | None = None, leader: Leader | None = None,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The API over `backend`; `model` encodes and decodes text and gives the defaults. `leader`: on rank 0
    of a tensor-parallel model, its link to the other ranks, which replay its batches and stop with it.
    `allowed_origins`: the web origins whose pages may call it from a browser (`dlmrt.serve.cors`)."""
    name = model_name or model.name
    scheduler = Scheduler(backend, server_limits.max_queue,
                          open_batch=open_batch if leader is None else leader.open_batch)
    metrics = ServerMetrics(scheduler)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        logger.info("serving %s: %s, mode %s, max batch %d", name, type(backend).__name__, backend.executor.mode,
                    backend.ladder.max_batch)
        # What startup built (the model, torch, the libraries: some 340,000 objects with the tiny model) leaves
        # the collector's full passes, each of which held the event loop, /health too, for 0.6 s on 2 cores
        gc.freeze()
        yield
        await asyncio.to_thread(scheduler.stop)  # uvicorn has let the requests it holds finish
        if leader is not None:
            await asyncio.to_thread(leader.stop)
        gc.unfreeze()

    app = FastAPI(title="dlmrt", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    def count(error: ApiError) -> None:
        metrics.rejected.labels(error.code or str(error.status)).inc()

    def answer(error: ApiError):
        count(error)
        return error.response()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return answer(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return answer(_failure(error))

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, error: HTTPException):
        """The router's own refusals (an unknown path, a method a path does not take), in OpenAI's shape."""
        path, method = request.url.path, request.method
        if error.status_code == 404:
            refusal = ApiError(404, f"there is no {path}: the endpoints are {', '.join(ENDPOINTS)}", code="not_found")
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            refusal = ApiError(405, f"{path} does not take {method}: use {allowed}", code="method_not_allowed")
        else:
            refusal = ApiError(error.status_code, str(error.detail), code=f"http_{error.status_code}",
                               kind="invalid_request_error" if error.status_code < 500 else "server_error")
        response = answer(refusal)
        response.headers.update(error.headers or {})
        return response

    app.add_middleware(BodyLimit, max_bytes=server_limits.max_body_bytes, timeout_s=server_limits.body_timeout_s,
                       refused=lambda code: metrics.rejected.labels(code).inc())
    if allowed_origins:  # outside the body's limit, so that a page of an allowed origin can read its 413 too
        app.add_middleware(Cors, origins=allowed_origins)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "dlmrt"}]}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    token_text = _token_text(model)
    scorer = Scorer(backend)

    def parsed(kind: type[OpenAIRequest], body: bytes) -> OpenAIRequest:
        """The request, parsed and checked for its model and the values dlmrt cannot honour."""
        request = parse_request(kind, body)
        if request.model != name:
            raise ApiError(404, f"the model {request.model!r} does not exist: this server runs {name!r}",
                           param="model", code="model_not_found")
        request.refuse_unsupported()
        return request

    def admitted(request: OpenAIRequest):
        """(its prompt ids, settings, the most tokens to return): every check before any compute."""
        if isinstance(request, ChatRequest):
            prompt, most = _rendered(chat_template, name, request), request.most_tokens
        else:
            prompt, most = request.prompt, request.max_tokens
        return _prepare(model, backend, request, prompt, most)

    async def received(http: Request, kind: type[OpenAIRequest]) -> OpenAIRequest:
        require_json(http.headers.get("content-type"))
        return await run_in_threadpool(parsed, kind, await http.body())

    async def start(request: OpenAIRequest) -> tuple[_Decoding, list[int]]:
        """The request's decoding and its prompt ids. Parsing, templating and tokenizing run in a worker
        thread: a megabyte prompt takes seconds to tokenize, and the event loop serves the others."""
        ids, settings, most = await run_in_threadpool(admitted, request)
        return _Decoding(scheduler, ids, settings, most, request.stop, lambda ids: _text(model, ids),
                         server_limits, request.stream_provisional), ids

    async def finished(decoding: _Decoding) -> tuple[str, list[int], str]:
        completion, ids, reason = "", [], None
        async for piece, piece_ids, reason in decoding.pieces():
            completion, ids = completion + piece, ids + piece_ids
        metrics.latency.observe(time.monotonic() - decoding.arrived)
        return completion, ids, reason

    async def sse(decoding: _Decoding, header: dict, choice, prompt_tokens: int, include_usage: bool
                  ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per block that released text or tokens (and, with provisional
        snapshots, a chunk per snapshot with empty text and the snapshot in its `dlmrt` object), where
        `include_usage` a last chunk with no choices and the usage, then `[DONE]`; an error as its own
        event. Closing the stream (the client went away) cancels the row at its next K-step boundary."""
        first, returned, committed = True, 0, False
        no_usage = {"usage": None} if include_usage else {}  # as OpenAI, on every chunk but the last
        try:
            async for item in decoding.pieces():
                if isinstance(item, Provisional):
                    event = {**header, "choices": [choice("", [], None, first)], **no_usage, **item.extension()}
                    yield f"data: {json.dumps(event)}\n\n"
                    first = False
                    continue
                piece, ids, reason = item
                if not committed:
                    metrics.first_block.observe(time.monotonic() - decoding.arrived)
                event = {**header, "choices": [choice(piece, ids, reason, first)], **no_usage}
                yield f"data: {json.dumps(event)}\n\n"
                first, committed, returned = False, True, returned + len(ids)
            metrics.latency.observe(time.monotonic() - decoding.arrived)
            if include_usage:
                yield f"data: {json.dumps({**header, 'choices': [], 'usage': usage(prompt_tokens, returned)})}\n\n"
        except ApiError as error:
            count(error)
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    def streamed(request: OpenAIRequest, decoding: _Decoding, header: dict, prompt: list[int], choice):
        return StreamingResponse(sse(decoding, header, choice, len(prompt), request.include_usage),
                                 media_type="text/event-stream")

    def logprobs_of(decoding: _Decoding, shape: Callable[[list[int], list], dict]) -> Callable[[list[int]], dict]:
        """The logprobs of each next run of the completion's ids, in `shape` (None where not asked)."""
        taken = 0

        def take(ids: list[int]) -> dict | None:
            nonlocal taken
            entries = decoding.token_logprobs[taken:taken + len(ids)]
            taken += len(ids)
            return shape(ids, entries) if decoding.alternatives is not None else None
        return take

    async def scored(request: CompletionRequest) -> dict:
        """echo with max_tokens 0: the prompt, scored by the denoiser (`dlmrt.runtime.scoring`) on the
        scheduler's worker, between two blocks; the prompt is tokenized in a worker thread."""
        alternatives = request.alternatives()
        ids, block = await run_in_threadpool(_scoring_input, model, backend, request)
        logprobs = None
        if alternatives is not None:
            try:
                entries = await asyncio.wrap_future(
                    scheduler.run_between_blocks(lambda: scorer.score(ids, block, alternatives)))
            except ShuttingDown as error:
                raise ApiError(503, str(error), code="shutting_down", kind="server_error") from None
            except DlmrtError as error:
                raise ApiError(400, f"prompt: {error}", param="prompt", code="invalid_value") from None
            logprobs = CompletionLogprobs(token_text, alternatives).take(ids, entries)
        echoed = request.prompt if isinstance(request.prompt, str) else _text(model, ids)
        return {**reply_header("text_completion", name), "choices": [completion_choice(echoed, [], "length", logprobs)],
                "usage": usage(len(ids), 0)}

    @app.post("/v1/completions")
    async def completions(http: Request):
        request = await received(http, CompletionRequest)
        if request.scores:
            return await scored(request)
        decoding, prompt = await start(request)
        header = reply_header("text_completion", name)
        logprobs = logprobs_of(decoding, CompletionLogprobs(token_text, decoding.alternatives or 0).take)
        if request.stream:
            return streamed(request, decoding, header, prompt,
                            lambda piece, ids, reason, first: completion_choice(piece, ids, reason, logprobs(ids)))
        completion, ids, reason = await finished(decoding)
        return {**header, "choices": [completion_choice(completion, ids, reason, logprobs(ids))],
                "usage": usage(len(prompt), len(ids))}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        request = await received(http, ChatRequest)
        decoding, prompt = await start(request)
        logprobs = logprobs_of(decoding, lambda ids, entries: chat_logprobs(ids, entries, token_text,
                                                                            decoding.alternatives or 0))
        if request.stream:
            return streamed(request, decoding, reply_header("chat.completion.chunk", name), prompt,
                            lambda piece, ids, reason, first: chat_delta(piece, reason, first, logprobs(ids)))
        content, ids, reason = await finished(decoding)
        return {**reply_header("chat.completion", name), "choices": [chat_choice(content, reason, logprobs(ids))],
                "usage": usage(len(prompt), len(ids))}

    return app


ENDPOINTS = ("GET /health", "GET /v1/models", "GET /metrics", "POST /v1/completions", "POST /v1/chat/completions")


def _rendered(chat_template: ChatTemplate | None, name: str, request: ChatRequest) -> str:
    """The chat's messages through the model's template."""
    if chat_template is None:
        raise ApiError(400, f"{name} has no chat template (no chat_template in its tokenizer_config.json): "
                            f"use /v1/completions with a prompt", param="messages", code="no_chat_template")
    try:
        return chat_template.render([m.model_dump(exclude_none=True) for m in request.messages])
    except DlmrtError as error:
        raise ApiError(400, str(error), param="messages", code="invalid_value") from None


# What a settings or prompt check names (the CLI's spelling), and the request field it is about
_FIELDS_NAMED = (("logprobs", "logprobs"),
                 ("prompt", "prompt"), ("gen-length", "gen_length"), ("block-length", "block_length"),
                 ("policy", "policy"), ("threshold", "threshold"), ("steps", "steps"), ("cache", "cache"),
                 ("temperature", "temperature"), ("seed", "seed"))


def _param_named(message: str, request: OpenAIRequest) -> str | None:
    """The request field a check's message is about (None when it names none)."""
    for words, field in _FIELDS_NAMED:
        if message.startswith(words) or f" {words}" in message:
            if field == "prompt" and isinstance(request, ChatRequest):
                return "messages"
            if field == "gen_length" and request.gen_length is None:
                return "max_tokens" if request.max_tokens is not None else None
            return field
    return None


def _text(model, ids: list[int]) -> str:
    return text.decode(model, ids) or ""


def _token_text(model) -> Callable[[int], str]:
    """A token's own text, special tokens included (its id, where the model has no tokenizer)."""
    if model.tokenizer is None:
        return str
    return lambda token: model.tokenizer.decode([token], skip_special_tokens=False)


def _scoring_input(model, backend: Backend, request: CompletionRequest) -> tuple[list[int], int]:
    """(the prompt's ids, the block length) of a request that scores its prompt; every check before any compute."""
    from dlmrt.runtime.scoring import check_scorable, check_text

    try:
        check_scorable(backend.spec)
    except DlmrtError as error:
        raise ApiError(400, f"echo: {error}", param="echo", code="unsupported_value") from None
    block = request.block_length or model.generation_config.get("block_length") or model.default_block_length
    try:
        ids = text.encode(model, request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        check_text(backend, ids)
    except DlmrtError as error:
        raise ApiError(400, f"prompt: {error}", param="prompt", code="invalid_value") from None
    return ids, block or len(ids)


def _prepare(model, backend: Backend, request: OpenAIRequest, prompt: str | list[int], wanted: int | None):
    """(prompt ids, settings, the most tokens to return) for a request; every check before any compute."""
    from dlmrt.runtime.settings import check_request, settings_with_defaults

    if wanted is not None and request.gen_length is not None:
        raise ApiError(400, "give max_tokens or gen_length, not both", param="gen_length")
    wanted = wanted or request.gen_length
    block = request.block_length or model.generation_config.get("block_length") or model.default_block_length
    gen_length = None if wanted is None else (-(-wanted // block) * block if block else wanted)
    try:
        ids = text.encode(model, prompt) if isinstance(prompt, str) else list(prompt)
        settings = settings_with_defaults(
            model, gen_length=gen_length, block_length=request.block_length, policy=request.policy,
            steps=request.steps, remasking="low_confidence", threshold=request.threshold, factor=None,
            confidence="prob", minimal_topk=1, editing_threshold=None, max_post_steps=None, preset=None,
            entropy_bound=None, cache=request.cache or "none", max_block_steps=None,
            temperature=request.temperature or 0.0, cfg_scale=0.0, seed=request.seed or 0, steps_per_sync=None)
        settings = dataclasses.replace(settings, logprobs=request.alternatives())
        check_request(backend.spec, [ids], settings)
    except DlmrtError as error:
        raise ApiError(400, str(error), param=_param_named(str(error), request), code="invalid_value") from None
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty", param="prompt")
    return ids, settings, wanted or settings.gen_length
