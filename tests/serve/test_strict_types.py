"""Every request field takes the JSON type OpenAI's API documents for it, and no other: a string is never
taken for a number or a boolean, and a wrong type is a 400 whose `param` is the field as the request
names it (or the item of it that is wrong, as `stop.0`). Each case sends the model "gpt-4", which this
server refuses with 404 only after the body has been validated: 404 means the types were taken, 400
that they were not."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from dlmrt.serve.schema import ChatMessage, ChatRequest, CompletionRequest, StreamOptions  # noqa: E402

COMPLETION = ("/v1/completions", {"model": "gpt-4", "prompt": "x"})
CHAT = ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})

# A JSON type's right values and wrong ones (the coercions pydantic's lax mode would make among them)
INTEGER = ([16], ["16", 16.5, True])
NUMBER = ([1, 0.5], ["1.0", True])
BOOLEAN = ([True, False], ["yes", "true", 1])
STRING = (["auto"], [1, True, ["auto"]])
OBJECT = ([{}], ["{}", [], 1])
ARRAY = ([[]], ["[]", {}, 1])

FIELDS = {  # field: (endpoints, right values, wrong values); null is taken wherever the field is optional
    "model": ("both", ["gpt-4"], [4, None]),
    "max_tokens": ("both", *INTEGER),
    "stream": ("both", *BOOLEAN),
    "stream_options": ("both", *OBJECT),
    "stream_options.include_usage": ("both", *BOOLEAN),
    "stream_options.include_obfuscation": ("both", *BOOLEAN),
    "stream_provisional": ("both", *BOOLEAN),
    "temperature": ("both", *NUMBER),
    "seed": ("both", [3], ["3", 3.5, True]),
    "stop": ("both", ["\n", ["a", "b"]], [1, [1], True]),
    "user": ("both", *STRING),
    "top_p": ("both", *NUMBER),
    "frequency_penalty": ("both", *NUMBER),
    "presence_penalty": ("both", *NUMBER),
    "logit_bias": ("both", [{"50256": -100}], [{"50256": "-100"}, "{}", []]),
    "n": ("both", [1], ["1", 1.5, True]),
    "gen_length": ("both", *INTEGER),
    "block_length": ("both", [8], ["8", 8.5, True]),
    "policy": ("both", ["fixed"], [1, True]),
    "threshold": ("both", *NUMBER),
    "cache": ("both", ["prefix"], [1, True]),
    "steps": ("both", [4], ["4", 4.5, True]),
    "prompt": ("completions", ["x", [1, 2]], [5, True, {"text": "x"}, [1, "2"], [1.5]]),
    "suffix": ("completions", *STRING),
    "echo": ("completions", *BOOLEAN),
    "best_of": ("completions", [1], ["1", 1.5, True]),
    "logprobs": ("completions", [0, 2], ["yes", "2", 1.5, True]),  # OpenAI: an integer (0-5) or null
    "messages": ("chat", [[{"role": "user", "content": "x"}]], ["x", {}, [1]]),
    "messages.0.role": ("chat", ["assistant"], [1, True]),
    "messages.0.content": ("chat", ["x"], [1, True, None]),
    "messages.0.name": ("chat", ["ann"], [1, True]),
    "max_completion_tokens": ("chat", *INTEGER),
    "top_logprobs": ("chat", [0], ["0", 0.5, True]),
    "tools": ("chat", *ARRAY),
    "tool_choice": ("chat", ["none", {"type": "function"}], [1, True, []]),
    "parallel_tool_calls": ("chat", *BOOLEAN),
    "functions": ("chat", *ARRAY),
    "function_call": ("chat", ["none", {"name": "f"}], [1, True, []]),
    "response_format": ("chat", *OBJECT),
    "modalities": ("chat", [["text"]], ["text", [1]]),
    "audio": ("chat", *OBJECT),
    "prediction": ("chat", *OBJECT),
    "web_search_options": ("chat", *OBJECT),
    "moderation": ("chat", *OBJECT),
    "store": ("chat", *BOOLEAN),
    "metadata": ("chat", [{"k": "v"}], [{"k": 1}, "{}", []]),
    "service_tier": ("chat", *STRING),
    "reasoning_effort": ("chat", *STRING),
    "verbosity": ("chat", *STRING),
    "safety_identifier": ("chat", *STRING),
    "prompt_cache_key": ("chat", *STRING),
    "prompt_cache_retention": ("chat", *STRING),
    "prompt_cache_options": ("chat", *OBJECT),
}


def endpoints(which: str):
    return {"both": [COMPLETION, CHAT], "completions": [COMPLETION], "chat": [CHAT]}[which]


def with_value(base: dict, field: str, value) -> dict:
    """`base` with `field` (a dotted path, as `messages.0.role`) set to `value`."""
    body = {key: [dict(item) for item in value] if key == "messages" else value for key, value in base.items()}
    *outer, last = field.split(".")
    target = body
    for part in outer:
        target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
    target[last] = value
    return body


def cases(right: bool) -> list:
    return [pytest.param(path, with_value(base, field, value), field,
                         id=f"{'chat' if 'chat' in path else 'completions'}-{field}-{value!r}")
            for field, (which, good, bad) in FIELDS.items() for path, base in endpoints(which)
            for value in (good if right else bad)]


def test_every_field_of_the_request_models_has_cases():
    fields = {*CompletionRequest.model_fields, *ChatRequest.model_fields,
              *(f"stream_options.{name}" for name in StreamOptions.model_fields),
              *(f"messages.0.{name}" for name in ChatMessage.model_fields)}
    assert fields == set(FIELDS)


@pytest.mark.parametrize("path, body, field", cases(right=True))
def test_the_documented_type_is_taken(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", response.text


@pytest.mark.parametrize("path, body, field", cases(right=False))
def test_any_other_type_is_a_400_naming_the_field(client, path, body, field):
    response = client.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", response.text
    # the field, or the item of it that is wrong (`stop.0` for "stop": [1])
    assert error["param"] == field or error["param"].startswith(f"{field}.0"), error
    assert error["message"].startswith(f"{error['param']}: "), error


def test_the_issues_examples(client):
    """`"max_tokens": "16"` was taken as 16 and `"stream": "yes"` as true; a prompt of the wrong type was
    named `prompt.str`."""
    for field, value in (("max_tokens", "16"), ("stream", "yes"), ("prompt", 5)):
        response = client.post("/v1/completions", json={"model": "tiny-llada", "prompt": "add:1+2=", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
