"""DiffusionGemma exported to ONNX (`dlmrt/export/uniform_export.py`: encode, decode and soft_tokens graphs) and
run by ONNX Runtime (`dlmrt/runtime/ort_backend.py`): the torch encoder's cache, the torch decoder's logits and
the torch tokens.

Exporting the fixture takes two to three minutes on a 2-core CPU (torch.onnx.export of two 6-layer
graphs, the MoE experts run densely), so the tests that read the export are marked slow; the rest
run in seconds.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from dlmrt.core.errors import ArgumentError  # noqa: E402
from dlmrt.export import onnx_export  # noqa: E402
from dlmrt.models import checkpoint
from dlmrt.export.export_manifest import (CANVAS_GRAPHS, MANIFEST_FILE, ExportManifest,  # noqa: E402
                                          ExportManifestError)
from dlmrt.models.residual import Residual  # noqa: E402
from dlmrt.runtime import EntropyBound, GenerationSettings, Generator, Threshold  # noqa: E402
from dlmrt.runtime.exported_model import ExportedModel  # noqa: E402
from dlmrt.models.denoiser import LayerGroupKV  # noqa: E402
from dlmrt.runtime.uniform_state import zero_cache  # noqa: E402
from dlmrt.runtime.ort_backend import OrtBackend  # noqa: E402
from shared_exports import SHARED_EXPORTS  # noqa: E402

DATA = Path(__file__).parents[1] / "data"
MODEL_DIR = DATA / "diffusion_gemma"
EXPECTED = load_file(str(MODEL_DIR / "expected.safetensors"))
SELF_CONDITIONING_TEMPERATURE = json.loads((MODEL_DIR / "expected.json").read_text())["self_conditioning_temperature"]
TOLERANCE = 1e-4  # float32
MAX_BATCH, MAX_LENGTH = (SHARED_EXPORTS["diffusion_gemma"].options[name] for name in ("max_batch", "max_length"))
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]  # left-padded to 9 in the batch


def load_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the image tower is not loaded, and says so
        return checkpoint.load(MODEL_DIR).eval()


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def exported(exports) -> Path:
    return exports["diffusion_gemma"]


@pytest.fixture(scope="module")
def backend(exported) -> OrtBackend:
    return OrtBackend(exported, threads=1)


def ort_run(backend, graph: str, feeds) -> list[torch.Tensor]:
    """`graph`'s session run on copies of `feeds`, outside the runtime's bindings."""
    arrays = {name: np.ascontiguousarray(tensor.detach().numpy()) for name, tensor in feeds.items()}
    return [torch.from_numpy(array) for array in backend.sessions[graph].run(None, arrays)]


def graph_feeds(backend, ids, positions, key_mask, cache):
    """The encoder's or decoder's feeds: the loop's `[B, P + T]` key mask split at the cache's P (None:
    no context)."""
    if cache is None:
        cache = zero_cache(backend.cache_groups(), ids.shape[0], 0, backend.spec.dtype)
    prefix = cache.positions.shape[1]
    return {"ids": ids, "positions": positions, "key_mask": key_mask[:, prefix:],
            "past_key_mask": key_mask[:, :prefix], "past_sliding": cache.sliding, "past_full": cache.full,
            "past_positions": cache.positions}


def ort_encode(backend, ids, positions, key_mask, cache) -> LayerGroupKV:
    return LayerGroupKV(*ort_run(backend, "encode", graph_feeds(backend, ids, positions, key_mask, cache)))


def ort_decode(backend, canvas, positions, key_mask, cache, soft_tokens):
    """One run of the decode graph: logits of `canvas` after `cache` (None: no context), conditioned on
    `soft_tokens` (None: the first step, z = 0)."""
    z = torch.zeros(*canvas.shape, backend.spec.hidden_size) if soft_tokens is None else soft_tokens.z
    feeds = graph_feeds(backend, canvas, positions, key_mask, cache)
    feeds["canvas"] = feeds.pop("ids")
    (logits,) = ort_run(backend, "decode", {**feeds, "z": z})
    return logits


def ort_soft_tokens(backend, scaled_logits):
    return Residual(*ort_run(backend, "soft_tokens", {"scaled_logits": scaled_logits.float()}))


def largest_difference(got, expected) -> float:
    return (got.float() - expected.float()).abs().max().item()


def assert_close(got, expected, tolerance: float = TOLERANCE) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert largest_difference(got, expected) <= tolerance


def recorded_steps():
    """The recorded inputs, as tests/models/test_diffusion_gemma.py's decode_steps feeds them: (prompt, its
    positions and key mask), (canvas, ...), (next canvas, ...), each key mask over [cache; ids]."""
    prompt, canvas, following = EXPECTED["prompt"], EXPECTED["canvas"], EXPECTED["next_canvas"]
    batch, length = prompt.shape
    width = canvas.shape[1]

    def span(start: int, size: int):
        return torch.arange(start, start + size)[None].expand(batch, -1), torch.ones(batch, start + size,
                                                                                    dtype=torch.bool)
    return (prompt, *span(0, length)), (canvas, *span(length, width)), (following, *span(length + width, width))


# -- without an export --------------------------------------------------------------------------------------
def test_zero_z_is_exactly_the_decoders_first_step(model):
    """The decode graph always takes z; zeros must be the model's residual=None path, bit for bit."""
    (prompt, positions, key_mask), (canvas, canvas_positions, canvas_mask), _ = recorded_steps()
    with torch.no_grad():
        cache = model.encode(prompt, positions=positions, key_mask=key_mask)
        none = model.denoise(canvas, positions=canvas_positions, key_mask=canvas_mask, past=cache).logits
        zeros = model.denoise(canvas, positions=canvas_positions, key_mask=canvas_mask, past=cache,
                              residual=Residual(torch.zeros(*canvas.shape, model.hidden_size), None)).logits
    assert torch.equal(none, zeros)


