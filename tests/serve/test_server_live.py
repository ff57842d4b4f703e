"""`dlmrt serve` on a real loopback socket (uvicorn in a thread): the official openai client, concurrent
requests batched continuously, a full queue, a client killed mid-stream, and draining at shutdown."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

import httpx  # noqa: E402

import dlmrt  # noqa: E402
from dlmrt.runtime.batch_resources import resources  # noqa: E402
from dlmrt.core.chat_template import load_chat_template  # noqa: E402
from dlmrt.runtime import GenerationSettings, Generator, text  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import ServerLimits, create_app  # noqa: E402
from live_server import LiveServer  # noqa: E402

PROMPTS = ["add:762+139=", "rev:abcdefghij=", "sort:3142=", "rev:abc=", "add:5+17=", "sort:987123="]


def slowed(backend, seconds: float):
    """`backend` with each run of steps taking at least `seconds` (so requests overlap in time)."""
    run = resources(backend).executor.run

    def slow_run(state, kind, steps):
        time.sleep(seconds)
        run(state, kind, steps)
    resources(backend).executor.run = slow_run
    return backend


def alone(model, prompt: str, **settings) -> list[int]:
    defaults = dict(gen_length=16, block_length=8)
    settings = GenerationSettings(**{**defaults, **settings})
    return Generator(model, mode="eager").generate([text.encode(model, prompt)], settings).rows[0].token_ids


def sse_events(response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_the_openai_client_works_unchanged(model):
    openai = pytest.importorskip("openai")
    app = create_app(model, TorchBackend(model, mode="eager"), chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model.name]
        completion = client.completions.create(model=model.name, prompt="add:762+139=")
        assert completion.choices[0].text == text.decode(model, alone(model, "add:762+139="))
        assert completion.choices[0].finish_reason == "stop" and completion.usage.completion_tokens > 0
        chat = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "rev:abc="}])
        assert chat.choices[0].message.content == text.decode(model, alone(model, "rev:abc="))
        streamed = client.completions.create(model=model.name, prompt="rev:abcdefghij=", stream=True,
                                             extra_body={"block_length": 4})
        pieces = [chunk.choices[0].text for chunk in streamed]
        assert "".join(pieces) == text.decode(model, alone(model, "rev:abcdefghij=", block_length=4))
        chat_stream = client.chat.completions.create(model=model.name, stream=True,
                                                     messages=[{"role": "user", "content": "sort:3142="}])
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream)
        assert content == text.decode(model, alone(model, "sort:3142="))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model.name, prompt="x", max_tokens=-1)


def test_the_openai_client_with_stop_seed_top_p_and_stream_options(model):
    """The tiny model answers "add:762+139=" with "0901" (a token a character): the stop string "1" leaves
    "090", 3 tokens after a prompt of 12."""
    openai = pytest.importorskip("openai")
    app = create_app(model, TorchBackend(model, mode="eager"), chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        asked = dict(model=model.name, stop=["1"], seed=3, top_p=1)
        completion = client.completions.create(prompt="add:762+139=", **asked)
        assert completion.choices[0].text == "090" and completion.choices[0].finish_reason == "stop"
        assert completion.usage.completion_tokens == 3
        sampled = [client.completions.create(model=model.name, prompt="rev:abcdefghij=", temperature=1.5, seed=seed,
                                             top_p=1).choices[0].text for seed in (7, 7, 8)]
        assert sampled[0] == sampled[1] != sampled[2]
        streamed = list(client.completions.create(prompt="add:762+139=", stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"block_length": 2}, **asked))
        assert "".join(chunk.choices[0].text for chunk in streamed[:-1]) == "090"
        assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 3
        chat = list(client.chat.completions.create(messages=[{"role": "user", "content": "add:762+139="}],
                                                   stream=True, stream_options={"include_usage": True}, **asked))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chat[:-1]) == "090"
        assert chat[-2].choices[0].finish_reason == "stop" and chat[-1].usage.total_tokens == 15
        with pytest.raises(openai.BadRequestError, match="nucleus"):
            client.completions.create(prompt="add:762+139=", model=model.name, top_p=0.9)


def test_concurrent_requests_batch_and_each_gets_its_tokens_alone(model):
    backend = slowed(TorchBackend(model, mode="eager", max_batch=8), 0.01)
    app = create_app(model, backend)
    prompts = PROMPTS + ["add:31+4=", "rev:xyz=", "sort:5511=", "add:999+1=", "rev:hello=", "sort:20="]
    temperatures = [0.0, 0.8] * 6  # sampled and greedy requests share the batch
    sizes = []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            sizes.append(app.state.scheduler.running_rows)
            time.sleep(0.005)

    with LiveServer(app) as live:
        watcher = threading.Thread(target=watch)
        watcher.start()

        def ask(index):
            time.sleep(0.03 * index)  # arrivals spread over the running batch's blocks
            body = {"model": model.name, "prompt": prompts[index], "block_length": 4, "gen_length": 16,
                    "seed": index, "temperature": temperatures[index]}
            return httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(ask, range(12)))
        watching.set()
        watcher.join()
    assert max(sizes) > 1  # requests shared the batch
    for index, reply in enumerate(replies):
        expected = alone(model, prompts[index], gen_length=16, block_length=4, seed=index,
                         temperature=temperatures[index])
        assert reply["choices"][0]["token_ids"] == expected, prompts[index]


def test_a_full_queue_answers_429_with_its_reason(model):
    app = create_app(model, slowed(TorchBackend(model, mode="eager", max_batch=1), 0.02), ServerLimits(max_queue=2))
    with LiveServer(app) as live:
        def ask(index):
            return httpx.post(f"{live.url}/v1/completions", timeout=60,
                              json={"model": model.name, "prompt": PROMPTS[index % 6]})

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(ask, range(8)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses.count(200) >= 3 and 429 in statuses and set(statuses) == {200, 429}
        refused = next(r.json()["error"] for r in responses if r.status_code == 429)
        assert refused["code"] == "queue_full" and "queue is full" in refused["message"]
        assert httpx.get(f"{live.url}/health").status_code == 200
        metrics = httpx.get(f"{live.url}/metrics").text
        assert f'dlmrt_rejected_requests_total{{reason="queue_full"}} {statuses.count(429)}.0' in metrics


def test_a_client_killed_mid_stream_leaves_the_batch(model):
    # After its first block the row is held until the client is gone: under load a free-running row could
    # reach its end before the client read its first chunk.
    backend = TorchBackend(model, mode="eager")
    client_gone = threading.Event()
    run = resources(backend).executor.run

    def run_held_after_the_first_block(state, kind, steps):
        if scheduler.stats.generated_tokens >= 4:
            client_gone.wait(30)
        run(state, kind, steps)
    resources(backend).executor.run = run_held_after_the_first_block
    app = create_app(model, backend)
    scheduler = app.state.scheduler
    with LiveServer(app) as live:
        body = {"model": model.name, "prompt": "rev:abcdefghij=", "stream": True, "gen_length": 48,
                "block_length": 4}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
            assert scheduler.running_rows == 1
        client_gone.set()
        # the connection is closed: the row leaves at its next block boundary, long before its 12 blocks
        deadline = time.monotonic() + 30
        while scheduler.stats.cancelled == 0:
            assert time.monotonic() < deadline, "the row did not leave the batch"
            time.sleep(0.01)
        assert scheduler.running_rows == 0 and scheduler.stats.generated_tokens < 48
        assert httpx.get(f"{live.url}/health").status_code == 200


def test_shutdown_drains_running_requests_and_refuses_new_ones(model):
    app = create_app(model, slowed(TorchBackend(model, mode="eager"), 0.05))
    live = LiveServer(app).__enter__()
    body = {"model": model.name, "prompt": "rev:abcdefghij=", "stream": True, "block_length": 4}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        stopping = threading.Thread(target=live.shutdown)
        stopping.start()
        time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{live.url}/v1/completions", json={"model": model.name, "prompt": "x"}, timeout=5)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    stopping.join(60)
    chunks = [json.loads(first.removeprefix("data: "))] + [json.loads(event) for event in rest[:-1]]
    assert rest[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == alone(model, "rev:abcdefghij=", block_length=4)
    assert not live.thread.is_alive() and not app.state.scheduler._worker.is_alive()
