"""Each input format's validation at the point it enters: the JSON reader's bounds, config values of
the wrong type or out of range, sizes refused before anything is built, generation_config.json, shard
paths, special ids, and the manifests of exports and engine stores."""

from __future__ import annotations

import json
import re
import time

import pytest

import dlmrt
from dlmrt.core import limits
from dlmrt.core.errors import CheckpointError, DlmrtError, ResourceError
from dlmrt import models
from dlmrt.models import checkpoint
from helpers import LLADA, LLADA2, TOKENS, config, random_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoint.save(random_model(LLADA), tmp_path_factory.mktemp("validation") / "model")


@pytest.fixture
def model_dir(saved, tmp_path):
    import shutil

    return shutil.copytree(saved, tmp_path / "model")


def write_config(directory, text: str) -> None:
    (directory / "config.json").write_text(text)


def edited(directory, name="config.json", **changes):
    path = directory / name
    raw = json.loads(path.read_text()) if path.is_file() else {}
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize("text, message", [
    ('{"model_type": "llada", "d_model": NaN}', r"config.json is not valid JSON \(NaN is not a JSON number\)"),
    ('{"rope_theta": Infinity}', r"Infinity is not a JSON number"),
    ('{"n_layers": ' + "9" * 5000 + "}", r"config.json is not valid JSON \(Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' + "[" * 40 + "]" * 40 + "}", r"nested too deeply to be a dlmrt file \(at most 32 levels\)"),
    ('["llada"]', "must hold a JSON object, not an array"),
    ('"llada"', "must hold a JSON object, not a string"),
])
def test_the_json_reader_refuses_what_no_config_holds(model_dir, text, message):
    write_config(model_dir, text)
    with pytest.raises(CheckpointError, match=message):
        dlmrt.load(model_dir)


def test_not_utf8_and_too_large(model_dir, monkeypatch):
    (model_dir / "config.json").write_bytes(b'{"model_type": "ll\xffada"}')
    with pytest.raises(CheckpointError, match=r"config.json is not UTF-8 text \(byte 18\)"):
        dlmrt.load(model_dir)
    write_config(model_dir, json.dumps(LLADA))
    monkeypatch.setattr(limits, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"config.json is \d+ bytes, more than dlmrt reads as JSON \(at most "
                                              r"100 bytes\)"):
        dlmrt.load(model_dir)


@pytest.mark.parametrize("changes, message", [
    ({"model_type": ["llada"]}, "field 'model_type' must be a string"),
    ({"model_type": {"name": "llada"}}, "field 'model_type' must be a string"),
    ({"d_model": 10**30}, "field 'd_model' does not fit in 64 bits"),
    ({"d_model": 10**12}, r"d_model must lie in \[1, 131072\], got 1000000000000"),
    ({"n_layers": 10**6}, r"n_layers must lie in \[1, 1024\], got 1000000"),
    ({"n_layers": 0}, r"n_layers must lie in \[1, 1024\], got 0"),
    ({"rms_norm_eps": -1e-5}, r"rms_norm_eps must lie in \(0, 1\), got -1e-05"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must lie in \(0, 1\)"),
    ({"rope_theta": 0}, "rope_theta must be positive, got 0.0"),
    ({"rope_theta": -10.0}, "rope_theta must be positive"),
    ({"alibi": 0}, "alibi=0 is not supported"),  # 0 is not false
    ({"pad_token_id": LLADA["mask_token_id"]}, "the pad token id equals the mask token id"),
], ids=["model_type list", "model_type object", "beyond int64", "huge d_model", "a million layers", "no layers",
        "negative eps", "zero eps", "zero theta", "negative theta", "0 for false", "pad is mask"])
def test_config_values_of_the_wrong_type_or_range(model_dir, changes, message):
    edited(model_dir, **changes)
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=message):
        dlmrt.load(model_dir)
    assert time.perf_counter() - started < 10  # refused before anything is built


