"""The server's limits on its clients at the transport: body size, header and body deadlines, idle
connections, open connections, and the shutdown deadline, each answered in OpenAI's error shape.

    server = uvicorn.Server(server_config(app, limits, host="127.0.0.1", port=8000))

Where each limit lives, and why there:

- **Headers** (`header_timeout_s`): `LimitedH11Protocol`, uvicorn's h11 protocol with a deadline from
  the connection's start (or the first byte of a later request on it) to the end of the request's
  headers. uvicorn has none: its keep-alive timer runs only between requests and stops at the first
  byte, and a fresh connection has no timer at all, so half the headers held a connection forever.
  Past the deadline, a connection that sent part of a request gets 408 and is closed; one that sent
  nothing is closed, as uvicorn closes an idle keep-alive connection.
- **Open connections** (`max_connections`): the same protocol. A connection over the cap is answered
  503 (code "too_many_connections") to its first request and closed. uvicorn's `limit_concurrency`
  would answer in plain text, and counts requests as well as connections.
- **Malformed HTTP** (a request line or headers h11 cannot parse, or headers over h11's 16 KiB): the
  same protocol answers uvicorn's 400 in OpenAI's shape.
- **Body** (`max_body_bytes`, `body_timeout_s`): `BodyLimit`, an ASGI middleware that reads the whole
  body before the app sees it. It counts bytes as they arrive, chunked or not, and answers 413 the
  moment the count (or a declared Content-Length) passes the limit, without reading the rest; a body
  not complete within `body_timeout_s` of its headers gets 408. Both close the connection. It sits in
  ASGI because the app is what answers, and it holds at most the limit in memory.
- **Idle keep-alive** (`keep_alive_s`): uvicorn's `timeout_keep_alive`, which suffices.
- **Shutdown** (`shutdown_timeout_s`): uvicorn's `timeout_graceful_shutdown`: past it, the requests
  still running are cancelled (their rows leave the batch) and the server exits. `dlmrt serve` exits
  with status 0 after a SIGTERM (`dlmrt.cli.serve`).

A client still sending when it gets 413 may see the connection reset before it reads the answer: the
server closes rather than read a body it has refused. The body's refusals count in `/metrics`
(`dlmrt_rejected_requests_total`); the protocol's (header deadline, connection cap, 400) come before any
request reaches the app, and are in uvicorn's log only.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    import uvicorn

    from dlmrt.serve.app import ServerLimits


def error_body(message: str, code: str, kind: str) -> bytes:
    """OpenAI's error object, for the answers given below the app (`dlmrt.serve.schema.ApiError` above it)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers outside h11's request cycle."""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode("ascii") + body


async def _answer(send, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
    body = error_body(message, code, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: the request's whole body, read within `timeout_s` of its headers and at most
    `max_bytes` long, handed to `app` as one message (later receives go to the client, for its disconnect).
    `refused` hears the code of each refusal (the server's metrics)."""

    def __init__(self, app, max_bytes: int, timeout_s: float, refused: Callable[[str], None]):
        self.app, self.max_bytes, self.timeout_s, self.refused = app, max_bytes, timeout_s, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send, f"the body has {int(declared)} bytes")
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                self.refused("body_timeout")
                return await _answer(send, 408, f"the request body did not arrive within {self.timeout_s:g} s of "
                                                f"its headers", "body_timeout")
            if message["type"] == "http.disconnect":
                return  # the client left before its body ended: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send, f"the body passed {self.max_bytes} bytes")
            more = message.get("more_body", False)
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _too_large(self, send, what: str) -> None:
        self.refused("body_too_large")
        await _answer(send, 413, f"{what}, more than the limit of {self.max_bytes}: send a shorter prompt",
                      "body_too_large")


async def _too_many_connections(scope, receive, send) -> None:
    await _answer(send, 503, "the server has as many open connections as it takes: retry later, or reuse a "
                             "connection", "too_many_connections", kind="server_error")


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers, a cap on open connections, and
    its own 400 in OpenAI's shape."""

    def __init__(self, *args, header_timeout_s: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.app = _too_many_connections  # its first request gets the 503 and the connection closes
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc) -> None:
        self._stop_header_deadline()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline while a request's headers are awaited (h11's client state IDLE) with nothing else
        timing the connection; disarm it once they are in."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_header_deadline()
            return
        if self.conn.trailing_data[0]:  # a request has begun (pipelined behind the last): not idle any more
            self._unset_keepalive_if_required()
        if self.header_deadline is None and self.timeout_keep_alive_task is None:
            self.header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request came
            message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
            self.logger.warning("%s: %s: answered 408", "%s:%d" % self.client if self.client else "a client", message)
            self.transport.write(_raw_response(408, "Request Timeout",
                                               error_body(message, "header_timeout", "invalid_request_error")))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        message = f"{msg} (a request line or headers HTTP/1.1 cannot parse, or headers over 16 KiB)"
        self.transport.write(_raw_response(400, "Bad Request", error_body(message, "invalid_http",
                                                                          "invalid_request_error")))
        self.transport.close()


def server_config(app, limits: ServerLimits, **options) -> uvicorn.Config:
    """uvicorn's configuration for `app` under `limits` (`options`: host, port, log settings)."""
    import uvicorn

    protocol = functools.partial(LimitedH11Protocol, header_timeout_s=limits.header_timeout_s,
                                 max_connections=limits.max_connections)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=limits.shutdown_timeout_s, **options)
