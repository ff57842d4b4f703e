"""ONNX export of the step graphs and the ONNX Runtime backend: same tokens as the torch backend, a
checked manifest, limits, and exports that never leave a half-written directory."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

import dlmrt  # noqa: E402
from dlmrt.core import tasks  # noqa: E402
from dlmrt.core.errors import ArgumentError, CheckpointError, UnsupportedFeatureError  # noqa: E402
from dlmrt.export import export_writer, onnx_export  # noqa: E402
from dlmrt.models import checkpoint
from dlmrt.export.export_manifest import MANIFEST_FILE, ExportLimits, ExportManifest  # noqa: E402
from dlmrt.runtime import (  # noqa: E402
    CACHE_MODES, Factor, Fixed, GenerationSettings, Generator, LLaDA2, ResidualPolicy, Threshold, text)
from dlmrt.runtime.batch_resources import resources  # noqa: E402
from dlmrt.runtime.ort_backend import OrtBackend  # noqa: E402
from helpers import LLADA, LLADA2, random_model  # noqa: E402
from shared_exports import SHARED_EXPORTS  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
POLICIES = [Fixed(12), Fixed(6), Fixed(12, "random"), Threshold(0.3), Threshold(0.3, "margin"),
            Factor(2.0, "entropy"), LLaDA2(0.3, 4)]


@pytest.fixture(scope="module")
def exported(exports):
    """(torch model, export directory) for the tiny model and random llada configs, ORL among them."""
    return {name: (SHARED_EXPORTS[name].model(), exports[name]) for name in ("tiny", "llada", "orl", "llada2")}


# Greedy, sampled and guided: what the graph's inputs carry besides the policy's numbers.
VARIANTS = ((0.0, 0.0), (0.8, 0.0), (0.0, 1.5))


@pytest.mark.parametrize("name, cache", [(name, cache) for name in ("llada", "orl", "llada2") for cache in CACHE_MODES
                                         if not (name == "llada2" and cache == "dual")])
def test_ort_gives_the_torch_tokens_for_every_policy(exported, name, cache):
    """Every policy under every cache mode; the variants rotate over both, so that each model meets
    every (policy, variant) and (cache, variant) pair without the whole cross product."""
    model, directory = exported[name]
    ort_generator, torch_generator = Generator(OrtBackend(directory)), Generator(model, mode="eager")
    for index, policy in enumerate(POLICIES):
        temperature, cfg_scale = VARIANTS[(index + CACHE_MODES.index(cache)) % len(VARIANTS)]
        settings = GenerationSettings(12, 4, policy, cache=cache, temperature=temperature, seed=3,
                                      cfg_scale=cfg_scale)
        expected = torch_generator.generate(PROMPTS, settings)
        got = ort_generator.generate(PROMPTS, settings)
        assert torch.equal(got.tokens, expected.tokens), (policy, temperature, cfg_scale)
        assert got.metrics.nfe == expected.metrics.nfe


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_ort_gives_the_torch_tokens_on_the_tiny_model(exported, cache):
    model, directory = exported["tiny"]
    prompts = [text.encode(model, e.prompt) for e in tasks.examples("test", 8, seed=5)]
    ort_generator, torch_generator = Generator(OrtBackend(directory)), Generator(model, mode="eager")
    for policy in (Fixed(16), Threshold(0.9), Factor(1.0)):
        settings = GenerationSettings(16, 8, policy, cache=cache)
        for start in range(0, len(prompts), 8):  # the export's batch limit
            batch = prompts[start:start + 8]
            assert torch.equal(ort_generator.generate(batch, settings).tokens,
                               torch_generator.generate(batch, settings).tokens)


def test_ort_binds_each_step_kind_once_and_no_kv_where_none_is_written(exported):
    model, directory = exported["orl"]
    backend = OrtBackend(directory)
    settings = GenerationSettings(12, 4, Threshold(0.3), cache="dual", ignore_eos=True)
    Generator(backend).generate(PROMPTS, settings)
    bindings = dict(resources(backend).executor.bound)
    assert torch.equal(Generator(backend).generate(PROMPTS, settings).tokens,
                       Generator(model, mode="eager").generate(PROMPTS, settings).tokens)
    assert resources(backend).executor.bound == bindings  # the second request binds nothing: the buffers are the same
    kinds = {(window, writes): binding for (_, (window, _, _, writes, _)), binding in bindings.items()}
    refresh, block = kinds[(24, 24)], kinds[(4, 0)]  # 3 rows of up to 9 + 12 tokens: a canvas of 24
    assert refresh.outputs["kv"].data_ptr() == refresh.state.kv.data_ptr()  # straight into the cache storage
    assert "kv" not in block.outputs
    assert not any("logits" in binding.outputs for binding in bindings.values())  # no row asked for logprobs


def test_manifest_records_the_contract(exported):
    model, directory = exported["orl"]
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert ExportManifest.read(directory).to_dict() == manifest  # the typed manifest holds all of it
    assert manifest["opset"] == 18 and manifest["model"]["residual"] is True
    assert manifest["tokens"]["mask_id"] == model.tokens.mask_id
    assert manifest["limits"] == {"max_batch": 8, "max_length": 48}
    assert set(manifest["files"]) == {"step_full.onnx", "step_cached.onnx", "step_full_guided.onnx",
                                      "step_cached_guided.onnx", "tokenizer.json", "generation_config.json"}
    cached = manifest["graphs"]["cached"]
    assert [i["name"] for i in cached["inputs"]][-5:] == ["past_kv", "past_positions", "past_key_mask", "z",
                                                          "certainty"]
    assert [o["name"] for o in cached["outputs"]] == ["new_ids", "confidence", "commit", "committed", "kv",
                                                      "next_z", "next_certainty", "logits"]


def test_the_custom_node_and_its_function_are_in_each_graph(exported):
    import onnx

    _, directory = exported["llada"]
    for graph in onnx_export.GRAPHS:
        model = onnx.load(directory / onnx_export.graph_file(graph))
        nodes = [n for n in model.graph.node if n.domain == "dlmrt"]
        assert [n.op_type for n in nodes] == ["ParallelUnmask"]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
        assert attributes["plugin_namespace"] == b"dlmrt"
        assert "ParallelUnmask" in {f.name for f in model.functions}


def test_a_changed_file_is_refused(exported, tmp_path):
    import shutil

    _, directory = exported["llada"]
    copy = shutil.copytree(directory, tmp_path / "copy")
    path = copy / "step_cached.onnx"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_cached.onnx was changed after export \(sha256"):
        OrtBackend(copy)


def test_limits_are_checked_before_compute(exported):
    _, directory = exported["llada"]
    generator = Generator(OrtBackend(directory))
    with pytest.raises(ArgumentError, match=r"9 prompts exceed the batch limit of 8: re-export with `dlmrt export"):
        generator.generate([[5, 6]] * 9, GenerationSettings(8, 4))
    with pytest.raises(ArgumentError, match=r"needs 52 positions, more than the model's context of 48: re-export"):
        generator.generate([[5] * 40], GenerationSettings(12, 4))
    tiny = Generator(OrtBackend(exported["tiny"][1]))
    with pytest.raises(ArgumentError, match=r"exported without the guidance graphs: re-export with `dlmrt export "
                                            r"--guidance`"):
        tiny.generate([[5, 6]], GenerationSettings(8, 4, cfg_scale=1.0))


def test_unsupported_family_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "EXPORTABLE_FAMILIES", ("llada",))
    with pytest.raises(UnsupportedFeatureError, match="exporting llada2_moe models is not supported"):
        onnx_export.export(random_model(LLADA2), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_block_causal_exports_fix_their_grid(exported):
    _, directory = exported["llada2"]
    with pytest.raises(ArgumentError, match="was exported for blocks of 4 .* re-export with --block-length 8"):
        Generator(OrtBackend(directory)).generate([[5, 6]], GenerationSettings(16, 8, LLaDA2()))


def test_a_failed_export_leaves_no_directory(monkeypatch, tmp_path):
    calls = []

    def export_graph(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt  # as if the user stopped it after the first graph started

    monkeypatch.setattr(onnx_export, "export_graph", export_graph)
    with pytest.raises(KeyboardInterrupt):
        onnx_export.export(random_model(LLADA), tmp_path / "out")
    assert calls and not (tmp_path / "out").exists()
    assert not list(tmp_path.iterdir())  # the staging directory is gone too


def test_not_an_export_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a dlmrt export"):
        OrtBackend(tmp_path)


def test_residual_policy_runs_through_ort(exported):
    model, directory = exported["orl"]
    settings = GenerationSettings(12, 12, ResidualPolicy(Threshold(0.3)), cache="dual")
    assert torch.equal(Generator(OrtBackend(directory)).generate(PROMPTS, settings).tokens,
                       Generator(model, mode="eager").generate(PROMPTS, settings).tokens)


def test_cli_export_and_generate_with_ort(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main
    from dlmrt.models import checkpoint

    monkeypatch.setenv("DLMRT_HOME", str(tmp_path / "home"))
    model_dir = checkpoint.save(random_model(LLADA), tmp_path / "model")
    runner = CliRunner()
    exported = runner.invoke(main, ["export", str(model_dir), "-o", str(tmp_path / "export"), "--max-batch", "4"])
    assert exported.exit_code == 0, exported.output
    assert "step_full.onnx" in exported.output and "step_cached.onnx" in exported.output
    args = ["generate", "--prompt-ids", "5,6,7", "--prompt-ids", "8,9", "--gen-length", "8", "--block-length", "4",
            "--policy", "threshold", "--threshold", "0.3", "--cache", "dual", "--json"]
    torch_out = json.loads(runner.invoke(main, [*args, "--model", str(model_dir), "--mode", "eager"]).output)["outputs"]
    ort_out = runner.invoke(main, [*args, "--model", str(tmp_path / "export"), "--backend", "ort"])
    assert ort_out.exit_code == 0, ort_out.output
    assert json.loads(ort_out.output)["outputs"] == torch_out
    # a model directory is exported into $DLMRT_HOME on first use
    cached = runner.invoke(main, [*args, "--model", str(model_dir), "--backend", "ort"])
    assert cached.exit_code == 0, cached.output
    assert json.loads(cached.output)["outputs"] == torch_out
    assert len(list((tmp_path / "home" / "exports").iterdir())) == 1


@pytest.mark.parametrize("name", ["tiny", "orl", "llada2"])
def test_polygraphy_finds_each_graph_equal_to_the_torch_step(exported, name):
    from dlmrt.export.verify import compare_with_torch

    model, directory = exported[name]
    results = compare_with_torch(model, directory, grid=4 if model.block_causal else None)
    expected = ["full", "cached"] + (["full_guided", "cached_guided"] if name != "tiny" else [])
    assert sorted(results) == sorted(expected) and all(check.passed for check in results.values())


def test_polygraphy_sees_a_different_model(exported):
    from dlmrt.export.verify import compare_with_torch

    _, directory = exported["llada"]
    other = random_model(LLADA, seed=9)  # same shapes, other weights
    assert not any(check.passed for check in compare_with_torch(other, directory).values())


def test_export_verify_prints_a_short_result_and_no_polygraphy_log(tmp_path):
    """What a user sees: the files, one line a graph with its largest differences, a verdict; no
    Polygraphy log (that is --verbose), no warning about its colours, no numpy RuntimeWarning."""
    import subprocess
    import sys

    model_dir = checkpoint.save(random_model(LLADA), tmp_path / "model")
    result = subprocess.run([sys.executable, "-m", "dlmrt.cli", "export", str(model_dir), "-o", str(tmp_path / "out"),
                             "--max-batch", "2", "--max-length", "32", "--verify"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert len(output.splitlines()) < 25, output
    assert "verified: every graph's outputs" in output
    assert all(f"{graph} " in output for graph in ("full", "cached")), output
    for noise in ("[I]", "[W]", "Polygraphy", "colored", "RuntimeWarning"):
        assert noise not in output, noise


def test_an_export_killed_midway_leaves_nothing_that_loads(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    script = f"import dlmrt; from dlmrt.export.onnx_export import export; export(dlmrt.load(), {str(out)!r})"
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.*.partial/step_full.onnx")):  # killed once the first graph is written
        assert process.poll() is None and time.monotonic() < deadline, "the export ended before it was killed"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not out.exists()
    with pytest.raises(CheckpointError, match="is not a dlmrt export"):
        OrtBackend(out)


def test_large_weights_go_to_external_data(monkeypatch, tmp_path):
    monkeypatch.setattr(export_writer, "EXTERNAL_DATA_BYTES", 0)
    model = random_model(LLADA)
    directory = onnx_export.export(model, tmp_path / "out", max_batch=4, max_length=32)
    assert {"step_full.onnx.data", "step_cached.onnx.data"} <= set(ExportManifest.read(directory).files)
    settings = GenerationSettings(8, 4, Threshold(0.3), cache="prefix")
    assert torch.equal(Generator(OrtBackend(directory)).generate(PROMPTS[:2], settings).tokens,
                       Generator(model, mode="eager").generate(PROMPTS[:2], settings).tokens)


def test_half_precision_exports(tmp_path):
    model = dlmrt.load(dtype="float16")
    directory = onnx_export.export(model, tmp_path / "fp16", max_batch=4, max_length=32)
    prompt = [model.tokenizer.encode("add:762+139=").ids]
    result = Generator(OrtBackend(directory)).generate(prompt, GenerationSettings(16, 8, Threshold(0.9)))
    assert model.tokenizer.decode(result.rows[0].token_ids) == "0901"
    bf16 = onnx_export.export(dlmrt.load(dtype="bfloat16"), tmp_path / "bf16", max_batch=4, max_length=32)
    with pytest.raises(ArgumentError, match="holds bfloat16 graphs, which ONNX Runtime cannot run here"):
        OrtBackend(bf16)


def test_a_saved_optimized_model_is_reused(exported, tmp_path):
    model, directory = exported["llada"]
    settings = GenerationSettings(12, 4, Threshold(0.3), cache="prefix")
    first = Generator(OrtBackend(directory, optimized_model_dir=tmp_path)).generate(PROMPTS, settings).tokens
    saved = sorted(p.name for p in tmp_path.iterdir())
    models = [name for name in saved if name.endswith(".onnx")]
    assert len(models) == 4 and all(name.endswith("-all-cpu.onnx") for name in models)
    assert sorted(set(saved) - set(models)) == sorted([".key", *(f"{name}.hmac" for name in models)])
    second = Generator(OrtBackend(directory, optimized_model_dir=tmp_path)).generate(PROMPTS, settings).tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == saved
    eager = Generator(model, mode="eager").generate(PROMPTS, settings).tokens
    assert torch.equal(first, second) and torch.equal(first, eager)


def test_an_export_for_one_row_and_a_short_context(tmp_path):
    """Limits below the exporter's example inputs (batch 3, window 6) still export: the graph is built
    wider, and the manifest's limits are what the backend enforces."""
    model = random_model(LLADA)
    directory = onnx_export.export(model, tmp_path / "out", max_batch=1, max_length=6)
    assert ExportManifest.read(directory).limits == ExportLimits(max_batch=1, max_length=6)
    settings, prompt = GenerationSettings(4, 4, Threshold(0.3), cache="prefix"), [PROMPTS[1]]  # 2 + 4 positions
    found = Generator(OrtBackend(directory)).generate(prompt, settings).tokens
    assert torch.equal(found, Generator(model, mode="eager").generate(prompt, settings).tokens)
    with pytest.raises(ArgumentError, match="re-export"):
        Generator(OrtBackend(directory)).generate(prompt * 2, settings)


