"""The transport's limits (dlmrt.serve.transport) on a real loopback socket, against clients that send too
much, too slowly or not at all: each answered in OpenAI's error shape, or closed, within its limit."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

import httpx  # noqa: E402

import dlmrt  # noqa: E402
from dlmrt.core.chat_template import load_chat_template  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import ServerLimits, create_app  # noqa: E402
from live_server import LiveServer, dlmrt_serve  # noqa: E402

LIMITS = ServerLimits(max_body_bytes=2 << 20, header_timeout_s=0.5, body_timeout_s=0.5)
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def live(model):
    app = create_app(model, TorchBackend(model, mode="eager"), LIMITS,
                     chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR))
    with LiveServer(app, LIMITS) as server:
        yield server


def connect(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=5)


def answer(sock: socket.socket) -> tuple[int, dict | None]:
    """The status and JSON body of the response on `sock`, read to the connection's close (5 s at most)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else 0
    return status, json.loads(body) if body else None


def openai_error(body: dict, code: str) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == code and body["error"]["message"], body
    return body["error"]


def health_answer(sock: socket.socket) -> bytes:
    """/health's whole response on a connection kept open."""
    received = b""
    while not received.endswith(b'{"status":"ok"}'):
        received += sock.recv(4096)
    return received


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


def test_a_chunked_body_is_refused_with_413_as_it_crosses_the_limit(live):
    """The body never ends (no last chunk): the 413 comes from the bytes counted so far. Its last chunk
    is the one byte past the limit, so that nothing the server has not read is left when it closes (a
    client still sending then may see a reset instead: docs/serving.md)."""
    body = b'{"model": "tiny-llada", "prompt": "' + b"1" * LIMITS.max_body_bytes
    with connect(live) as sock:
        sock.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n")
        for start in range(0, LIMITS.max_body_bytes, 64 * 1024):
            piece = body[start:min(start + 64 * 1024, LIMITS.max_body_bytes)]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"1\r\n1\r\n")
        started = time.monotonic()
        status, body = answer(sock)
    assert status == 413 and "more than the limit of 2097152" in openai_error(body, "body_too_large")["message"]
    assert time.monotonic() - started < 2
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert 'dlmrt_rejected_requests_total{reason="body_too_large"}' in httpx.get(f"{live.url}/metrics").text


def test_a_declared_length_over_the_limit_is_refused_before_the_body(live):
    with connect(live) as sock:
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % (LIMITS.max_body_bytes + 1))
        status, body = answer(sock)
    assert status == 413 and openai_error(body, "body_too_large")


def test_health_answers_within_100_ms_while_a_1_mb_prompt_is_refused(model):
    """Parsing and tokenizing the megabyte (a second or more here) run in a worker thread, not on the loop.
    The server runs as its own process, so that this client's timing shares no interpreter with it."""
    with dlmrt_serve("--max-body-bytes", str(2 << 20)) as (_, port):
        url, done = f"http://127.0.0.1:{port}", {}

        def big():
            body = {"model": model.name, "prompt": "1" * 1_000_000}
            done["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        asking = threading.Thread(target=big)
        latencies = []
        with httpx.Client(base_url=url, timeout=10) as client:
            asking.start()
            while asking.is_alive():
                started = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)
        asking.join()
    refused = done["response"]
    assert refused.status_code == 400 and "more than the model's context" in refused.json()["error"]["message"]
    assert len(latencies) >= 20, latencies  # the refusal took a while: /health was asked throughout
    assert max(latencies) < 0.1, f"/health took {max(latencies) * 1000:.0f} ms behind the big prompt"


HALF_HEADERS = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-"
HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


