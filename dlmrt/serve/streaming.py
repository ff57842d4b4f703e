"""A request's decoding seen from the event loop, and how its answer goes out: whole, or as server-sent events
with one event per committed block (and, with `stream_provisional`, one per snapshot of the block being
decoded: `dlmrt.serve.provisional`), ending in `data: [DONE]`. A completion ends before its first `stop`
string (`dlmrt.serve.stop_strings`); a stream holds back the text that may begin one until the next block
shows it does not."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from dlmrt.runtime.running_batch import BlockProgress
from dlmrt.runtime.scheduler import Failed, Finished, QueueFull, Scheduler, ShuttingDown
from dlmrt.serve.errors import count, failure
from dlmrt.serve.metrics import ServerMetrics
from dlmrt.serve.provisional import Provisional, ProvisionalView
from dlmrt.serve.schema import ApiError, usage
from dlmrt.serve.stop_strings import StopScan, tokens_spanning


class Decoding:
    """One request in the scheduler, seen from the event loop: its events, up to its deadline."""

    def __init__(self, scheduler: Scheduler, prompt: list[int], settings, most: int, stops: list[str],
                 decode: Callable[[list[int]], str], timeout_s: float, provisional: bool = False):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrived, self.timeout_s, self.most = time.monotonic(), timeout_s, most
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
                    raise failure(event.error)
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
        left = self.arrived + self.timeout_s - time.monotonic()
        try:
            return await asyncio.wait_for(self.events.get(), max(0.0, left))
        except TimeoutError:
            raise ApiError(504, f"the request took longer than its limit of {self.timeout_s:g} s",
                           code="timeout", kind="timeout_error") from None


async def finished(decoding: Decoding, metrics: ServerMetrics) -> tuple[str, list[int], str]:
    """The whole completion: its text, its token ids and its finish reason."""
    completion, ids, reason = "", [], None
    async for piece, piece_ids, reason in decoding.pieces():
        completion, ids = completion + piece, ids + piece_ids
    metrics.latency.observe(time.monotonic() - decoding.arrived)
    return completion, ids, reason


def streamed(decoding: Decoding, metrics: ServerMetrics, header: dict, choice, prompt_tokens: int,
             include_usage: bool) -> StreamingResponse:
    """The completion as server-sent events; `choice(piece, ids, reason, first)` is a chunk's choice."""
    return StreamingResponse(_events(decoding, metrics, header, choice, prompt_tokens, include_usage),
                             media_type="text/event-stream")


async def _events(decoding: Decoding, metrics: ServerMetrics, header: dict, choice, prompt_tokens: int,
                  include_usage: bool) -> AsyncIterator[str]:
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
        count(metrics, error)
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"