def test_infinite_float_in_config_is_refused(model_dir):
    write_config(model_dir, json.dumps(LLADA).replace('"rope_theta": 10000.0', '"rope_theta": 1e400'))
    with pytest.raises(CheckpointError, match="field 'rope_theta' must be a finite number"):
        dlmrt.load(model_dir)


@pytest.mark.parametrize("raw", [LLADA, config(LLADA, weight_tying=True, n_kv_heads=None),
                                 config(LLADA, embedding_size=64), LLADA2,
                                 config(LLADA2, num_experts=None, tie_word_embeddings=True),
                                 config(LLADA2, num_shared_experts=0, first_k_dense_replace=0)],
                         ids=["llada", "llada tied", "llada padded vocab", "llada2 moe", "llada2 dense",
                              "llada2 all moe"])
def test_the_parameter_estimate_counts_the_weights_a_model_has(raw):
    """The estimate the memory check uses, against the real count of a built model (norms, biases and
    routers' biases are what it leaves out: under 2% here, far less at scale)."""
    family = models.family_of(raw, "config")
    estimate = family.parameter_count(family.parse_config(dict(raw), "config"))
    model = models.create(raw, tokens=TOKENS)
    actual = sum(p.numel() for p in model.parameters())
    assert 0.98 * actual <= estimate <= actual


def test_weights_that_cannot_fit_are_refused_before_they_are_built(model_dir, monkeypatch):
    monkeypatch.setenv(limits.MEMORY_LIMIT_VARIABLE, "0.00001")  # 10 KiB: the tiny weights are ~40 KiB
    with pytest.raises(ResourceError, match=r"the model's weights in float32 needs .* KiB, more than "
                                            r"DLMRT_MEMORY_LIMIT_GIB=0.00001"):
        dlmrt.load(model_dir)
    huge = config(LLADA, d_model=65536, n_heads=512, n_kv_heads=512, mlp_hidden_size=131072, n_layers=1024)
    monkeypatch.delenv(limits.MEMORY_LIMIT_VARIABLE)
    with pytest.raises(ResourceError, match="more than this machine's memory"):
        models.create(huge, tokens=TOKENS)
    monkeypatch.setenv(limits.MEMORY_LIMIT_VARIABLE, "lots")
    with pytest.raises(DlmrtError, match="must be a positive number of GiB"):
        dlmrt.load(model_dir)


@pytest.mark.parametrize("changes, message", [
    ({"gen_length": 0}, r"field 'gen_length' must be an integer in \[1, 16777216\], got 0"),
    ({"gen_length": None}, "field 'gen_length' must be an integer"),
    ({"gen_length": "8"}, "field 'gen_length' must be an integer"),
    ({"gen_length": 8.0}, "field 'gen_length' must be an integer"),
    ({"gen_length": True}, "field 'gen_length' must be an integer"),  # not taken as 1
    ({"block_length": -4}, "field 'block_length' must be an integer"),
    ({"steps": 10**12}, "field 'steps' must be an integer"),
    ({"trained_gen_length": 0}, "field 'trained_gen_length' must be an integer"),
    ({"eos_token_id": []}, "field 'eos_token_id' must be a token id or a non-empty list of token ids"),
    ({"eos_token_id": [1, "2"]}, "field 'eos_token_id' must be a token id or a non-empty list"),
    ({"pad_token_id": -1}, "field 'pad_token_id' must be a token id"),
    ({"threshold": 2}, r"field 'threshold' must be a number in \(0, 1\]"),
    ({"temperature": -1}, "field 'temperature' must be a finite number >= 0"),
])
def test_generation_config_is_checked_where_it_is_read(model_dir, changes, message):
    edited(model_dir, "generation_config.json", **changes)
    with pytest.raises(CheckpointError, match=rf"generation_config.json: {message}"):
        dlmrt.load(model_dir)


def test_an_eos_id_from_generation_config_equal_to_the_mask_id(model_dir):
    edited(model_dir, "generation_config.json", eos_token_id=[LLADA["eos_token_id"], LLADA["mask_token_id"]])
    with pytest.raises(CheckpointError, match="the eos token id equals the mask token id"):
        dlmrt.load(model_dir)


