"""OpenAI's `stop` on `dlmrt serve`: the text ends before the first stop string, streamed text never holds
the start of one that a later block completes, and the row leaves the batch when a stop string ends it.

The tiny model answers "add:762+139=" with "0901" (one character a token), then end-of-sequence."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from fastapi.testclient import TestClient  # noqa: E402

from dlmrt.runtime.batch_resources import resources  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import create_app  # noqa: E402
from dlmrt.serve.stop_strings import StopScan, tokens_spanning  # noqa: E402

ADD = "add:762+139="


@pytest.mark.parametrize("stops, texts, released", [
    (["ab"], ["xxa", "xxaby"], [("xx", False), ("", True)]),  # "ab" split across blocks: the "a" waits
    (["END", "\n"], ["hello E", "hello EN", "hello ENX"], [("hello", False), (" ", False), ("ENX", False)]),
    (["c", "ab"], ["xabc"], [("x", True)]),  # the first occurrence of any, not the first stop string listed
    (["ab"], ["abab"], [("", True)]),
    ([], ["ab", "abcd"], [("ab", False), ("cd", False)]),  # no stop strings: nothing waits
])
def test_stop_scan_releases_what_no_later_block_can_make_a_stop(stops, texts, released):
    scan = StopScan(stops)
    done = [False] * (len(texts) - 1) + [True]
    assert [scan.release(text, last) for text, last in zip(texts, done)] == released


def test_tokens_spanning_counts_the_token_a_cut_falls_inside():
    pieces = {1: "ab", 2: "c", 3: "de"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert [tokens_spanning(decode, [1, 2, 3], length) for length in range(6)] == [0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("stop, text", [("9", "0"), (["x", "01"], "09"), ("0", ""), ("0901", ""), ("901x", "0901")])
def test_a_completion_ends_before_its_first_stop_string(client, model, stop, text):
    reply = client.post("/v1/completions", json={"model": model.name, "prompt": ADD, "stop": stop}).json()
    (choice,) = reply["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len(text) == len(choice["token_ids"])  # the tokens returned


def test_chat_ends_before_its_stop_string(client, model):
    reply = client.post("/v1/chat/completions", json={"model": model.name, "stop": ["1"],
                                                      "messages": [{"role": "user", "content": ADD}]}).json()
    assert reply["choices"][0]["message"]["content"] == "090" and reply["choices"][0]["finish_reason"] == "stop"


def test_a_stream_holds_back_what_may_begin_a_stop_string(client, model):
    """Blocks of 2: "09", then "01". The stop string "90" spans them, so the "9" of the first block waits
    and is never sent."""
    body = {"model": model.name, "prompt": ADD, "stream": True, "block_length": 2, "stop": "90"}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in choices] == [("0", [3], None), ("", [], "stop")]


def test_a_stop_string_ends_the_rows_decoding(model):
    """Blocks of 2: the stop string is in the first; the row leaves the batch cancelled instead of
    decoding on to its end-of-sequence in the third."""
    backend = TorchBackend(model, mode="eager")
    run = resources(backend).executor.run

    def slow_run(state, kind, steps):  # so that the row is still decoding when the stop is seen
        time.sleep(0.1)
        run(state, kind, steps)
    resources(backend).executor.run = slow_run
    app = create_app(model, backend)
    scheduler = app.state.scheduler
    with TestClient(app) as client:  # one event loop throughout, as a server's: it takes the row's later blocks
        reply = client.post("/v1/completions", json={"model": model.name, "prompt": ADD, "block_length": 2,
                                                     "stop": "9"}).json()
        assert reply["choices"][0]["text"] == "0"
        deadline = time.monotonic() + 30
        while scheduler.stats.finished == 0:
            assert time.monotonic() < deadline, "the row did not leave the batch"
            time.sleep(0.01)
    assert scheduler.stats.cancelled == 1
