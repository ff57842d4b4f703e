"""The API's endpoints over one scheduler: `/health`, `/v1/models`, `/metrics`, `/v1/completions` (echo with
max_tokens 0 scores the prompt) and `/v1/chat/completions`.

A request's body is parsed, validated, tokenized and (chat) templated in a worker thread, so a large prompt
never holds the event loop, and with it `/health` and the streams of other requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from dlmrt.core.chat_template import ChatTemplate
from dlmrt.core.errors import DlmrtError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.scheduler import Scheduler, ShuttingDown
from dlmrt.runtime.scoring import Scorer
from dlmrt.serve import admission
from dlmrt.serve.logprobs import CompletionLogprobs, chat_logprobs
from dlmrt.serve.metrics import ServerMetrics
from dlmrt.serve.schema import (ApiError, ChatRequest, CompletionRequest, OpenAIRequest, chat_choice, chat_delta,
                                completion_choice, reply_header, require_json, usage)
from dlmrt.serve.streaming import Decoding, finished, streamed


class Routes:
    """What the endpoints share: the model served under `name`, its backend and scheduler, and the metrics."""

    def __init__(self, model, backend: Backend, scheduler: Scheduler, metrics: ServerMetrics, name: str,
                 chat_template: ChatTemplate | None, timeout_s: float):
        self.model, self.backend, self.scheduler, self.metrics = model, backend, scheduler, metrics
        self.name, self.chat_template, self.timeout_s = name, chat_template, timeout_s
        self.created = int(time.time())
        self.token_text = admission.token_text(model)
        self.scorer = Scorer(backend)

    def add_to(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.get("/metrics")(self.prometheus)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)

    async def health(self):
        return {"status": "ok"}

    async def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "dlmrt"}]}

    async def prometheus(self):
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def completions(self, http: Request):
        request = await self._received(http, CompletionRequest)
        if request.scores:
            return await self._scored(request)
        decoding, prompt = await self._start(request)
        header = reply_header("text_completion", self.name)
        logprobs = _logprobs_of(decoding, CompletionLogprobs(self.token_text, decoding.alternatives or 0).take)
        if request.stream:
            return streamed(decoding, self.metrics, header,
                            lambda piece, ids, reason, first: completion_choice(piece, ids, reason, logprobs(ids)),
                            len(prompt), request.include_usage)
        completion, ids, reason = await finished(decoding, self.metrics)
        return {**header, "choices": [completion_choice(completion, ids, reason, logprobs(ids))],
                "usage": usage(len(prompt), len(ids))}

    async def chat_completions(self, http: Request):
        request = await self._received(http, ChatRequest)
        decoding, prompt = await self._start(request)
        logprobs = _logprobs_of(decoding, lambda ids, entries: chat_logprobs(ids, entries, self.token_text,
                                                                             decoding.alternatives or 0))
        if request.stream:
            return streamed(decoding, self.metrics, reply_header("chat.completion.chunk", self.name),
                            lambda piece, ids, reason, first: chat_delta(piece, reason, first, logprobs(ids)),
                            len(prompt), request.include_usage)
        content, ids, reason = await finished(decoding, self.metrics)
        return {**reply_header("chat.completion", self.name), "choices": [chat_choice(content, reason, logprobs(ids))],
                "usage": usage(len(prompt), len(ids))}

    async def _received(self, http: Request, kind: type[OpenAIRequest]) -> OpenAIRequest:
        require_json(http.headers.get("content-type"))
        return await run_in_threadpool(admission.parsed, kind, await http.body(), self.name)

    async def _start(self, request: OpenAIRequest) -> tuple[Decoding, list[int]]:
        """The request's decoding and its prompt ids. Parsing, templating and tokenizing run in a worker
        thread: a megabyte prompt takes seconds to tokenize, and the event loop serves the others."""
        ids, settings, most = await run_in_threadpool(admission.admitted, self.model, self.backend,
                                                      self.chat_template, self.name, request)
        return Decoding(self.scheduler, ids, settings, most, request.stop,
                        lambda ids: admission.decoded(self.model, ids), self.timeout_s,
                        request.stream_provisional), ids

    async def _scored(self, request: CompletionRequest) -> dict:
        """echo with max_tokens 0: the prompt, scored by the denoiser (`dlmrt.runtime.scoring`) on the
        scheduler's worker, between two blocks; the prompt is tokenized in a worker thread."""
        alternatives = request.alternatives()
        ids, block = await run_in_threadpool(admission.scoring_input, self.model, self.backend, request)
        logprobs = None
        if alternatives is not None:
            try:
                entries = await asyncio.wrap_future(
                    self.scheduler.run_between_blocks(lambda: self.scorer.score(ids, block, alternatives)))
            except ShuttingDown as error:
                raise ApiError(503, str(error), code="shutting_down", kind="server_error") from None
            except DlmrtError as error:
                raise ApiError(400, f"prompt: {error}", param="prompt", code="invalid_value") from None
            logprobs = CompletionLogprobs(self.token_text, alternatives).take(ids, entries)
        echoed = request.prompt if isinstance(request.prompt, str) else admission.decoded(self.model, ids)
        return {**reply_header("text_completion", self.name),
                "choices": [completion_choice(echoed, [], "length", logprobs)], "usage": usage(len(ids), 0)}


def _logprobs_of(decoding: Decoding, shape: Callable[[list[int], list], dict]) -> Callable[[list[int]], dict]:
    """The logprobs of each next run of the completion's ids, in `shape` (None where not asked)."""
    taken = 0

    def take(ids: list[int]) -> dict | None:
        nonlocal taken
        entries = decoding.token_logprobs[taken:taken + len(ids)]
        taken += len(ids)
        return shape(ids, entries) if decoding.alternatives is not None else None
    return take