def test_generation_config_keeps_the_fields_it_does_not_use(model_dir):
    edited(model_dir, "generation_config.json", gen_length=8, do_sample=False, transformers_version="4.44")
    found = dlmrt.load(model_dir).generation_config
    assert {k: found[k] for k in ("gen_length", "do_sample", "transformers_version")} == {
        "gen_length": 8, "do_sample": False, "transformers_version": "4.44"}


@pytest.mark.parametrize("shard", ["../elsewhere/x.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_shards_are_read_from_the_model_directory_only(model_dir, shard):
    (model_dir / "model.safetensors").rename(model_dir / "x.safetensors")
    index = {"weight_map": {"model.transformer.wte.weight": shard}}  # refused before any tensor is read
    (model_dir / checkpoint.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a file name: shards are read from the model directory itself"):
        dlmrt.load(model_dir)


def test_an_exports_text_files_are_checked_before_they_are_read(tiny_export, tmp_path):
    import shutil

    from dlmrt.export.export_manifest import ExportManifestError
    from dlmrt.runtime.exported_model import ExportedModel

    export = shutil.copytree(tiny_export, tmp_path / "export")
    (export / "generation_config.json").write_text('{"gen_length": 0}')
    with pytest.raises(ExportManifestError, match="generation_config.json was changed after export"):
        ExportedModel.load(export)
    shutil.copy(tiny_export / "generation_config.json", export / "generation_config.json")
    (export / "tokenizer.json").write_text("{}")
    with pytest.raises(ExportManifestError, match="tokenizer.json was changed after export"):
        ExportedModel.load(export)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("graphs"), "graphs is missing"),
    (lambda m: m.update(graphs=[]), "graphs is list, not dict"),
    (lambda m: m["graphs"]["full"].pop("engine_sha256"), "graphs.full.engine_sha256 is missing"),
    (lambda m: m["graphs"]["full"].update(engine="../../elsewhere.plan"), "must be a path inside the entry"),
    (lambda m: m["plugins"].append("dlmrt::x"), r"plugins\[\d\] must be an object"),
    (lambda m: m.update(ranges={"batch": 4}), "every value of ranges must be a string"),
    (lambda m: m.update(format_version=[1]), "has format version"),
])
def test_a_corrupt_engine_manifest_is_one_error(tiny_export, tmp_path, edit, message):
    from dlmrt.engines import build, manifest, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.store import EngineStore
    from fake_tensorrt import engine_builder

    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, targets.target_named("sm_90"), "bf16", tensorrt="10.13.0", store=store.root)
    entry = build.run(plan, store, device="NVIDIA H200", tensorrt_version="10.13.0", engine_builder=engine_builder)
    path = entry / "manifest.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    with pytest.raises(manifest.ManifestError, match=message):
        manifest.read(entry)


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=1e308), "temperature must fit in float32"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(cfg_scale=float("inf")), "cfg-scale must be a finite number"),
    (dict(seed=2**63), r"seed must be an integer in \[0, 2\*\*62\]"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"),
    (dict(gen_length=True), "gen-length must be an integer, got True"),
    (dict(gen_length=2**40, block_length=2**40), "gen-length must be at most 16777216"),
    (dict(policy="factor"), "policy must be a dlmrt.runtime.policies.Policy"),
    (dict(policy=("factor", 1e308)), "factor must fit in float32"),
    (dict(policy=("fixed", 10**9)), r"steps must be at most 16777216, got 1000000000"),
], ids=["huge temperature", "nan temperature", "inf cfg", "seed beyond int64", "negative seed", "bool seed",
        "bool length", "huge length", "policy a string", "huge factor", "a billion steps"])