def test_a_tampered_optimized_model_is_never_served(exported, tmp_path):
    """The saved optimized models are executable: one whose bytes changed (here, every weight of the
    graph negated, seal kept) is deleted and optimized again from the checked export."""
    import onnx.numpy_helper

    model, directory = exported["llada"]
    settings = GenerationSettings(12, 4, Threshold(0.3), cache="prefix")
    eager = Generator(model, mode="eager").generate(PROMPTS, settings).tokens
    Generator(OrtBackend(directory, optimized_model_dir=tmp_path)).generate(PROMPTS, settings)
    for path in tmp_path.glob("*.onnx"):
        graph = onnx.load(path)
        for initializer in graph.graph.initializer:
            if initializer.data_type == onnx.TensorProto.FLOAT:
                values = -onnx.numpy_helper.to_array(initializer)
                initializer.CopyFrom(onnx.numpy_helper.from_array(values, initializer.name))
        onnx.save(graph, path)
    tampered = {path.name: path.read_bytes() for path in tmp_path.glob("*.onnx")}
    found = Generator(OrtBackend(directory, optimized_model_dir=tmp_path)).generate(PROMPTS, settings).tokens
    assert torch.equal(found, eager)
    assert all(path.read_bytes() != tampered[path.name] for path in tmp_path.glob("*.onnx"))  # optimized afresh
