"""TrtBackend's binding contract, on the CPU, against the recording fake of TensorRT (fake_tensorrt)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("onnxruntime")

import dlmrt  # noqa: E402
from dlmrt.core import tasks  # noqa: E402
from dlmrt.engines import build, targets  # noqa: E402
from dlmrt.engines.plan import make_plan  # noqa: E402
from dlmrt.engines.profiles import DimRange  # noqa: E402
from dlmrt.engines.select import EngineMismatch  # noqa: E402
from dlmrt.engines.store import EngineStore  # noqa: E402
from dlmrt.core.errors import ArgumentError, MissingExtraError  # noqa: E402
from dlmrt.export.export_manifest import ExportManifestError  # noqa: E402
from dlmrt.runtime import CACHE_MODES, Fixed, GenerationSettings, Generator, Threshold, text  # noqa: E402
from dlmrt.runtime.ort_backend import OrtBackend  # noqa: E402
from dlmrt.runtime.trt_backend import TrtBackend  # noqa: E402
from fake_tensorrt import FakeTensorRT, engine_builder  # noqa: E402

TENSORRT = "10.13.0"
H200 = (9, 0)


@pytest.fixture(scope="module")
def store(tiny_export, tmp_path_factory):
    """The tiny export's sm_90 bf16 'engines' (fake), batch up to 4."""
    store = EngineStore(tmp_path_factory.mktemp("engines"))
    plan = make_plan(tiny_export, targets.target_named("sm_90"), "bf16", tensorrt=TENSORRT, store=store.root,
                     ranges={"batch": DimRange(1, 2, 4)})
    build.run(plan, store, device="NVIDIA H200", tensorrt_version=TENSORRT, engine_builder=engine_builder)
    return store


def backend(tiny_export, store, trt=None, **options):
    trt = trt or FakeTensorRT(TENSORRT)
    return TrtBackend(tiny_export, store.root, tensorrt=trt, plugins=trt.register_plugins,
                      capability=options.pop("capability", H200), device="cpu", **options), trt


@pytest.fixture(scope="module")
def prompts():
    model = dlmrt.load()
    return [text.encode(model, e.prompt) for e in tasks.examples("test", 2, seed=7)[:3]]


@pytest.mark.parametrize("cache", CACHE_MODES)
@pytest.mark.parametrize("policy", [Fixed(16), Threshold(0.9)], ids=["fixed", "threshold"])
def test_the_engines_give_the_tokens_of_onnx_runtime_and_torch(tiny_export, store, prompts, cache, policy):
    settings = GenerationSettings(16, 8, policy, cache=cache)
    trt_backend, _ = backend(tiny_export, store)
    found = Generator(trt_backend).generate(prompts, settings).tokens
    assert torch.equal(found, Generator(OrtBackend(tiny_export)).generate(prompts, settings).tokens)
    assert torch.equal(found, Generator(dlmrt.load(), mode="eager").generate(prompts, settings).tokens)


def test_plugins_first_one_context_per_engine_and_addresses_set_once(tiny_export, store, prompts):
    trt_backend, trt = backend(tiny_export, store)
    assert trt.events == ["register plugins", "deserialize", "deserialize"]
    assert len(trt.contexts) == 2  # one per engine (each has one profile)
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual", steps_per_sync=4)
    generator = Generator(trt_backend)
    generator.generate(prompts, settings)
    calls = [(c.shape_calls, c.address_calls) for c in trt.contexts]
    generator.generate(prompts, settings)
    assert [(c.shape_calls, c.address_calls) for c in trt.contexts] == calls  # nothing rebound for the same bucket
    for context in trt.contexts:
        assert context.executions, "an engine never ran"
        assert all(addresses == context.executions[0] for addresses in context.executions)  # stable addresses
        assert context.address_calls == len(context.engine.names)  # each tensor bound once


def test_a_batch_beyond_the_profile_names_the_rebuild(tiny_export, store, prompts):
    trt_backend, _ = backend(tiny_export, store)
    with pytest.raises(ArgumentError, match="exceed the batch limit of 4.*dlmrt build .*--batch"):
        Generator(trt_backend).generate(prompts * 2, GenerationSettings(16, 8, Threshold(0.9)))