def test_generation_settings_hold_what_the_step_tensors_hold(settings, message):
    from dlmrt.core.errors import ArgumentError
    from dlmrt.runtime import Factor, Fixed, GenerationSettings

    policy = settings.get("policy")
    if isinstance(policy, tuple):
        settings["policy"] = Factor(policy[1]) if policy[0] == "factor" else Fixed(policy[1])
    with pytest.raises(ArgumentError, match=message):
        GenerationSettings(**{"gen_length": 16, "block_length": 8, **settings}).validate()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(model_dir, value):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    state["model.transformer.blocks.1.ff_out.weight"][3, 4] = value
    save_file(state, path)
    with pytest.raises(CheckpointError, match=r"tensor 'model.transformer.blocks.1.ff_out.weight' holds 1 NaN or "
                                              r"infinite values \(loaded as float32\): the checkpoint is corrupt"):
        dlmrt.load(model_dir)


def test_weights_that_overflow_the_dtype_they_load_in(model_dir):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    state["model.transformer.wte.weight"][0, 0] = 1e5  # finite in float32, beyond float16's 65504
    save_file(state, path)
    assert dlmrt.load(model_dir) is not None
    with pytest.raises(CheckpointError, match=r"'model.transformer.wte.weight' holds 1 NaN or infinite values "
                                              r"\(loaded as float16\)"):
        dlmrt.load(model_dir, dtype="float16")


def test_the_optimized_model_cache_trusts_only_its_own_seals(tmp_path):
    import os
    import stat

    from dlmrt.runtime.ort_cache import KEY_FILE, OptimizedModelCache

    cache = OptimizedModelCache(tmp_path)
    path = cache.path("full", "ab" * 32, "all", "cpu")
    written = cache.writing_path(path)
    written.write_bytes(b"model bytes")
    cache.keep(written, path)
    assert cache.load(path) == b"model bytes"
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    path.write_bytes(b"model bytez")
    assert cache.load(path) is None and not path.exists()  # removed, to be optimized again
    written.write_bytes(b"model bytes")
    cache.keep(written, path)
    os.chmod(tmp_path / KEY_FILE, 0o644)  # a key others can read seals nothing
    assert cache.load(path) is None


def test_inspect_reports_every_broken_entry_of_a_store(tiny_export, tmp_path):
    import os
    import shutil

    from click.testing import CliRunner

    from dlmrt.cli.commands import main
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.store import EngineStore
    from fake_tensorrt import engine_builder

    store = EngineStore(tmp_path / "engines")
    entries = {}
    for precision in ("bf16", "fp16"):
        plan = make_plan(tiny_export, targets.target_named("sm_90"), precision, tensorrt="10.13.0", store=store.root)
        entries[precision] = build.run(plan, store, device="NVIDIA H200", tensorrt_version="10.13.0",
                                       engine_builder=engine_builder)
    model_dir = entries["bf16"].parent
    outside = tmp_path / "outside"
    shutil.copytree(entries["bf16"], outside)
    os.symlink(outside, model_dir / "sm_100-bf16")  # a link out of the store
    os.symlink(tmp_path / "nothing", model_dir / "sm_120-bf16")  # a link to nothing
    manifest = entries["fp16"] / "manifest.json"
    manifest.unlink()
    manifest.mkdir()  # a directory where the manifest belongs
    result = CliRunner().invoke(main, ["inspect", str(store.root)], env={"COLUMNS": "20"})
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    for entry, problem in (("sm_100-bf16", "leads out of the store"), ("sm_120-bf16", "is a link to nothing"),
                           ("sm_90-fp16", "has no manifest.json file")):  # each one line, however narrow the terminal
        assert any(line.startswith(f"{model_dir / entry} {problem}") for line in lines), result.output
    assert "sm_90-bf16" in "".join(result.output.split())  # the sound entry is still shown (in a folded table)
    assert store.entries() == [entries["bf16"]]  # and is the only one selection can take


@pytest.fixture(scope="module")
def other_export(exports):
    """Another model's graphs: more layers, other heads."""
    return exports["other"]


