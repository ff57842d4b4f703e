"""Logprobs on `dlmrt serve`: OpenAI's shapes, streamed and not, the prompt scored with echo, and the
bad input that asks for what cannot be given (a 400 naming the field).

The values are the runtime's (held to the model's own forward in tests/runtime/test_logprobs.py): here
each reply is checked against a Generator stream of the same request, and a scored prompt against
the model's forward on the prompt with the block masked, written out in the test.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from dlmrt.runtime import GenerationSettings, Generator, Threshold, text  # noqa: E402

PROMPT = "add:762+139="
CHAT = [{"role": "user", "content": PROMPT}]


def runtime_logprobs(model, prompt_ids, settings):
    """The tokens and logprobs a Generator gives the request alone."""
    tokens, logprobs = [], []
    for update in Generator(model, mode="eager").stream([prompt_ids], settings):
        tokens += update.token_ids
        logprobs += update.logprobs
    return tokens, logprobs


DECODING = {"policy": "threshold", "threshold": 0.9, "max_tokens": 16, "block_length": 8}


def server_settings(alternatives):
    """The settings the server decodes a request with DECODING with."""
    return GenerationSettings(16, 8, Threshold(0.9), logprobs=alternatives)


def sse_chunks(client, path, body) -> list[dict]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_completion_logprobs_are_the_runtimes_in_openais_shape(client, model):
    reply = client.post("/v1/completions", json={"model": model.name, "prompt": PROMPT, "logprobs": 2,
                                                 **DECODING}).json()
    choice = reply["choices"][0]
    choice_logprobs = choice["logprobs"]
    assert set(choice_logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(choice_logprobs["tokens"]) == choice["text"]
    assert choice_logprobs["text_offset"] == [sum(map(len, choice_logprobs["tokens"][:i]))
                                              for i in range(len(choice["token_ids"]))]
    tokens, expected = runtime_logprobs(model, text.encode(model, PROMPT), server_settings(2))
    assert choice["token_ids"] == tokens[:len(choice["token_ids"])] and choice["token_ids"]
    assert choice_logprobs["token_logprobs"] == [e.logprob for e in expected[:len(tokens)]]
    for token, top, entry in zip(choice_logprobs["tokens"], choice_logprobs["top_logprobs"], expected):
        alternatives = {text.decode(model, [t]): lp for t, lp in entry.top}
        assert top == {**alternatives, token: entry.logprob} and len(alternatives) == 2


def test_chat_logprobs_are_the_runtimes_in_openais_shape(client, model):
    reply = client.post("/v1/chat/completions", json={"model": model.name, "messages": CHAT, "logprobs": True,
                                                      "top_logprobs": 3}).json()
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(item["token"] for item in content) == choice["message"]["content"] != ""
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 3 and item["top_logprobs"][0]["logprob"] >= item["logprob"]
        assert [alternative["logprob"] for alternative in item["top_logprobs"]] == sorted(
            (alternative["logprob"] for alternative in item["top_logprobs"]), reverse=True)


def test_without_logprobs_a_reply_has_none(client, model):
    reply = client.post("/v1/chat/completions", json={"model": model.name, "messages": CHAT, "logprobs": False})
    assert reply.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, take", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1},
     lambda choice: list(zip(choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 1},
     lambda choice: [(item["token"], item["logprob"]) for item in choice["logprobs"]["content"]]),
], ids=["completion", "chat"])
def test_a_stream_carries_each_chunks_logprobs_and_they_add_up_to_the_whole_reply(client, model, path, body, take):
    request = {"model": model.name, **body, "block_length": 2}
    whole = take(client.post(path, json=request).json()["choices"][0])
    chunks = sse_chunks(client, path, {**request, "stream": True})
    streamed = [pair for chunk in chunks for pair in take(chunk["choices"][0])]
    assert streamed == whole and len(whole) >= 2
    if path == "/v1/completions":  # text_offset counts on from chunk to chunk
        offsets = [offset for chunk in chunks for offset in chunk["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == [sum(len(token) for token, _ in whole[:i]) for i in range(len(whole))]


def test_echo_with_max_tokens_0_scores_the_prompt_block_by_block(client, model):
    ids = text.encode(model, PROMPT)
    reply = client.post("/v1/completions", json={"model": model.name, "prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                 "logprobs": 2, "block_length": 4}).json()
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT and choice["token_ids"] == [] and reply["usage"]["completion_tokens"] == 0
    expected = []
    for start in range(0, len(ids), 4):
        masked = torch.tensor([ids])
        masked[0, start:start + 4] = model.tokens.mask_id
        with torch.no_grad():
            logits = model.denoise(masked).logits[0, start:start + 4].double()
        logp = logits - logits.exp().sum(-1, keepdim=True).log()
        expected += [float(logp[j, token]) for j, token in enumerate(ids[start:start + 4])]
    # rel: float32's precision at logprobs of -10 and below (the CPU's oneDNN matmuls sum in their own order)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert choice["logprobs"]["tokens"] == [text.decode(model, [t]) for t in ids]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 8}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
], ids=["top-above-20", "top-without-logprobs", "chat-logprobs-string", "completion-logprobs-above-5",
        "completion-logprobs-string", "echo-streamed", "echo-generating", "max-tokens-0-alone"])
def test_logprobs_asked_as_they_cannot_be_given_is_a_400_naming_the_field(client, model, path, body, param):
    response = client.post(path, json={"model": model.name, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert error["type"] == "invalid_request_error"


def test_logprobs_of_a_uniform_noise_model_is_a_400_naming_logprobs():
    """entropy_bound (DiffusionGemma) resamples the whole block at every step, so no step commits a token."""
    import dlmrt
    from fastapi.testclient import TestClient

    from dlmrt.runtime.torch_backend import TorchBackend
    from dlmrt.serve.app import create_app

    model = dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")
    client = TestClient(create_app(model, TorchBackend(model, mode="eager")))
    response = client.post("/v1/completions", json={"model": model.name, "prompt": "12+7=", "logprobs": 0})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logprobs" and "entropy_bound" in error["message"]
    scored = client.post("/v1/completions", json={"model": model.name, "prompt": "12+7=", "logprobs": 0,
                                                  "echo": True, "max_tokens": 0})
    assert scored.status_code == 400 and scored.json()["error"]["param"] == "echo"


def test_work_between_blocks_runs_on_the_worker_and_leaves_a_running_request_as_it_was(model):
    """Scoring runs on the scheduler's worker (which owns the backend) between two blocks of a running batch."""
    import queue
    import threading

    from dlmrt.runtime.scheduler import Finished, Scheduler
    from dlmrt.runtime.scoring import Scorer
    from dlmrt.runtime.torch_backend import TorchBackend

    backend = TorchBackend(model, mode="eager")
    scheduler = Scheduler(backend)
    settings = GenerationSettings(16, 4, Threshold(0.9), ignore_eos=True)  # four blocks
    prompt = text.encode(model, PROMPT)
    events: queue.Queue = queue.Queue()
    scheduler.submit(prompt, settings, events.put)
    scored = scheduler.run_between_blocks(lambda: (threading.current_thread().name,
                                                   Scorer(backend).score(prompt, 4, 0)))
    worker, entries = scored.result(timeout=120)
    tokens = []
    while not isinstance(event := events.get(timeout=120), Finished):
        tokens += event.token_ids
    scheduler.stop()
    assert worker == "dlmrt-scheduler" and len(entries) == len(prompt)
    assert tokens == Generator(model, mode="eager").generate([prompt], settings).tokens[0].tolist()[:len(tokens)]
    assert tokens