def test_no_engine_for_this_gpu_names_the_build_command(tiny_export, store):
    with pytest.raises(EngineMismatch, match=r"no sm_120 .* build it with `dlmrt build .* --target sm_120"):
        backend(tiny_export, store, capability=(12, 0))


def test_another_tensorrt_version_is_refused(tiny_export, store):
    with pytest.raises(EngineMismatch, match="built with TensorRT 10.13.0, this is TensorRT 10.14.1.*Rebuild"):
        backend(tiny_export, store, trt=FakeTensorRT("10.14.1"))


def test_a_changed_engine_file_is_refused(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, targets.target_named("sm_90"), "bf16", tensorrt=TENSORRT, store=store.root)
    entry = build.run(plan, store, device="NVIDIA H200", tensorrt_version=TENSORRT, engine_builder=engine_builder)
    (entry / "full" / "engine.plan").write_bytes(b"tampered")
    with pytest.raises(EngineMismatch, match="engine.plan has sha256"):
        backend(tiny_export, store)


def test_an_outdated_plugin_is_refused(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, targets.target_named("sm_90"), "bf16", tensorrt=TENSORRT, store=store.root)
    entry = build.run(plan, store, device="NVIDIA H200", tensorrt_version=TENSORRT, engine_builder=engine_builder)
    record = json.loads((entry / "manifest.json").read_text())
    record["plugins"][0]["version"] = "0"
    (entry / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(EngineMismatch, match="plugin"):
        backend(tiny_export, store)


def test_a_model_directory_is_not_an_export(store):
    from dlmrt import TINY_MODEL_DIR

    with pytest.raises(ExportManifestError, match="is not a dlmrt export.*dlmrt export"):
        backend(TINY_MODEL_DIR, store)


def test_nvfp4_on_a_gpu_without_it(tiny_export, store):
    with pytest.raises(Exception, match="nvfp4") as error:
        backend(tiny_export, store, precision="nvfp4")
    assert isinstance(error.value, dlmrt.core.errors.DlmrtError)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt_names_the_extra(tiny_export, store):
    with pytest.raises(MissingExtraError, match=r"pip install 'dlmrt\[tensorrt\]'"):
        TrtBackend(tiny_export, store.root)


@pytest.mark.parametrize("command", [["generate", "--prompt", "add:1+2="], ["eval", "--per-task", "1"]])
@pytest.mark.parametrize("arguments, message", [
    (["--engines", "x"], "--engines applies to --backend trt"),
    (["--precision", "nvfp4"], "--precision nvfp4 with --backend torch"),
    (["--backend", "ort", "--precision", "fp8"], "--precision applies to --backend trt and torch"),
    (["--backend", "trt"], "--backend trt needs --model EXPORT_DIR"),
    (["--backend", "ort", "--mode", "eager"], "--mode applies to --backend torch"),
    (["--backend", "trt", "--model", ".", "--device", "cpu"], "--backend trt runs on the GPU"),
])
def test_cli_option_misuse(command, arguments, message):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main

    result = CliRunner().invoke(main, [*command, *arguments])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_cli_device_cuda_without_a_gpu(backend):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main

    result = CliRunner().invoke(main, ["generate", "--prompt", "add:1+2=", "--backend", backend, "--device", "cuda"])
    assert result.exit_code == 2 and "sees no CUDA GPU here; use --device cpu" in result.output, result.output


def test_cli_eval_through_onnx_runtime(tiny_export):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main

    arguments = ["eval", "--per-task", "2", "--setting", "threshold:threshold=0.9", "--batch-size", "6"]
    ort = CliRunner().invoke(main, [*arguments, "--backend", "ort", "--model", str(tiny_export)])
    torch_run = CliRunner().invoke(main, [*arguments, "--mode", "eager"])
    assert ort.exit_code == 0 and torch_run.exit_code == 0, ort.output + torch_run.output
    def scores(output):  # setting, each task, mean, TPF and NFE: every cell but tokens/s (the one before NFE)
        rows = [line.split("│")[1:-1] for line in output.splitlines() if "threshold" in line]
        return [row[:-2] + row[-1:] for row in rows]

    assert len(scores(ort.output)) == 1 and scores(ort.output) == scores(torch_run.output), ort.output


def test_cli_trt_on_a_model_directory_or_without_tensorrt(tiny_export, store):
    from click.testing import CliRunner

    from dlmrt import TINY_MODEL_DIR
    from dlmrt.cli.commands import main

    def run(model):
        return CliRunner().invoke(main, ["generate", "--backend", "trt", "--model", str(model), "--engines",
                                         str(store.root), "--prompt", "add:1+2="])

    result = run(TINY_MODEL_DIR)
    assert result.exit_code == 2 and "is not a dlmrt export" in result.output, result.output
    assert "Traceback" not in result.output
    if importlib.util.find_spec("tensorrt") is None:
        result = run(tiny_export)
        assert result.exit_code == 2 and "pip install 'dlmrt[tensorrt]'" in result.output, result.output


@pytest.mark.trt
@pytest.mark.gpu
def test_real_engines_agree_with_torch(tiny_export, prompts, tmp_path):
    """Where TensorRT and a GPU are present: the tiny model's fp16 engines, built and run for real.
    Exact tokens are not expected of fp16 against fp32; agreement is."""
    from dlmrt.engines import builder

    version = builder.installed_tensorrt()
    if version is None:
        pytest.skip("TensorRT is not installed (it cannot be installed on the CPU machines)")
    if targets.running_gpu() is None:
        pytest.skip("no CUDA GPU")
    if int(version.split(".")[0]) >= 11:
        pytest.skip("TensorRT 11 needs a 16-bit export for fp16; covered by scripts/gpu_check.sh")
    capability, name = targets.running_gpu()
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, targets.target_for_capability(capability, name), "fp16", tensorrt=version,
                     store=store.root)
    build.run(plan, store, device=name, tensorrt_version=version)
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    found = Generator(TrtBackend(tiny_export, store.root, precision="fp16")).generate(prompts, settings).tokens
    expected = Generator(dlmrt.load(device="cuda"), mode="eager").generate(prompts, settings).tokens
    assert (found.cpu() == expected.cpu()).float().mean() >= 0.9