def rehashed(tiny_export, tmp_path, replace_graph):
    """A copy of the tiny export whose step_cached.onnx is `replace_graph(path)`'s, hashes updated."""
    import shutil

    from dlmrt.export.export_manifest import ExportManifest

    export = shutil.copytree(tiny_export, tmp_path / "export")
    replace_graph(export / "step_cached.onnx")
    ExportManifest.read(export).with_files(export).save(export)
    return export


@pytest.mark.parametrize("foreign", ["another model's graph", "another mask id"])
def test_a_graph_that_is_not_the_manifests_is_refused_before_it_runs_or_builds(tiny_export, other_export, tmp_path,
                                                                                foreign):
    import shutil

    import onnx

    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.export.export_manifest import ExportManifestError
    from dlmrt.runtime.ort_backend import OrtBackend

    def replace_graph(path):
        if foreign == "another model's graph":
            shutil.copy(other_export / "step_cached.onnx", path)
            return
        graph = onnx.load(path)
        for node in graph.graph.node:
            for attribute in node.attribute:
                if node.op_type == "ParallelUnmask" and attribute.name == "mask_id":
                    attribute.i = 5
        onnx.save(graph, path)

    export = rehashed(tiny_export, tmp_path, replace_graph)
    message = re.escape("step_cached.onnx does not match dlmrt.json: ") + (
        re.escape("input past_kv is float32 [3, 2") if foreign == "another model's graph"
        else "node .* unmasks with mask id 5, the manifest's is 2")
    with pytest.raises(ExportManifestError, match=message):
        OrtBackend(export)
    plan = make_plan(export, targets.target_named("sm_90"), "bf16", tensorrt="10.13.0", store=tmp_path / "store")
    with pytest.raises(ExportManifestError, match=message):
        build.dry_run_problems(plan)


def test_a_batch_whose_buffers_cannot_fit_is_refused_before_they_are_allocated(monkeypatch):
    from dlmrt.runtime import GenerationSettings, Generator, Threshold

    model = dlmrt.load()
    generator = Generator(model, mode="eager")
    settings = GenerationSettings(32, 8, Threshold(0.9), cache="dual")
    monkeypatch.setenv(limits.MEMORY_LIMIT_VARIABLE, "0.0005")  # 524 KiB: one row takes about 110 KiB
    generator.generate([[5, 6, 7]], settings)  # one row fits
    # K/V 4 layers x 2 x 8 rows x 2 heads x 40 positions x 32 x 4 bytes, scores 8 x 4 heads x 40 x 40 x 4,
    # logits 8 x 8 x 43 x 4: 871,168 bytes
    expected = (r"a batch of 8 over 40 positions \(tiny-llada\) needs 850.8 KiB, more than "
                r"DLMRT_MEMORY_LIMIT_GIB=0.0005 \(524.3 KiB\): decode fewer prompts at once")
    with pytest.raises(ResourceError, match=expected):
        generator.generate([[5, 6, 7]] * 8, settings)


def test_an_id_is_reported_from_the_file_it_came_from(model_dir):
    edited(model_dir, "generation_config.json", eos_token_id=[1, 999])
    with pytest.raises(CheckpointError, match=r"generation_config.json: the eos token id 999 lies outside the "
                                              r"vocabulary \[0, 43\) of .*config.json"):
        dlmrt.load(model_dir)


@pytest.mark.parametrize("options, message", [
    (dict(opset=99999), r"opset must lie in \[18, \d+\]"),
    (dict(opset=17), r"opset must lie in \[18, \d+\]"),
    (dict(block_length=0), r"block-length must lie in \[1, max-length = 64\], got 0"),
    (dict(max_batch=0), r"max-batch must lie in \[1, 65536\], got 0"),
    (dict(max_batch=10**9), r"max-batch must lie in \[1, 65536\]"),
])
def test_export_options_are_checked_before_any_graph(tmp_path, options, message):
    from dlmrt.core.errors import ArgumentError
    from dlmrt.export import onnx_export

    with pytest.raises(ArgumentError, match=message):
        onnx_export.export(dlmrt.load(), tmp_path / "out", **options)
    assert not list(tmp_path.iterdir())
