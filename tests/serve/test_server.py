"""`dlmrt serve`'s HTTP API (dlmrt.serve.app) on the tiny model, through FastAPI's test client."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from fastapi.testclient import TestClient  # noqa: E402

import dlmrt  # noqa: E402
from dlmrt.runtime import EntropyBound, Fixed, GenerationSettings, Generator, text  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import ServerLimits, create_app  # noqa: E402


def alone(model, prompt: str, gen_length: int = 16, block: int = 8) -> list[int]:
    """What the Generator gives the prompt alone, with the tiny model's defaults (fixed policy, blocks of 8)."""
    ids = text.encode(model, prompt)
    settings = GenerationSettings(gen_length, block, Fixed())
    return Generator(model, mode="eager").generate([ids], settings).rows[0].token_ids


def test_health_and_models(client, model):
    assert client.get("/health").json() == {"status": "ok"}
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [model.name]


def test_a_completion_is_the_generators_tokens(client, model):
    reply = client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="}).json()
    expected = alone(model, "add:762+139=")
    (choice,) = reply["choices"]
    assert choice["token_ids"] == expected and choice["text"] == text.decode(model, expected)
    assert choice["finish_reason"] == "stop" and reply["object"] == "text_completion"
    assert reply["usage"]["completion_tokens"] == len(expected)


def test_a_seed_makes_sampling_reproducible(client, model):
    """At temperature 1.5 the tiny model's answer to "rev:abcdefghij=" varies with the seed."""
    def sampled(seed: int) -> str:
        body = {"model": model.name, "prompt": "rev:abcdefghij=", "temperature": 1.5, "seed": seed}
        return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    assert sampled(7) == sampled(7) != sampled(8)


def test_max_tokens_cuts_the_completion(client, model):
    reply = client.post("/v1/completions", json={"model": model.name, "prompt": "rev:abcdefghij=",
                                                  "max_tokens": 3}).json()
    (choice,) = reply["choices"]
    assert choice["token_ids"] == alone(model, "rev:abcdefghij=", 8)[:3] and choice["finish_reason"] == "length"


def test_streaming_sends_a_block_at_a_time_and_ends_with_done(client, model):
    body = {"model": model.name, "prompt": "rev:abcdefghij=", "stream": True, "block_length": 4}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert sum((c["token_ids"] for c in chunks), []) == alone(model, "rev:abcdefghij=", block=4)
    assert len(chunks) >= 2 and all(len(c["token_ids"]) <= 4 for c in chunks)  # an event per block of 4
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


