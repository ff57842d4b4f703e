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
error, the framework's own (404, 405) included, is OpenAI's error object (`dlmrt.serve.errors`).

The parts: the endpoints (`dlmrt.serve.routes`), a request's checks before any compute
(`dlmrt.serve.admission`), its decoding and streamed answer (`dlmrt.serve.streaming`), the error handlers
(`dlmrt.serve.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

from dlmrt.core.chat_template import ChatTemplate
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.scheduler import Scheduler
from dlmrt.serve.cors import Cors
from dlmrt.serve.errors import install_handlers
from dlmrt.serve.metrics import ServerMetrics
from dlmrt.serve.routes import Routes
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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        logger.info("serving %s: %s, mode %s, max batch %d", name, type(backend).__name__, backend.mode,
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
    install_handlers(app, metrics)
    app.add_middleware(BodyLimit, max_bytes=server_limits.max_body_bytes, timeout_s=server_limits.body_timeout_s,
                       refused=lambda code: metrics.rejected.labels(code).inc())
    if allowed_origins:  # outside the body's limit, so that a page of an allowed origin can read its 413 too
        app.add_middleware(Cors, origins=allowed_origins)
    Routes(model, backend, scheduler, metrics, name, chat_template, server_limits.request_timeout_s).add_to(app)
    return app


def build_app(open_model, model_dir, *, limits: ServerLimits, served_model_name: str | None,
              allowed_origins: tuple[str, ...] = (), parallel=None, leader: Leader | None = None) -> FastAPI:
    """The app over the (model, backend) that `open_model(parallel)` opens, with the chat template of
    `model_dir` (None: the tiny model's): what `dlmrt serve` runs, and what each of its replicas builds (in its
    own process) under --replicas. On rank 0 of a split model, `parallel` is its (ParallelPlan, Ranks), and
    `leader` its link to the ranks that follow its batches."""
    from dlmrt import TINY_MODEL_DIR
    from dlmrt.core.chat_template import load_chat_template

    model, backend = open_model(parallel)
    return create_app(model, backend, limits, served_model_name,
                      chat_template=load_chat_template(model_dir or TINY_MODEL_DIR), leader=leader,
                      allowed_origins=allowed_origins)