def test_eval_through_the_engines_scores_as_torch(tiny_export, store):
    from dlmrt.eval import evaluation
    from dlmrt.runtime.exported_model import ExportedModel

    examples = tasks.examples("test", 4, seed=3)
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    trt_backend, _ = backend(tiny_export, store)
    found = evaluation.exact_match(ExportedModel.load(tiny_export), examples, settings, batch_size=4,
                                   backend=trt_backend)
    expected = evaluation.exact_match(dlmrt.load(), examples, settings, batch_size=4, mode="eager")
    assert found.per_task == expected.per_task and found.metrics.nfe == expected.metrics.nfe
    with pytest.raises(ArgumentError, match="exceed the batch limit of 4"):
        evaluation.exact_match(ExportedModel.load(tiny_export), examples, settings, batch_size=8,
                               backend=trt_backend)


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_inspect_for_an_export_shows_the_engine_the_backend_runs(tiny_export, tmp_path, precision):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main

    store = EngineStore(tmp_path / "engines")
    for stored in ("fp16", "bf16"):
        plan = make_plan(tiny_export, targets.target_named("sm_90"), stored, tensorrt=TENSORRT, store=store.root,
                         ranges={"batch": DimRange(1, 2, 4)})
        build.run(plan, store, device="NVIDIA H200", tensorrt_version=TENSORRT, engine_builder=engine_builder)
    trt_backend, _ = backend(tiny_export, store, precision=precision)
    arguments = ["inspect", str(store.root), "--for", str(tiny_export), "--target", "sm_90", "--tensorrt", TENSORRT,
                 "--json", *(["--precision", precision] if precision else [])]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    [shown] = json.loads(result.output)
    assert shown["entry"] == str(trt_backend.selected.entry)
    assert trt_backend.selected.entry.name == f"sm_90-{precision or 'bf16'}"


def test_cli_trt_without_the_tensorrt_extra_names_it(tiny_export, monkeypatch):
    import sys

    from click.testing import CliRunner

    from dlmrt.cli.commands import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "onnx", None)  # a base install: no onnx
    for module in ("dlmrt.runtime.trt_backend", "dlmrt.engines.select", "dlmrt.engines.plugin_specs"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    result = CliRunner().invoke(main, ["generate", "--backend", "trt", "--model", str(tiny_export), "--prompt", "x"])
    assert result.exit_code == 2 and "pip install 'dlmrt[tensorrt]'" in result.output, result.output
