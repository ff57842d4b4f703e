"""Shared fixtures: random models of each family, written as real checkpoints."""

from __future__ import annotations

import os
import tempfile

# One torch thread per test process, set before torch loads its OpenMP runtime. CI runs two pytest workers
# on two cores; with a thread per core each, four spinning OpenMP threads share two cores, and the tests'
# tiny eager steps waited on descheduled threads: 28 CPU-minutes for the suite instead of 19. Processes the
# tests start (the CLI, exports) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dlmrt.models import checkpoint  # noqa: E402
from helpers import LLADA, LLADA2, ORL, Loop, config, random_model  # noqa: E402
from shared_exports import SharedExports  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where torch was loaded before this file

STEPS_PER_SYNC = (1, 4, "block")


# torch.compile's artifacts and dlmrt's own cache (the exports and ONNX Runtime files the CLI makes on first
# use), kept out of the user's. The xdist workers inherit the controller's directories, so what one worker
# compiled or exported (10-30 s) the other loads in a second; both caches are safe for concurrent processes.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dlmrt-tests-inductor-"))
os.environ.setdefault("DLMRT_HOME", tempfile.mkdtemp(prefix="dlmrt-tests-home-"))


def pytest_addoption(parser):
    parser.addoption("--loop-modes", default="eager",
                     help="TorchBackend modes the step-loop parity tests run under, comma-separated: eager, "
                          "compile, cudagraph (each with K = 1, 4 and a whole block) [default: eager]")


def pytest_generate_tests(metafunc):
    if "loop" in metafunc.fixturenames:
        modes = [m.strip() for m in metafunc.config.getoption("--loop-modes").split(",") if m.strip()]
        metafunc.parametrize("loop", [Loop(mode, k) for mode in modes for k in STEPS_PER_SYNC], ids=str)


@pytest.fixture(scope="module")
def llada():
    return random_model(LLADA)


@pytest.fixture(scope="module")
def llada2():
    return random_model(LLADA2)


@pytest.fixture(scope="module")
def llada2_orl():
    return random_model(config(LLADA2, residual_context=ORL), seed=5)


@pytest.fixture(scope="module")
def orl():
    return random_model(config(LLADA, residual_context=ORL), seed=3)


@pytest.fixture(params=["llada", "llada2_moe"])
def family_config(request) -> dict:
    return {"llada": LLADA, "llada2_moe": LLADA2}[request.param]


@pytest.fixture
def saved_model(tmp_path, family_config):
    """(model, directory) of a random model saved as a Hugging Face checkpoint."""
    model = random_model(family_config)
    directory = checkpoint.save(model, tmp_path / "model")
    return model, directory


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> SharedExports:
    """The session's shared exports, in the base directory every xdist worker's own lies under."""
    base = tmp_path_factory.getbasetemp()
    return SharedExports((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-exports")


@pytest.fixture(scope="session")
def tiny_export(exports):
    """The tiny model's step graphs (full and cached)."""
    return exports["tiny"]
