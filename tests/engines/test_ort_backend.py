"""OrtBackend's bindings: graph annotations and run options on the CPU, the CUDA provider on a GPU."""

from __future__ import annotations

import pytest
import torch

ort = pytest.importorskip("onnxruntime")

import dlmrt  # noqa: E402
from dlmrt.core import tasks  # noqa: E402
from dlmrt.core.errors import MissingExtraError  # noqa: E402
from dlmrt.runtime import GenerationSettings, Generator, Threshold, text  # noqa: E402
from dlmrt.runtime.batch_resources import resources  # noqa: E402
from dlmrt.runtime.ort_backend import GRAPH_ANNOTATION, NO_SYNC, OrtBackend  # noqa: E402

CUDA_PROVIDER = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


@pytest.fixture(scope="module")
def prompts():
    model = dlmrt.load()
    return [text.encode(model, e.prompt) for e in tasks.examples("test", 2, seed=3)[:3]]


def annotations(backend: OrtBackend) -> dict[tuple, str]:
    """Each binding's (session, step kind, batch) and the CUDA graph annotation it runs with."""
    return {(id(b.run.session), key[1], b.state.bucket): b.run.run_options.get_run_config_entry(GRAPH_ANNOTATION)
            for key, b in resources(backend).executor.bound.items()}


def test_every_bucket_and_step_kind_runs_its_own_cuda_graph(tiny_export, prompts):
    """ONNX Runtime replays the graph an annotation captured whatever is bound, so two bindings must
    never share one within a session; and a binding keeps its annotation, as its addresses, run after run."""
    backend = OrtBackend(tiny_export, cuda_graph=True)  # inert on the CPU: the annotations are what is checked
    generator = Generator(backend)
    runs = [(GenerationSettings(16, 8, Threshold(0.9), cache=cache), n) for cache in ("none", "dual")
            for n in (1, 3)]  # two step kinds each, on buckets of batch 1 and 4
    tokens = [generator.generate(prompts[:n], settings).tokens for settings, n in runs]
    first = annotations(backend)
    by_session: dict[int, list[str]] = {}
    for (session, _, _), annotation in first.items():
        by_session.setdefault(session, []).append(annotation)
    assert len(first) >= 4
    for found in by_session.values():
        assert len(set(found)) == len(found) and all(int(a) > 0 for a in found)  # 0 is ONNX Runtime's own
    bound = resources(backend).executor.bound.values()
    assert all(b.run.run_options.get_run_config_entry(NO_SYNC) == "1" for b in bound)

    again = [generator.generate(prompts[:n], settings).tokens for settings, n in runs]
    assert annotations(backend) == first
    eager = Generator(dlmrt.load(), mode="eager")
    for (settings, n), found, repeated in zip(runs, tokens, again):
        expected = eager.generate(prompts[:n], settings).tokens
        assert torch.equal(found, expected) and torch.equal(repeated, expected)


def test_without_cuda_graphs_no_run_is_annotated(tiny_export, prompts):
    backend = OrtBackend(tiny_export)
    Generator(backend).generate(prompts[:1], GenerationSettings(16, 8, Threshold(0.9), cache="prefix"))
    assert resources(backend).executor.bound
    for binding in resources(backend).executor.bound.values():
        with pytest.raises(RuntimeError, match="does not have configuration"):
            binding.run.run_options.get_run_config_entry(GRAPH_ANNOTATION)


@pytest.mark.skipif(CUDA_PROVIDER, reason="onnxruntime-gpu and a GPU are present here")
def test_onnx_runtime_on_cuda_without_onnxruntime_gpu_names_the_extra(tiny_export):
    with pytest.raises(MissingExtraError, match=r"pip install 'dlmrt\[onnx-gpu\]'"):
        OrtBackend(tiny_export, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_PROVIDER, reason="needs onnxruntime-gpu (dlmrt[onnx-gpu]) and a CUDA GPU")
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_onnx_runtime_on_cuda_gives_the_tokens_of_torch(tiny_export, prompts, cache):
    settings = GenerationSettings(16, 8, Threshold(0.9), cache=cache)
    backend = OrtBackend(tiny_export, device="cuda")
    provider = backend.sessions["full"].get_provider_options()["CUDAExecutionProvider"]
    assert provider["enable_cuda_graph"] == "1" and provider["user_compute_stream"] == str(backend.stream.cuda_stream)
    generator = Generator(backend)
    found = [generator.generate(prompts, settings).tokens.cpu() for _ in range(3)]  # the capture, then replays
    expected = Generator(dlmrt.load(device="cuda"), mode="eager").generate(prompts, settings).tokens.cpu()
    assert all(torch.equal(tokens, expected) for tokens in found)