def test_export_refuses_what_uniform_noise_graphs_do_not_have(model, tmp_path):
    for options in ({"guidance": True}, {"block_length": 8}):
        with pytest.raises(ArgumentError, match="does not apply to diffusion_gemma"):
            onnx_export.export(model, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def uniform_manifest() -> dict:
    tensor = {"name": "canvas", "dtype": "int64", "shape": ["batch", "window"]}
    graphs = {name: {"file": f"{name}.onnx", "inputs": [tensor], "outputs": [tensor]} for name in CANVAS_GRAPHS}
    return {
        "format_version": 1, "dlmrt_version": "0.1.0", "torch_version": "2.13.0", "onnx_version": "1.23.2",
        "opset": 18, "exported_s": 1.5,
        "model": {"name": "m", "model_type": "diffusion_gemma", "dtype": "float32", "vocab_size": 96,
                  "hidden_size": 32, "num_layers": 6, "num_kv_heads": 2, "head_dim": 8, "max_positions": 512,
                  "block_causal": False, "block_grid": None, "residual": False, "noise": "uniform",
                  "canvas_length": 8},
        "tokens": {"mask_id": None, "eos_ids": [1], "pad_id": 0},
        "limits": {"max_batch": 4, "max_length": 48},
        "graphs": graphs, "files": {f"{name}.onnx": "ab" * 32 for name in CANVAS_GRAPHS},
    }


def read(tmp_path: Path, data: dict) -> ExportManifest:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    return ExportManifest.read(tmp_path)


def test_a_uniform_noise_manifest_reads_and_round_trips(tmp_path):
    data = uniform_manifest()
    manifest = read(tmp_path, data)
    assert manifest.model.noise == "uniform" and manifest.model.canvas_length == 8
    assert manifest.tokens.mask_id is None and not manifest.supports_guidance and not manifest.supports_editing
    assert manifest.to_dict() == data


def test_older_manifests_read_as_mask_models_and_are_written_as_before():
    manifest = ExportManifest.load(DATA / "export-v1")
    assert manifest.model.noise == "mask" and manifest.model.canvas_length is None
    data = json.loads((DATA / "export-v1" / MANIFEST_FILE).read_text())
    assert manifest.to_dict() == data  # no new field is written for a mask model
    assert ExportedModel.load(DATA / "export-v1").noise == "mask"


@pytest.mark.parametrize("change, message", [
    (lambda d: d["graphs"].pop("decode"), r"graphs\.decode is missing"),
    (lambda d: d["graphs"].update(full=d["graphs"]["decode"]), r"graphs\.full is not a uniform-noise model's graph"),
    (lambda d: d["model"].update(noise="gaussian"), r"model\.noise must be one of mask, uniform"),
    (lambda d: d["model"].pop("noise"), r"tokens\.mask_id must be an integer, got null"),
    (lambda d: d["model"].update(canvas_length=0), r"model\.canvas_length must be positive"),
])
def test_a_malformed_uniform_noise_manifest_is_named(tmp_path, change, message):
    data = uniform_manifest()
    change(data)
    with pytest.raises(ExportManifestError, match=message):
        read(tmp_path, data)


# -- the export, against torch -----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_export_holds_three_checked_graphs_and_a_uniform_manifest(exported, model):
    manifest = ExportManifest.load(exported)
    assert tuple(manifest.graphs) == CANVAS_GRAPHS
    assert set(manifest.files) == {"encode.onnx", "decode.onnx", "soft_tokens.onnx", "generation_config.json"}
    facts = manifest.model
    assert (facts.noise, facts.canvas_length, facts.block_grid, manifest.tokens.mask_id) == ("uniform", 8, None, None)
    assert json.loads((exported / MANIFEST_FILE).read_text()) == manifest.to_dict()
    shapes = {role: {c.name: c.shape for c in getattr(manifest.graphs["encode"], role)} for role in ("inputs",
                                                                                                     "outputs")}
    assert shapes["inputs"]["past_sliding"] == (4, 2, "batch", 2, "prefix", 8)
    assert shapes["inputs"]["past_full"] == (2, 2, "batch", 1, "prefix", 16)
    assert shapes["outputs"]["sliding"][4] == shapes["outputs"]["cache_positions"][1]  # P + T
    for graph in CANVAS_GRAPHS:
        onnx_model = onnx.load(str(exported / manifest.graphs[graph].file))
        onnx.checker.check_model(onnx_model, full_check=True)
        # the experts run densely: nothing in the graph picks tokens by data
        assert not {n.op_type for n in onnx_model.graph.node} & {"NonZero", "Unique", "Loop", "If"}
    exported_model = ExportedModel.load(exported)
    assert exported_model.noise == "uniform" and exported_model.default_block_length == model.canvas_length


@pytest.mark.slow
def test_the_encoder_cache_matches_torch_from_an_empty_prefix_and_after_a_commit(backend, model):
    (prompt, positions, key_mask), (canvas, canvas_positions, canvas_mask), _ = recorded_steps()
    with torch.no_grad():
        expected = model.encode(prompt, positions=positions, key_mask=key_mask)
        committed = model.encode(canvas, positions=canvas_positions, key_mask=canvas_mask, past=expected)
    got = ort_encode(backend, prompt, positions, key_mask, None)  # the prompt: the encode graph over P = 0
    got_committed = ort_encode(backend, canvas, canvas_positions, canvas_mask, got)
    for ours, theirs in ((got, expected), (got_committed, committed)):
        assert_close(ours.sliding, theirs.sliding)
        assert_close(ours.full, theirs.full)
        assert torch.equal(ours.positions, theirs.positions)


@pytest.mark.slow
def test_the_decoder_logits_match_torch_on_the_recorded_steps(backend, model):
    (prompt, positions, key_mask), (canvas, canvas_positions, canvas_mask), following = recorded_steps()
    with torch.no_grad():
        cache = model.encode(prompt, positions=positions, key_mask=key_mask)
        first = model.denoise(canvas, positions=canvas_positions, key_mask=canvas_mask, past=cache).logits
        signal = model.soft_tokens(EXPECTED["first_logits"] / SELF_CONDITIONING_TEMPERATURE)
        second = model.denoise(canvas, positions=canvas_positions, key_mask=canvas_mask, past=cache,
                               residual=signal).logits
        committed = model.encode(canvas, positions=canvas_positions, key_mask=canvas_mask, past=cache)
        after = model.denoise(following[0], positions=following[1], key_mask=following[2], past=committed).logits
    ort_cache = ort_encode(backend, prompt, positions, key_mask, None)
    ort_first = ort_decode(backend, canvas, canvas_positions, canvas_mask, ort_cache, None)
    ort_signal = ort_soft_tokens(backend, EXPECTED["first_logits"] / SELF_CONDITIONING_TEMPERATURE)
    ort_second = ort_decode(backend, canvas, canvas_positions, canvas_mask, ort_cache, ort_signal)
    ort_committed = ort_encode(backend, canvas, canvas_positions, canvas_mask, ort_cache)
    ort_after = ort_decode(backend, *following, ort_committed, None)
    for got, expected, recorded in ((ort_first, first, "first_logits"), (ort_second, second, "second_logits"),
                                    (ort_after, after, "next_logits")):
        assert_close(got, expected)
        assert_close(got, EXPECTED[recorded], 2 * TOLERANCE)  # the public code's, through torch's
    assert largest_difference(ort_second, ort_first) > 0.5  # the self-conditioned step is not the first again


@pytest.mark.slow
def test_soft_tokens_and_a_canvas_without_context_match_torch(backend, model):
    scaled = EXPECTED["second_logits"] / 0.3
    expected = model.soft_tokens(scaled)
    got = ort_soft_tokens(backend, scaled)
    assert_close(got.z, expected.z, 1e-6)
    assert_close(got.certainty, expected.certainty, 1e-6)
    canvas = EXPECTED["canvas"]
    positions = torch.arange(canvas.shape[1])[None].expand(canvas.shape[0], -1)
    with torch.no_grad():
        alone = model.denoise(canvas, residual=expected).logits
    assert_close(ort_decode(backend, canvas, positions, torch.ones(canvas.shape, dtype=torch.bool), None, got), alone)


# On this random model ORT's tokens can only be compared where float noise cannot decide them: the
# self-conditioning feeds each step's soft tokens to the next, and on a near-uniform distribution that
# chain amplifies a difference 10-30x per step (ORT's 3e-5 on the first step passes 5e-3 by the fourth).
# With one step per block there is no self-conditioning, and this seed's smallest decision margins
# (argmax and Gumbel gaps) are 2.5e-3 in logit units or more. The trained model below, whose
# distributions are peaked, is compared at the public defaults.
@pytest.mark.slow
def test_ort_runs_the_loop_as_torch_on_the_random_model(backend, model):
    settings = GenerationSettings(16, 8, EntropyBound(steps=1, t_min=0.01, t_max=0.02), seed=0)
    expected = Generator(model, mode="eager").generate(PROMPTS, settings)
    got = Generator(backend).generate(PROMPTS, settings)
    assert torch.equal(got.tokens, expected.tokens)
    assert got.metrics.nfe == expected.metrics.nfe


TINY = Path(__file__).parents[2] / "dlmrt" / "assets" / "tiny-diffusion-gemma"


@pytest.fixture(scope="module")
def trained_export(exports):
    """(model, export directory) of the DiffusionGemma-shaped model trained on the task suite."""
    return checkpoint.load(TINY), exports["tiny_diffusion_gemma"]


@pytest.mark.slow
@pytest.mark.parametrize("settings", [GenerationSettings(16, 16, EntropyBound(), seed=0),
                                      GenerationSettings(32, 16, EntropyBound(steps=8), seed=5)],
                         ids=["defaults", "two-blocks"])
def test_ort_gives_the_torch_tokens_of_the_trained_model(trained_export, settings):
    from dlmrt.core import tasks

    model, exported = trained_export
    prompts = [model.tokenizer.encode(e.prompt).ids for e in tasks.examples("test", 4, 0)]
    expected = Generator(model, mode="eager").generate(prompts, settings)
    got = Generator(OrtBackend(exported, threads=1)).generate(prompts, settings)
    assert torch.equal(got.tokens, expected.tokens)
    assert got.metrics.nfe == expected.metrics.nfe
    assert [r.finish_reason for r in got.rows] == [r.finish_reason for r in expected.rows]


@pytest.mark.slow
def test_requests_beyond_the_export_fail_before_any_compute(backend, monkeypatch):
    def no_compute(graph, *args, **kwargs):
        raise AssertionError(f"the {graph} graph was bound to run")

    monkeypatch.setattr(backend, "bind", no_compute)
    generator = Generator(backend)
    too_long = GenerationSettings(64, 64, EntropyBound(steps=2))  # a block longer than the export's 48 positions
    with pytest.raises(ArgumentError, match=r"needs \d+ positions, more than the model's context of 48: "
                                            r"re-export with `dlmrt export .* --max-length N`"):
        generator.generate(PROMPTS, too_long)
    with pytest.raises(ArgumentError, match=r"5 prompts exceed the batch limit of 4: re-export"):
        generator.generate(PROMPTS + PROMPTS[:2], GenerationSettings(16, 8, EntropyBound(steps=2)))
    with pytest.raises(ArgumentError, match="policy 'threshold' is mask-based"):
        generator.generate(PROMPTS, GenerationSettings(16, 8, Threshold(0.9)))


@pytest.mark.slow
def test_the_cli_runs_a_uniform_noise_export_on_ort_canvas(exported):
    from dlmrt.cli.backends import open_backend

    model, backend = open_backend("ort", exported, dtype="float32", mode="auto", max_batch=8, device="auto",
                                  engines=None, precision=None, console=None)
    assert isinstance(backend, OrtBackend) and backend.spec.noise == "uniform"
    assert model.noise == "uniform" and model.default_block_length == 8


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_100", "sm_120"])
def test_dry_run_plans_the_three_graphs_in_nvfp4_and_the_preflight_passes(exported, tmp_path, target):
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan

    plan = make_plan(exported, targets.target_named(target), "nvfp4", tensorrt="11.4", store=tmp_path)
    assert [graph.name for graph in plan.graphs] == list(CANVAS_GRAPHS)
    assert plan.ranges["prefix"].startswith("0:")  # the prompt runs the encoder over no prefix
    encode = next(graph for graph in plan.graphs if graph.name == "encode")
    assert encode.shapes["past_sliding"][0][4] == 0 and encode.shapes["ids"][1] == [1, 8]  # opt: the canvas
    assert not any("experts" in note for note in plan.notes)  # the experts are FP4 too
    assert plan.plugins == []  # the step runs between the graphs, not inside them
    assert list(build.dry_run_problems(plan)) == []


@pytest.mark.slow
def test_calibration_records_each_graph_from_the_uniform_noise_loop(trained_export):
    from dlmrt.quant.calibration import calibration_feeds

    _, exported = trained_export

    for graph in CANVAS_GRAPHS:
        feeds = calibration_feeds(exported, graph, count=3, batch_size=2)  # the task suite's prompts
        names = [c.name for c in ExportManifest.load(exported).graphs[graph].inputs]
        assert len(feeds) == 3 and all(sorted(feed) == sorted(names) for feed in feeds)
    decode = calibration_feeds(exported, "decode", prompts=["sort:31="], count=2)
    assert not np.array_equal(decode[0]["canvas"], decode[1]["canvas"])  # copies, step by step
    assert not decode[0]["z"].any() and decode[1]["z"].any()  # a block's first step has no soft tokens


@pytest.mark.slow
def test_nvfp4_quantizes_every_expert_of_the_decoder(trained_export, tmp_path):
    """Each expert's two projections (Gemms on slices of the stacked weights) become NVFP4 MatMuls whose FP4
    weights decode to the NVFP4 fake quantization of that expert's own slice; the stacked initializers go."""
    from dlmrt.quant import nvfp4, nvfp4_onnx
    from dlmrt.quant.calibration import calibration_feeds

    model, exported = trained_export
    feeds = calibration_feeds(exported, "decode", prompts=["sort:31=", "rev:abc="], count=2)
    report = nvfp4_onnx.quantize_onnx(exported / "decode.onnx", tmp_path / "decode.onnx", feeds)
    quantized = onnx.load(tmp_path / "decode.onnx")
    assert nvfp4_onnx.check_nvfp4_graph(quantized) == []
    onnx.checker.check_model(quantized)
    config = model.config.text
    experts = {node: module for node, module in report.quantized.items() if module.endswith(".experts")}
    assert len(experts) == config.num_hidden_layers * config.num_experts * 2
    assert not any(i.name.endswith(("gate_up_proj", "down_proj")) for i in quantized.graph.initializer)
    initializers = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}

    def decoded(node: str) -> np.ndarray:
        codes, scales = initializers[f"{node}.weight.fp4"], initializers[f"{node}.weight.block_scales"]
        rows, k = codes.shape
        return (codes.astype(np.float32).reshape(rows, k // 16, 16) * (scales.astype(np.float32)
                * initializers[f"{node}.weight.global_scale"])[..., None]).reshape(rows, k)

    for index, layer in enumerate(model.blocks()):
        mine = sorted(decoded(node).tobytes() for node, module in experts.items()
                      if module.endswith(f".layers.{index}.experts"))
        stacked = (layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach())
        expected = sorted(nvfp4.fake_quantize(weight[e]).numpy().tobytes() for weight in stacked
                          for e in range(config.num_experts))
        assert mine == expected


