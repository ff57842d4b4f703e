"""What a browser can make the server do: a POST's body is taken only with a JSON content type (a web page
can send `text/plain`, a form or an untyped body cross-site without asking the server first), and no page of
another origin may call the API unless `--allowed-origins` names its origin (CORS)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from click.testing import CliRunner  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from dlmrt.core.chat_template import load_chat_template  # noqa: E402
from dlmrt.core.errors import ArgumentError  # noqa: E402
from dlmrt.runtime.torch_backend import TorchBackend  # noqa: E402
from dlmrt.serve.app import create_app  # noqa: E402
from dlmrt.serve.cors import parse_origins  # noqa: E402
import dlmrt  # noqa: E402

COMPLETION = b'{"model": "tiny-llada", "prompt": "add:762+139="}'
CHAT = b'{"model": "tiny-llada", "messages": [{"role": "user", "content": "add:1+2="}]}'
PAGE, OTHER = "https://app.example", "https://evil.example"


def app_for(model, allowed_origins=()):
    return TestClient(create_app(model, TorchBackend(model, mode="eager"), allowed_origins=allowed_origins,
                                 chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR)))


@pytest.fixture(scope="module")
def allowing(model):
    return app_for(model, (PAGE,))


def post(client, path, body, content_type, origin=None):
    headers = {} if content_type is None else {"content-type": content_type}
    if origin is not None:
        headers["origin"] = origin
    return client.post(path, content=body, headers=headers)


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp", "json", "", None],
                         ids=["text", "text utf-8", "form", "multipart", "jsonp", "no slash", "empty", "missing"])
def test_a_body_not_typed_as_json_is_a_415(client, path, body, content_type):
    """Were these taken (they were: 200 with a completion), any web page could POST completions to a server on
    localhost: a browser sends them cross-site with no preflight. A missing type is refused too, as FastAPI does."""
    response = post(client, path, body, content_type)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in error["message"]
    assert ("no Content-Type" in error["message"]) == (not content_type)
    assert 'dlmrt_rejected_requests_total{reason="unsupported_media_type"}' in client.get("/metrics").text


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/merge-patch+json"])
def test_json_content_types_are_taken(client, content_type):
    typed = post(client, "/v1/completions", COMPLETION, content_type)
    plain = post(client, "/v1/completions", COMPLETION, "application/json")
    assert typed.status_code == 200, typed.text
    assert typed.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"] != []


def test_by_default_no_origin_is_allowed(client):
    """No CORS headers at all: a browser lets no page of another origin read an answer, and a preflight
    (which a JSON POST needs) is not answered as one."""
    answered = post(client, "/v1/completions", COMPLETION, "application/json", origin=OTHER)
    assert answered.status_code == 200 and not any(h.startswith("access-control-") for h in answered.headers)
    preflight = client.options("/v1/completions", headers={"origin": OTHER, "access-control-request-method": "POST",
                                                            "access-control-request-headers": "content-type"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    assert preflight.json()["error"]["code"] == "method_not_allowed"


def test_an_allowed_origin_gets_its_preflight_and_its_answers(allowing):
    preflight = allowing.options("/v1/chat/completions", headers={
        "origin": PAGE, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization, x-stainless-lang"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert set(preflight.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert preflight.headers["access-control-allow-headers"] == "content-type, authorization, x-stainless-lang"
    answered = post(allowing, "/v1/completions", COMPLETION, "application/json", origin=PAGE)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == PAGE
    refused = post(allowing, "/v1/completions", COMPLETION, "text/plain", origin=PAGE)
    assert refused.status_code == 415 and refused.headers["access-control-allow-origin"] == PAGE  # readable


def test_another_origin_is_refused_in_openai_s_shape(allowing):
    preflight = allowing.options("/v1/completions", headers={"origin": OTHER, "access-control-request-method": "POST"})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    error = preflight.json()["error"]
    assert error["code"] == "cors_refused" and "origin not allowed" in error["message"]
    wrong_method = allowing.options("/v1/completions", headers={"origin": PAGE,
                                                                "access-control-request-method": "DELETE"})
    assert wrong_method.status_code == 400 and "method not allowed" in wrong_method.json()["error"]["message"]
    answered = allowing.get("/v1/models", headers={"origin": OTHER})
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


def test_any_origin(model):
    client = app_for(model, ("*",))
    answered = client.get("/health", headers={"origin": OTHER})
    assert answered.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("value, origins", [
    (None, ()), ("", ()), ("*", ("*",)), ("https://a.example", ("https://a.example",)),
    ("https://a.example, http://localhost:3000,https://a.example", ("https://a.example", "http://localhost:3000")),
    ("http://[::1]:8080", ("http://[::1]:8080",)), ("chrome-extension://abcdef", ("chrome-extension://abcdef",)),
])
def test_origins_are_parsed(value, origins):
    assert parse_origins(value) == origins


@pytest.mark.parametrize("value, message", [
    ("https://a.example/", "'https://a.example/' is not an origin"),
    ("a.example", "'a.example' is not an origin"),
    ("https://A.example", "in lowercase"),
    ("https://a.example/app", "no path"),
    ("null", "'null' is not an origin"),
    ("*,https://a.example", r"give \* alone"),
])
def test_what_is_no_origin_is_refused(value, message):
    with pytest.raises(ArgumentError, match=message):
        parse_origins(value)


def test_dlmrt_serve_refuses_a_bad_origin_in_one_line():
    from dlmrt.cli.commands import main

    result = CliRunner().invoke(main, ["serve", "--allowed-origins", "https://a.example/"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        "Error: --allowed-origins: 'https://a.example/' is not an origin as a browser sends it: give "
        "scheme://host[:port] in lowercase, with no path or trailing slash (as https://app.example or "
        "http://localhost:3000)"]