@pytest.mark.parametrize("first", [None, "answered", "pipelined"])
def test_half_sent_headers_get_408_and_the_connection_closes(live, first):
    """On a fresh connection, after a request answered on it (kept alive), or pipelined behind one."""
    with connect(live) as sock:
        if first == "answered":
            sock.sendall(HEALTH)
            assert health_answer(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        sock.sendall(HEALTH + HALF_HEADERS if first == "pipelined" else HALF_HEADERS)
        if first == "pipelined":  # the whole first request is answered, then the half second one times out
            assert health_answer(sock).startswith(b"HTTP/1.1 200 ")
        status, body = answer(sock)
    assert status == 408 and openai_error(body, "header_timeout")
    assert time.monotonic() - started < LIMITS.header_timeout_s + 1.5


def test_a_connection_that_sends_nothing_is_closed(live):
    with connect(live) as sock:
        started = time.monotonic()
        assert sock.recv(1024) == b""
    assert time.monotonic() - started < LIMITS.header_timeout_s + 1.5


def test_a_half_sent_body_gets_408_and_the_connection_closes(live, model):
    payload = json.dumps({"model": model.name, "prompt": "add:762+139="}).encode()
    with connect(live) as sock:
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % len(payload) + payload[:len(payload) // 2])
        started = time.monotonic()
        status, body = answer(sock)
    assert status == 408 and openai_error(body, "body_timeout")
    assert time.monotonic() - started < LIMITS.body_timeout_s + 1.5


@pytest.mark.parametrize("method, path, body, status, code", [
    ("GET", "/v1/nothing", None, 404, "not_found"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("POST", "/v1/completions", b'{"model": "tiny-llada", "prompt": "\xff\xfe"}', 400, "invalid_json"),
    ("POST", "/v1/chat/completions", b'{"model": "tiny-llada", "messages": [', 400, "invalid_json"),
    ("POST", "/v1/completions", b'["model"]', 400, "model_type"),
], ids=["unknown route", "wrong method", "nested 100,000 deep", "not UTF-8", "cut short", "not an object"])
def test_framework_errors_are_openai_shaped(live, method, path, body, status, code):
    headers = {"content-type": "application/json"} if method == "POST" else {}
    response = httpx.request(method, f"{live.url}{path}", content=body, headers=headers, timeout=10)
    assert response.status_code == status and openai_error(response.json(), code)
    if status == 405:
        assert response.headers["allow"] == "POST"


@pytest.mark.parametrize("field, value", [("max_tokens", "16"), ("stream", "yes"), ("prompt", 5)])
def test_the_issue_s_coercions_are_400s_naming_the_field_on_loopback(live, field, value):
    """`"max_tokens": "16"` was taken as 16 and `"stream": "yes"` as true; a prompt of the wrong type was
    named `prompt.str` (every field's types: test_strict_types.py)."""
    body = {"model": "tiny-llada", "prompt": "add:1+2=", field: value}
    response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=10)
    error = response.json()["error"]
    assert response.status_code == 400 and set(error) == ERROR_KEYS and error["param"] == field, response.text


def test_unparseable_http_is_an_openai_shaped_400(live):
    with connect(live) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, body = answer(sock)
    assert status == 400 and openai_error(body, "invalid_http")


def test_a_connection_over_the_cap_gets_503_and_the_others_are_served(model):
    limits = ServerLimits(max_connections=2, header_timeout_s=5.0)
    with LiveServer(create_app(model, TorchBackend(model, mode="eager"), limits), limits) as live:
        held = [connect(live) for _ in range(2)]
        time.sleep(0.1)  # the server has counted them
        with connect(live) as third:
            third.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            status, body = answer(third)
        assert status == 503 and openai_error(body, "too_many_connections")["type"] == "server_error"
        for sock in held:
            sock.close()
        time.sleep(0.1)
        assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200


def test_sigterm_with_a_stalled_client_exits_0_by_the_shutdown_deadline(model):
    """`dlmrt serve` itself: a client holding half a body does not keep it alive past --shutdown-timeout,
    and a drained server exits with status 0, not as killed by the signal."""
    with dlmrt_serve("--shutdown-timeout", "1", "--body-timeout", "60") as (server, port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stalled:
            stalled.sendall(HEAD + b'content-length: 100\r\n\r\n{"model": ')
            time.sleep(0.2)
            started = time.monotonic()
            server.send_signal(signal.SIGTERM)
            status = server.wait(timeout=10)
            took = time.monotonic() - started
    assert status == 0, server.stdout.read().decode()[-2000:]
    assert 1.0 <= took < 5.0