@pytest.mark.slow
def test_the_engines_run_the_uniform_noise_loop_with_the_tokens_of_onnx_runtime_and_torch(trained_export, tmp_path):
    """TrtBackend on the three graphs' engines (the recording fake of TensorRT, which runs each engine's
    ONNX graph at the bound addresses): the encoder once per block, the decoder and soft tokens bound once to
    the bucket's buffers."""
    from dlmrt.core import tasks
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.profiles import DimRange
    from dlmrt.engines.store import EngineStore
    from dlmrt.runtime.trt_backend import TrtBackend
    from fake_tensorrt import FakeTensorRT, engine_builder

    model, exported = trained_export
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(exported, targets.target_named("sm_90"), "bf16", tensorrt="10.13.0", store=store.root,
                     ranges={"batch": DimRange(1, 2, 4)})
    build.run(plan, store, device="NVIDIA H200", tensorrt_version="10.13.0", engine_builder=engine_builder)
    trt = FakeTensorRT("10.13.0")
    backend = TrtBackend(exported, store.root, tensorrt=trt, plugins=trt.register_plugins, capability=(9, 0),
                         device="cpu")
    prompts = [model.tokenizer.encode(e.prompt).ids for e in tasks.examples("test", 1, 0)][:3]
    settings = GenerationSettings(32, 16, EntropyBound(steps=8), seed=5, ignore_eos=True)  # both blocks run
    got = Generator(backend).generate(prompts, settings)
    assert torch.equal(got.tokens, Generator(OrtBackend(exported, threads=1)).generate(prompts, settings).tokens)
    assert torch.equal(got.tokens, Generator(model, mode="eager").generate(prompts, settings).tokens)
    encode, decode, soft = (next(c for c in trt.contexts if c.engine.names[0] == name)
                            for name in ("ids", "canvas", "scaled_logits"))
    assert len(decode.executions) == len(soft.executions) == got.metrics.forwards_executed - 2
    assert len(encode.executions) == 2  # the prompt, and the first block's commit
    assert encode.executions[0]["past_key_mask"] != encode.executions[1]["past_key_mask"]  # a prefix, then none
    assert decode.address_calls == len(decode.addresses)  # bound once: every step reads the same buffers
    with pytest.raises(ArgumentError, match=r"5 prompts exceed the batch limit of 4: rebuild with larger ranges"):
        Generator(backend).generate(prompts + prompts[:2], settings)
