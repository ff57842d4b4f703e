"""The serve tests' shared fixtures: the tiny model, and the app over it behind FastAPI's test client."""

from __future__ import annotations

import pytest

import dlmrt


@pytest.fixture(scope="module")
def model():
    return dlmrt.load()


@pytest.fixture(scope="module")
def client(model):
    pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
    from fastapi.testclient import TestClient

    from dlmrt.core.chat_template import load_chat_template
    from dlmrt.runtime.torch_backend import TorchBackend
    from dlmrt.serve.app import ServerLimits, create_app

    app = create_app(model, TorchBackend(model, mode="eager"), ServerLimits(max_body_bytes=4096),
                     chat_template=load_chat_template(dlmrt.TINY_MODEL_DIR))
    return TestClient(app)
