"""Provisional streaming (`"stream_provisional": true`) and aborts that free compute, on the tiny model.

The tiny model writes a token a character, and its fixed policy (16 steps for 16 tokens) commits one
token a step: with blocks of 4, a block without end-of-sequence shows 1, 2, 3, then 4 committed tokens. The committed
chunks of a provisional stream are those of a plain one, and a block's last snapshot is its chunk.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

import httpx  # noqa: E402

import dlmrt  # noqa: E402
from dlmrt.core.chat_template import load_chat_template  # noqa: E402
from dlmrt.runtime import text  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import create_app  # noqa: E402
from dlmrt.serve.provisional import MASK_PLACEHOLDER  # noqa: E402

from test_server_live import LiveServer, alone, slowed  # noqa: E402

PROMPT = "sort:987123="  # answered "123789": in blocks of 4, "1237", then "89" and end-of-sequence


def stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def without_ids(chunks: list[dict]) -> list[dict]:
    return [{k: v for k, v in chunk.items() if k not in ("id", "created")} for chunk in chunks]


def by_block(chunks: list[dict]) -> list[tuple[list[dict], dict]]:
    """(the provisional snapshots before it, the committed chunk) for each committed chunk, in order."""
    blocks, shown = [], []
    for chunk in chunks:
        if "dlmrt" in chunk:
            shown.append(chunk["dlmrt"]["provisional"])
        else:
            blocks.append((shown, chunk))
            shown = []
    assert shown == []  # nothing provisional after the last committed chunk
    return blocks


def test_snapshots_grow_and_end_equal_to_each_committed_block(client, model):
    body = {"model": model.name, "prompt": PROMPT, "block_length": 4}
    plain = stream(client, "/v1/completions", body)
    chunks = stream(client, "/v1/completions", {**body, "stream_provisional": True})

    committed = [chunk for chunk in chunks if "dlmrt" not in chunk]
    assert without_ids(committed) == without_ids(plain)  # opting in changes no committed chunk
    expected = alone(model, PROMPT, block_length=4)
    assert sum((c["choices"][0]["token_ids"] for c in committed), []) == expected
    blocks = by_block(chunks)
    assert len(blocks) == 2
    for index, (shown, chunk) in enumerate(blocks):
        choice = chunk["choices"][0]
        assert shown and {snapshot["block"] for snapshot in shown} == {index}
        assert shown[-1]["token_ids"] == choice["token_ids"] and shown[-1]["text"] == choice["text"]
        for snapshot in shown:
            ids = snapshot["token_ids"]
            assert snapshot["text"] == "".join(MASK_PLACEHOLDER if t is None else text.decode(model, [t]) for t in ids)
        for before, after in zip(shown, shown[1:]):  # a token once shown is never taken back
            assert all(a is None or a == b for a, b in zip(before["token_ids"], after["token_ids"]))
    for shown, _ in blocks[:1]:  # one token committed a step, a snapshot a step
        assert [4 - snapshot["token_ids"].count(None) for snapshot in shown] == [1, 2, 3, 4]
    for chunk in chunks:  # every chunk is a plain OpenAI chunk besides: the snapshots' text is empty
        assert chunk["object"] == "text_completion" and set(chunk["choices"][0]) >= {"text", "finish_reason"}
        if "dlmrt" in chunk:
            assert chunk["choices"][0]["text"] == "" and chunk["choices"][0]["finish_reason"] is None


def test_max_tokens_cuts_the_snapshots_as_the_committed_text(client, model):
    """max_tokens 2 decodes one block of 4 (gen_length rounds up to whole blocks) and returns its first 2
    tokens: no snapshot shows more, and one that only changed past them is not sent again."""
    chunks = stream(client, "/v1/completions", {"model": model.name, "prompt": PROMPT, "block_length": 4,
                                                "max_tokens": 2, "stream_provisional": True})
    ((shown, chunk),) = by_block(chunks)
    assert all(len(snapshot["token_ids"]) == 2 for snapshot in shown)
    choice = chunk["choices"][0]
    assert shown[-1]["token_ids"] == choice["token_ids"] and choice["finish_reason"] == "length"
    assert len({tuple(snapshot["token_ids"]) for snapshot in shown}) == len(shown) < 4  # 4 steps, changes only


def test_chat_snapshots_carry_no_content(client, model):
    body = {"model": model.name, "messages": [{"role": "user", "content": PROMPT}], "block_length": 4}
    plain = stream(client, "/v1/chat/completions", body)
    chunks = stream(client, "/v1/chat/completions", {**body, "stream_provisional": True})
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert content == "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in plain)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"} and "dlmrt" in chunks[0]
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:])
    for shown, chunk in by_block(chunks):
        assert shown[-1]["text"] == chunk["choices"][0]["delta"].get("content", "")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_stream_provisional_without_stream_is_a_400(client, model, path, body):
    response = client.post(path, json={"model": model.name, **body, "stream_provisional": True})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stream_provisional" and "stream: true" in error["message"]


def test_the_openai_client_reads_a_provisional_stream(model):
    openai = pytest.importorskip("openai")
    app = create_app(model, TorchBackend(model, mode="eager"), chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR))
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=model.name, prompt=PROMPT, stream=True,
                                                extra_body={"block_length": 4, "stream_provisional": True}))
        expected = text.decode(model, alone(model, PROMPT, block_length=4))
        assert "".join(chunk.choices[0].text for chunk in chunks) == expected
        blocks = by_block([chunk.model_dump(exclude_none=True) for chunk in chunks])
        assert len(blocks) == 2 and all(shown for shown, _ in blocks)
        assert "".join(shown[-1]["text"] for shown, _ in blocks) == expected
        chat = list(client.chat.completions.create(model=model.name, stream=True,
                                                   messages=[{"role": "user", "content": "sort:3142="}],
                                                   extra_body={"stream_provisional": True}))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chat) == text.decode(
            model, alone(model, "sort:3142="))
        assert any("dlmrt" in chunk.model_extra for chunk in chat)


def test_a_client_gone_mid_block_frees_its_row_before_the_block_ends(model):
    """Two requests share one block of 16 steps; the streaming one is closed after its first snapshot.
    Its row leaves at the next K-step boundary (one step on a CPU), so the batch runs with one row for
    most of the block, where it used to hold both rows to the block's end."""
    app = create_app(model, slowed(TorchBackend(model, mode="eager"), 0.05))
    scheduler, sizes, watching = app.state.scheduler, [], threading.Event()

    def watch():
        while not watching.is_set():
            sizes.append(scheduler.running_rows)
            time.sleep(0.005)

    body = {"model": model.name, "prompt": PROMPT, "block_length": 16}
    with LiveServer(app) as live:
        first = threading.Thread(target=httpx.post, args=(f"{live.url}/v1/completions",),
                                 kwargs=dict(json={**body, "prompt": "add:5+17="}, timeout=60))
        first.start()  # holds the batch while the next two queue, so they join one block together
        while scheduler.running_rows == 0:
            time.sleep(0.005)
        watcher = threading.Thread(target=watch)
        watcher.start()
        reply = {}
        stays = threading.Thread(target=lambda: reply.update(httpx.post(
            f"{live.url}/v1/completions", json={**body, "seed": 1}, timeout=60).json()))
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_provisional": True}) as response:
            while scheduler.waiting < 1:
                time.sleep(0.005)
            stays.start()
            lines = response.iter_lines()
            snapshot = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
            assert "dlmrt" in snapshot and scheduler.running_rows == 2
        stays.join(60)
        first.join(60)
        watching.set()
        watcher.join()
    assert reply["choices"][0]["token_ids"] == alone(model, PROMPT, block_length=16, seed=1)
    after = sizes[sizes.index(2):]
    assert after.count(1) > 10, after  # one row ran on for most of the block (16 steps of 50 ms)
    assert scheduler.stats.cancelled == 1