@pytest.mark.parametrize("body, status, param, message", [
    ({"model": "tiny-llada", "prompt": "x", "temprature": 1}, 400, "temprature", "unknown field"),
    ({"model": "tiny-llada", "prompt": ""}, 400, "prompt", "at least 1"),
    ({"model": "tiny-llada", "prompt": "x", "max_tokens": -4}, 400, "max_tokens", "greater than or equal to 0"),
    ({"model": "tiny-llada", "prompt": "x", "gen_length": 4096}, 400, "prompt", "more than the model's context"),
    ({"model": "tiny-llada", "prompt": "1" * 60}, 400, "prompt", "more than the model's context"),
    ({"model": "tiny-llada", "prompt": [3, 99999]}, 400, "prompt", "outside the vocabulary"),
    ({"model": "tiny-llada", "prompt": "x", "policy": "greedy"}, 400, "policy", "unknown policy"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": "tiny-llada", "prompt": "x", "cache": "all"}, 400, "cache", "Input should be"),
])
def test_bad_requests_get_one_openai_error(client, body, status, param, message):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"]
    assert client.get("/health").status_code == 200  # still serving


def test_malformed_json_and_oversized_bodies(client):
    response = client.post("/v1/completions", content=b'{"model": "tiny-llada", "prompt": ',
                           headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = client.post("/v1/completions", json={"model": "tiny-llada", "prompt": "x" * 5000})
    assert response.status_code == 413 and "more than the limit of 4096" in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("log_level", [None, "warning"], ids=["default", "warning"])
def test_dlmrt_serve_answers_on_loopback_logs_and_stops_on_sigterm(log_level):
    """The command itself: uvicorn on 127.0.0.1 at a free port, /health answers, SIGTERM ends it. At the
    default --log-level (info) it logs the model, uvicorn's ready line and a line a request; at warning,
    none of them."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    levels = [] if log_level is None else ["--log-level", log_level]
    server = subprocess.Popen([sys.executable, "-m", "dlmrt.cli", "serve", "--mode", "eager", "--port", str(port),
                               *levels], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "NO_COLOR": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json() == {"status": "ok"}
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "tiny-llada", "prompt": "add:762+139="}).json()
        assert reply["choices"][0]["finish_reason"] == "stop"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0  # drained: not reported as killed by the signal
    finally:
        if server.poll() is None:
            server.kill()
    logged = [line for line in server.stdout.read().decode().splitlines() if line.startswith("INFO:")]
    expected = ["serving tiny-llada: TorchBackend, mode eager, max batch 64",
                f"Uvicorn running on http://127.0.0.1:{port}", '"GET /health HTTP/1.1" 200',
                '"POST /v1/completions HTTP/1.1" 200']
    if log_level is None:
        assert all(any(part in line for line in logged) for part in expected), logged
    else:
        assert logged == []


def test_a_request_past_its_time_limit_gets_504_and_leaves_the_batch(model):
    app = create_app(model, TorchBackend(model, mode="eager"), ServerLimits(request_timeout_s=1e-6))
    client = TestClient(app)
    response = client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="})
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    again = client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="})
    assert again.status_code == 504  # the server still takes requests
    assert wait_for(lambda: app.state.scheduler.running_rows == 0 and app.state.scheduler.waiting == 0)


def test_an_exception_inside_a_request_fails_it_alone(model, monkeypatch):
    from dlmrt.runtime.running_batch import RunningBatch

    client = TestClient(create_app(model, TorchBackend(model, mode="eager")), raise_server_exceptions=False)
    real = RunningBatch.add
    monkeypatch.setattr(RunningBatch, "add", lambda *args, **kwargs: 1 / 0)
    failed = client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="})
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert "ZeroDivisionError" in failed.json()["error"]["message"]
    monkeypatch.setattr(RunningBatch, "add", real)
    served = client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="})
    assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] == "stop"


def wait_for(condition, timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- chat ---------------------------------------------------------------------------------------------
def test_chat_renders_the_template_and_answers_as_the_completion(client, model):
    messages = [{"role": "system", "content": "ignored by the tiny template"}, {"role": "user", "content": "rev:abc="}]
    reply = client.post("/v1/chat/completions", json={"model": model.name, "messages": messages}).json()
    (choice,) = reply["choices"]
    assert reply["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == text.decode(model, alone(model, "rev:abc="))
    assert choice["finish_reason"] == "stop"


def test_chat_streams_deltas(client, model):
    body = {"model": model.name, "messages": [{"role": "user", "content": "rev:abcdefghij="}], "stream": True,
            "block_length": 4}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == text.decode(model, alone(model, "rev:abcdefghij=", block=4))


def test_chat_without_a_template_is_a_400(model):
    client = TestClient(create_app(model, TorchBackend(model, mode="eager")))  # no chat template
    response = client.post("/v1/chat/completions", json={"model": model.name,
                                                         "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "no_chat_template"


@pytest.mark.parametrize("messages, param", [([], "messages"), ([{"role": "user"}], "messages.0.content"),
                                             ([{"role": "robot", "content": "x"}], "messages.0.role")])
def test_bad_chat_messages_name_the_field(client, model, messages, param):
    response = client.post("/v1/chat/completions", json={"model": model.name, "messages": messages})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# -- metrics ------------------------------------------------------------------------------------------
def test_metrics_count_tokens_and_rejections(client, model):
    client.post("/v1/completions", json={"model": model.name, "prompt": "add:762+139="})
    client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in response.text.splitlines()
              if line and not line.startswith("#")}
    assert values['dlmrt_rejected_requests_total{reason="model_not_found"}'] >= 1
    assert values["dlmrt_generated_tokens_total"] >= len(alone(model, "add:762+139="))
    assert values["dlmrt_running_rows"] == 0 and values["dlmrt_queue_depth"] == 0
    assert 0 < values["dlmrt_tokens_per_forward"] and values["dlmrt_request_latency_seconds_count"] >= 1


def test_a_uniform_noise_model_is_served_in_one_batch():
    gemma = dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")
    client = TestClient(create_app(gemma, TorchBackend(gemma, mode="eager")))
    reply = client.post("/v1/completions", json={"model": gemma.name, "prompt": "sort:3142="})
    assert reply.status_code == 200, reply.text
    from dlmrt.runtime.settings import settings_with_defaults

    settings = settings_with_defaults(  # the model's defaults, as the server takes them
        gemma, gen_length=None, block_length=None, policy=None, steps=None, remasking="low_confidence",
        threshold=None, factor=None, confidence="prob", minimal_topk=1, editing_threshold=None, max_post_steps=None,
        preset=None, entropy_bound=None, cache="none", max_block_steps=None, temperature=0.0, cfg_scale=0.0, seed=0,
        steps_per_sync=None)
    assert isinstance(settings.policy, EntropyBound)
    expected = Generator(gemma, mode="eager").generate([text.encode(gemma, "sort:3142=")], settings).rows[0]
    assert reply.json()["choices"][0]["token_ids"] == expected.token_ids


def test_staggered_uniform_noise_requests_share_the_batch_and_get_their_tokens_alone():
    """Four DiffusionGemma requests, each submitted when the one before streams its first block (from
    the worker's delivery, so it joins at the next block boundary): they run side by side, at
    different blocks, and each gets the tokens it gets alone."""
    from dlmrt.runtime.scheduler import Finished, Scheduler

    gemma = dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")
    requests = [("sort:3142=", 48, 0, True), ("add:12+34=", 40, 1, True), ("sort:97=", 8, 2, False),
                ("add:5+6=", 16, 3, True)]
    settings = [GenerationSettings(gen_length, 8, EntropyBound(steps=12), seed=seed, ignore_eos=ignore_eos)
                for _, gen_length, seed, ignore_eos in requests]
    scheduler = Scheduler(TorchBackend(gemma, mode="eager", max_batch=4))
    events, sharing = [[] for _ in requests], []

    def submit(index):
        scheduler.submit(text.encode(gemma, requests[index][0]), settings[index],
                         lambda event: deliver(index, event))

    def deliver(index, event):
        events[index].append(event)
        sharing.append(scheduler.running_rows)
        if len(events[index]) == 1 and index + 1 < len(requests):
            submit(index + 1)

    submit(0)
    for _ in range(200):
        if all(row and isinstance(row[-1], Finished) for row in events):
            break
        time.sleep(0.1)
    scheduler.stop(timeout=60)
    assert max(sharing) >= 3  # rows ran side by side
    alone = Generator(gemma, mode="eager")
    for index, (prompt, *_) in enumerate(requests):
        assert isinstance(events[index][-1], Finished), events[index][-1]
        expected = alone.generate([text.encode(gemma, prompt)], settings[index])
        assert events[index][-1].row.tokens == expected.tokens[0].tolist(), prompt
        streamed_ids = [t for event in events[index][:-1] for t in event.token_ids]
        assert streamed_ids == expected.rows[0].token_ids, prompt
