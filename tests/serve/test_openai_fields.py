"""OpenAI's request fields on `dlmrt serve` (dlmrt.serve.schema): taken at the values that ask for nothing,
refused with a 400 that names the field and says why at any other."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from dlmrt.serve.schema import NO_OP_ONLY  # noqa: E402

COMPLETION = {"prompt": "add:762+139="}
CHAT = {"messages": [{"role": "user", "content": "add:762+139="}]}
NO_OPS = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "n": 1, "user": "someone"}
COMPLETION_NO_OPS = {**NO_OPS, "logprobs": None, "echo": False, "best_of": 1, "suffix": None}
CHAT_NO_OPS = {**NO_OPS, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
               "parallel_tool_calls": True, "functions": [], "function_call": "auto",
               "response_format": {"type": "text"}, "modalities": ["text"],
               "audio": None, "prediction": None, "web_search_options": None, "moderation": None, "store": False,
               "metadata": {"team": "a"}, "service_tier": "auto", "reasoning_effort": "none", "verbosity": "medium",
               "safety_identifier": "h", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
               "prompt_cache_options": {"mode": "implicit"}, "max_completion_tokens": 16}


@pytest.mark.parametrize("path, body, no_ops", [("/v1/completions", COMPLETION, COMPLETION_NO_OPS),
                                                 ("/v1/chat/completions", CHAT, CHAT_NO_OPS)],
                         ids=["completion", "chat"])
def test_fields_at_their_no_op_values_change_nothing(client, model, path, body, no_ops):
    plain = client.post(path, json={"model": model.name, **body}).json()["choices"][0]
    response = client.post(path, json={"model": model.name, **body, **no_ops})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0] == plain


UNSUPPORTED = [  # (endpoint, field, a value dlmrt cannot honour)
    ("completion", "top_p", 0.9), ("completion", "frequency_penalty", 0.5), ("completion", "presence_penalty", -1),
    ("completion", "logit_bias", {"5": 100}), ("completion", "n", 2), ("completion", "best_of", 3),
    ("completion", "suffix", "end"), ("chat", "tools", [{"type": "function"}]),
    ("chat", "tool_choice", "required"), ("chat", "functions", [{"name": "f"}]),
    ("chat", "function_call", {"name": "f"}), ("chat", "response_format", {"type": "json_object"}),
    ("chat", "modalities", ["text", "audio"]), ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "prediction", {"type": "content", "content": "x"}), ("chat", "web_search_options", {}),
    ("chat", "moderation", {}), ("chat", "store", True), ("chat", "service_tier", "flex"),
    ("chat", "reasoning_effort", "high"), ("chat", "verbosity", "low"), ("chat", "n", 3), ("chat", "top_p", 0.5),
    ("chat", "stream_options.include_obfuscation", True),
]


def with_field(body: dict, field: str, value) -> dict:
    outer, _, inner = field.partition(".")
    return {**body, outer: {inner: value}, "stream": True} if inner else {**body, field: value}


@pytest.mark.parametrize("endpoint, field, value", UNSUPPORTED, ids=[f"{e}-{f}={v}" for e, f, v in UNSUPPORTED])
def test_a_value_dlmrt_cannot_honour_is_a_400_that_says_why(client, model, endpoint, field, value):
    path, body = ("/v1/completions", COMPLETION) if endpoint == "completion" else ("/v1/chat/completions", CHAT)
    response = client.post(path, json=with_field({"model": model.name, **body}, field, value))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_value"
    assert error["type"] == "invalid_request_error" and error["message"] == f"{field}: {NO_OP_ONLY[field].why}"


def test_every_no_op_only_field_is_refused_somewhere():
    assert {field for _, field, _ in UNSUPPORTED} == set(NO_OP_ONLY)


def test_an_unknown_field_is_still_refused(client, model):
    response = client.post("/v1/chat/completions", json={"model": model.name, **CHAT, "top_k": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k"
    assert "unknown field" in response.json()["error"]["message"]


def test_stream_options_without_stream_is_a_400(client, model):
    response = client.post("/v1/completions", json={"model": model.name, **COMPLETION,
                                                    "stream_options": {"include_usage": True}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completion", "chat"])
def test_include_usage_ends_a_stream_with_a_usage_chunk(client, model, path, body):
    """The tiny model's "0901" is 4 tokens after a prompt of 12; the stop string "1" leaves 3 of them."""
    request = {"model": model.name, **body, "stream": True, "stream_options": {"include_usage": True}, "stop": "1",
               "block_length": 2}
    with client.stream("POST", path, json=request) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    *chunks, last = [json.loads(event) for event in events[:-1]]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 12, "completion_tokens": 3,
                                                       "total_tokens": 15}
    assert len(chunks) >= 2 and all(chunk["usage"] is None and chunk["choices"] for chunk in chunks)


def test_every_field_of_the_openai_clients_requests_is_taken():
    """The fields the installed openai package sends (a new release may add one: give it its kind in
    dlmrt.serve.schema, honoured, ignored, or in NO_OP_ONLY)."""
    pytest.importorskip("openai")
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    from dlmrt.serve.schema import ChatRequest, CompletionRequest

    for request, params in ((CompletionRequest, completion_create_params), (ChatRequest, chat_create_params)):
        assert set(params.CompletionCreateParamsBase.__annotations__) | {"stream"} <= set(request.model_fields)
