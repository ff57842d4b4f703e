"""NVFP4: the fake quantizer against ml_dtypes' E2M1/E4M3 casts and hand-computed blocks, the
simulated denoiser, and the step graph in TensorRT's NVFP4 form (checked structurally, its packed
weights decoded with ml_dtypes, its activation scales against torch's calibration)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import dlmrt  # noqa: E402
from dlmrt.core import tasks  # noqa: E402
from dlmrt.quant import nvfp4, nvfp4_onnx  # noqa: E402
from dlmrt.quant.nvfp4 import NVFP4Linear, QuantizationError  # noqa: E402
from dlmrt.core.errors import DlmrtError  # noqa: E402
from dlmrt.export import export_writer, onnx_export  # noqa: E402
from dlmrt.ops.parallel_unmask import MEASURE_CODES, onnx_function  # noqa: E402
from dlmrt.runtime import text  # noqa: E402
from helpers import LLADA, LLADA2, random_model  # noqa: E402

F4, F8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn


def reference(x: np.ndarray, global_scale: np.float32 | None = None):
    """(codes, block scales, dequantized) of the NVFP4 definition, with ml_dtypes' casts."""
    x = x.astype(np.float32)
    if global_scale is None:
        amax = np.abs(x).max()
        global_scale = amax / np.float32(6 * 448) if amax > 0 else np.float32(1)
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    raw = np.abs(blocks).max(-1) / (np.float32(6) * global_scale)
    # zero blocks get scale 1, blocks whose scale would underflow E4M3 its smallest step (2^-9)
    raw = np.where(raw == 0, np.float32(1), np.clip(raw, np.float32(2.0 ** -9), np.float32(448)))
    scales = raw.astype(F8)
    codes = (blocks / (scales.astype(np.float32) * global_scale)[..., None]).astype(F4)
    values = codes.astype(np.float32) * (scales.astype(np.float32) * global_scale)[..., None]
    return codes.view(np.uint8).reshape(x.shape), scales, values.reshape(x.shape)


def assert_matches_reference(x: torch.Tensor, global_scale=None):
    q = nvfp4.quantize(x, global_scale)
    codes, scales, values = reference(x.numpy(), None if global_scale is None else np.float32(global_scale))
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.block_scales.view(torch.uint8).numpy(), scales.view(np.uint8))
    got = nvfp4.fake_quantize(x, global_scale).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), values.view(np.uint32))  # bitwise: signs of zero too


# -- the format ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 64), (2, 3, 32), (16,)])
def test_codes_scales_and_values_match_ml_dtypes(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    # Magnitudes over many octaves, so blocks land on every E4M3 exponent and some underflow.
    x = torch.randn(shape, generator=generator) * torch.exp(3 * torch.randn(shape, generator=generator))
    assert_matches_reference(x)
    assert_matches_reference(x, float(x.abs().max()) / 6 / 448 / 20)  # a calibrated scale that saturates


def test_every_e2m1_midpoint_rounds_to_the_even_code():
    grid = np.array(nvfp4.E2M1_VALUES, np.float32)
    probes = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, np.nextafter((grid[1:] + grid[:-1]) / 2, 0),
                             np.nextafter((grid[1:] + grid[:-1]) / 2, 9), [6.5, 7, 1e30]]).astype(np.float32)
    probes = np.concatenate([probes, -probes])
    got = nvfp4.e2m1_codes(torch.from_numpy(probes)).numpy()
    np.testing.assert_array_equal(got, probes.astype(F4).view(np.uint8))


def test_e4m3_rounding_matches_ml_dtypes_at_every_tie_and_saturates():
    exact = np.arange(256, dtype=np.uint8).view(F8).astype(np.float32)
    exact = np.unique(exact[np.isfinite(exact) & (exact >= 0)])
    probes = np.concatenate([exact, (exact[1:] + exact[:-1]) / 2]).astype(np.float32)
    got = nvfp4.e4m3(torch.from_numpy(probes)).view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, probes.astype(F8).view(np.uint8))
    assert nvfp4.e4m3(torch.tensor([464.0, 500.0, 1e9])).float().tolist() == [448.0] * 3


def test_a_block_by_hand():
    block = [6, 3, 2.5, -1.25, 0.25, 0.75, -0.0, 5, 1.75, 3.5, 0.1, -6, 4, 1.5, 0.5, 2]
    q = nvfp4.quantize(torch.tensor([block]), global_scale=1.0)
    # Amax 6 over global 1: block scale 6 / 6 = 1. Ties go to the even code: 2.5 -> 2, 0.75 -> 1,
    # 1.25 -> 1, 5 -> 4, 1.75 -> 2, 3.5 -> 4, 0.25 -> 0. Negatives set bit 3 (-0.0 is code 8).
    assert q.block_scales.float().tolist() == [[1.0]]
    assert q.codes.tolist() == [[7, 5, 4, 10, 0, 2, 8, 6, 4, 6, 0, 15, 6, 3, 1, 4]]
    values = nvfp4.dequantize(q)[0].tolist()
    assert values == [6, 3, 2, -1, 0, 1, 0, 4, 2, 4, 0, -6, 4, 1.5, 0.5, 2]
    assert torch.signbit(nvfp4.dequantize(q)[0, 6])


def test_block_scale_rounding_and_saturation_by_hand():
    block = torch.zeros(1, 16)
    block[0, 0] = 10.0  # scale 10 / 6 = 1.667 -> E4M3 1.625 (steps of 1/8); 10 / 1.625 = 6.15 -> 6
    q = nvfp4.quantize(block, global_scale=1.0)
    assert q.block_scales.float().item() == 1.625 and q.codes[0, 0] == 7
    assert nvfp4.dequantize(q)[0, 0] == 9.75
    block[0, 0] = 6000.0  # scale 1000 saturates at 448; 6000 / 448 = 13.4 saturates at 6
    q = nvfp4.quantize(block, global_scale=1.0)
    assert q.block_scales.float().item() == 448 and nvfp4.dequantize(q)[0, 0] == 2688
    block[0, 0] = 2688.0  # the tensor's own global scale: 2688 / (6 * 448) = 1, block scale 448
    q = nvfp4.quantize(block)
    assert q.global_scale.item() == 1.0 and q.block_scales.float().item() == 448 and q.codes[0, 0] == 7


def test_zero_blocks_negative_zero_and_a_zero_tensor():
    x = torch.zeros(2, 32)
    x[0, 16:] = torch.linspace(-3, 3, 16)
    x[1, 0] = -0.0
    q = nvfp4.quantize(x)
    assert q.block_scales.float()[:, 0].tolist() == [1.0, 1.0]  # all-zero blocks: scale 1, codes 0
    assert q.codes[0, :16].eq(0).all() and q.codes[1, 0] == 8
    assert torch.signbit(nvfp4.fake_quantize(x)[1, 0])
    # A block far below the tensor's amax: its scale 1e-6 / (6 * 1000 / 2688) underflows E4M3, so it
    # is stored as E4M3's smallest step (2^-9), and its elements, 1e-6 / (2^-9 * 1000 / 2688), as 0.
    tiny_block = torch.tensor([[1000.0] + [0.0] * 15, [1e-6] * 8 + [-1e-6] * 8])
    q = nvfp4.quantize(tiny_block)
    assert q.block_scales.float()[1].item() == 2.0 ** -9 and q.codes[1].tolist() == [0] * 8 + [8] * 8
    # 5e-4 underflows too (5e-4 / 2.23 < 2^-10), but 5e-4 / (2^-9 * 1000 / 2688) = 0.69 rounds to
    # E2M1's 0.5 (code 1) instead of vanishing
    small_block = torch.tensor([[1000.0] + [0.0] * 15, [5e-4] * 16])
    assert nvfp4.quantize(small_block).codes[1].tolist() == [1] * 16
    assert_matches_reference(tiny_block)
    zero = nvfp4.quantize(torch.zeros(3, 16))
    assert zero.global_scale.item() == 1.0 and zero.codes.eq(0).all()
    assert nvfp4.fake_quantize(torch.zeros(3, 16)).eq(0).all()


def test_fake_quantize_keeps_the_dtype():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    got = nvfp4.fake_quantize(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, nvfp4.fake_quantize(x.to(torch.bfloat16).float()).to(torch.bfloat16))


@pytest.mark.parametrize("x, scale, message", [
    (torch.tensor([[1.0] * 15 + [float("inf")]]), None, "inf or nan"),
    (torch.tensor([[1.0] * 15 + [float("nan")]]), None, "inf or nan"),
    (torch.ones(2, 20), None, r"multiple of 16, got shape \[2, 20\]"),
    (torch.ones(2, 16, dtype=torch.long), None, "floating-point"),
    (torch.tensor(1.0), None, "rank >= 1"),
    (torch.ones(16), 0.0, "finite and positive"),
    (torch.ones(16), -1.0, "finite and positive"),
])
def test_bad_input_is_refused(x, scale, message):
    with pytest.raises(QuantizationError, match=message) as caught:
        nvfp4.quantize(x, scale)
    assert isinstance(caught.value, DlmrtError)


def test_bad_amax_is_refused():
    for amax in (float("nan"), float("inf"), -1.0):
        with pytest.raises(QuantizationError, match="finite number >= 0"):
            nvfp4.global_scale_from_amax(amax)


# -- the simulated denoiser ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return dlmrt.load()


def calibration_ids(model):
    """Six prompts of the task suite, each followed by masked positions."""
    prompts = [text.encode(model, e.prompt) for e in tasks.examples("test", 2, seed=1)][:6]
    width = max(map(len, prompts)) + 8
    ids = torch.full((len(prompts), width), model.tokens.mask_id)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    return ids


def test_simulate_quantizes_the_block_linears_only(tiny):
    ids = calibration_ids(tiny)
    simulated = nvfp4.simulate(tiny, [ids[:3], ids[3:]])
    originals = dict(tiny.named_modules())
    quantized = {name: m for name, m in simulated.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(quantized) == 4 * 7 and all(".blocks." in name for name in quantized)
    assert isinstance(simulated.model.transformer["ff_out"], torch.nn.Linear)  # the LM head
    assert torch.equal(simulated.input_embedding().weight, tiny.input_embedding().weight)
    assert not any(isinstance(m, NVFP4Linear) for m in tiny.modules())  # the original is untouched
    amax = {name: 0.0 for name in quantized}
    hooks = [originals[name].register_forward_pre_hook(
        lambda m, args, name=name: amax.__setitem__(name, max(amax[name], args[0].abs().max().item())))
        for name in quantized]
    with torch.no_grad():
        tiny(ids[:3]), tiny(ids[3:])
    for hook in hooks:
        hook.remove()
    for name, module in quantized.items():
        assert torch.equal(module.weight, nvfp4.fake_quantize(originals[name].weight))
        assert module.input_global_scale.item() == pytest.approx(amax[name] / 2688, rel=1e-6)
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    q_proj = quantized["model.transformer.blocks.0.q_proj"]
    expected = nvfp4.fake_quantize(x, q_proj.input_global_scale) @ nvfp4.fake_quantize(originals[
        "model.transformer.blocks.0.q_proj"].weight).T
    torch.testing.assert_close(q_proj(x), expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        full, low = tiny(ids), simulated(ids)
    assert not torch.equal(full, low)
    assert (full.argmax(-1) == low.argmax(-1)).float().mean() > 0.75  # 4-bit, yet mostly the same tokens (89%)


def test_simulate_leaves_the_moe_router_alone():
    model = random_model(LLADA2)
    names = set(nvfp4.quantizable_linears(model))
    assert "model.layers.1.mlp.experts.gate_proj" in names and "model.layers.1.attention.dense" in names
    assert not any("mlp.gate." in name or "lm_head" in name for name in names)
    simulated = nvfp4.simulate(model, [torch.randint(3, 20, (2, 8))])
    assert sum(isinstance(m, (NVFP4Linear, nvfp4.NVFP4Experts)) for m in simulated.modules()) == len(names)
    stacked = simulated.get_submodule("model.layers.1.mlp.experts.up_proj")
    original = model.get_submodule("model.layers.1.mlp.experts.up_proj").weight
    assert all(torch.equal(stacked.weight[row], nvfp4.fake_quantize(original[row])) for row in range(len(original)))
    assert any(scale is not None for scale in stacked.input_global_scales)  # calibrated per expert
    simulated(torch.randint(3, 20, (2, 8)))  # uncalibrated experts fall back to dynamic scales


def test_simulate_without_inputs_is_refused(tiny):
    with pytest.raises(QuantizationError, match="no inputs"):
        nvfp4.simulate(tiny, [])


# -- the ONNX graph -----------------------------------------------------------------------


def step_feed(ids: torch.Tensor, mask_id: int) -> dict[str, np.ndarray]:
    batch, length = ids.shape
    return {"ids": ids.numpy(), "positions": np.tile(np.arange(length), (batch, 1)),
            "key_mask": np.ones((batch, length), bool), "block_index": np.arange(length - 8, length),
            "count": np.ones(batch, np.int64), "threshold": np.full(batch, 0.9, np.float32),
            "factor": np.zeros(batch, np.float32), "temperature": np.zeros(batch, np.float32),
            "seed": np.zeros(batch, np.int64), "step": np.zeros(batch, np.int64),
            "measure": np.full(batch, MEASURE_CODES["prob"], np.int64),
            "edit_threshold": np.full(batch, np.inf, np.float32), "prompt_lengths": np.full(batch, length - 8)}


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """(fp32 graph, NVFP4 graph, report, calibration ids) for the tiny model's `full` step graph."""
    root = tmp_path_factory.mktemp("nvfp4")
    onnx_function.register_schema()
    onnx.save(onnx_export.export_graph(tiny, "full", None, 18, 8, 48), root / "full.onnx")
    ids = calibration_ids(tiny)
    feeds = [step_feed(ids[:3], tiny.tokens.mask_id), step_feed(ids[3:], tiny.tokens.mask_id)]
    report = nvfp4_onnx.quantize_onnx(root / "full.onnx", root / "full_nvfp4.onnx", feeds)
    return onnx.load(root / "full.onnx"), onnx.load(root / "full_nvfp4.onnx"), report, ids


def test_the_nvfp4_graph_is_well_formed(quantized):
    _, model, report, _ = quantized
    assert nvfp4_onnx.check_nvfp4_graph(model) == []
    onnx.checker.check_model(model, full_check=True)
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[""] == 23 and opsets["trt"] == 1 and model.ir_version >= 11
    assert len(report.quantized) == 28
    # One activation quantizer per distinct input of a layer's linears: 4 a layer, and a fifth in the last
    # layer, whose q-projection reads the logits' rows alone.
    assert sum(n.op_type == "TRT_FP4DynamicQuantize" and n.domain == "trt" for n in model.graph.node) == 4 * 4 + 1
    assert "LM head" in report.skipped["node_linear_28"]
    assert sum("not a 2-D float weight" in reason for reason in report.skipped.values()) == 8  # attention
    unmask = [n for n in model.graph.node if n.domain == "dlmrt"]
    assert [n.op_type for n in unmask] == ["ParallelUnmask"]
    assert "ParallelUnmask" in {f.name for f in model.functions}


def test_packed_weights_decode_to_fake_quantize(quantized):
    original, model, report, _ = quantized
    before = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    after = {i.name: i for i in model.graph.initializer}
    matmuls = {n.name: n for n in original.graph.node}
    for node in report.quantized:
        codes = after[f"{node}.weight.fp4"]
        assert codes.data_type == TensorProto.FLOAT4E2M1 and len(codes.raw_data) == np.prod(codes.dims) // 2
        fp4 = numpy_helper.to_array(codes)
        scales = numpy_helper.to_array(after[f"{node}.weight.block_scales"])
        global_scale = numpy_helper.to_array(after[f"{node}.weight.global_scale"])
        assert fp4.dtype == F4 and scales.dtype == F8 and global_scale.dtype == np.float32
        rows, k = fp4.shape
        decoded = (fp4.astype(np.float32).reshape(rows, k // 16, 16)
                   * (scales.astype(np.float32) * global_scale)[..., None]).reshape(rows, k)
        weight = torch.from_numpy(before[matmuls[node].input[1]].T.copy())  # [in, out] -> [out, in]
        np.testing.assert_array_equal(decoded, nvfp4.fake_quantize(weight).numpy())


def test_activation_scales_match_torch_calibration(quantized, tiny):
    _, model, report, ids = quantized
    block = torch.arange(ids.shape[1] - 8, ids.shape[1])  # the feeds' block: the last layer's MLP sees it alone
    amax = nvfp4.calibrate(tiny, [{"input_ids": ids[:3], "logits_index": block},
                                  {"input_ids": ids[3:], "logits_index": block}])
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    quantize_nodes = {n.output[0]: n for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"}
    producer = {out: n for n in model.graph.node for out in n.output}
    for node in (n for n in model.graph.node if n.name in report.quantized):
        module = report.quantized[node.name].removeprefix("model.")  # the step graph wraps the model
        assert report.input_amax[node.name] == pytest.approx(amax[module], rel=1e-4)
        dynamic = quantize_nodes[producer[node.input[0]].input[0]]
        assert initializers[dynamic.input[1]] == pytest.approx(amax[module] / 2688, rel=1e-4)


def _edit(model: onnx.ModelProto, edit) -> list[str]:
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    edit(broken.graph)
    return nvfp4_onnx.check_nvfp4_graph(broken)


def _node(graph, name):
    return next(n for n in graph.node if n.name == name)


def _set_block_size(graph):
    node = _node(graph, "node_linear.weight.dq")
    next(a for a in node.attribute if a.name == "block_size").i = 32


def _fp16_scales(graph):
    index, init = next((i, t) for i, t in enumerate(graph.initializer) if t.name == "node_linear.weight.block_scales")
    graph.initializer[index].CopyFrom(numpy_helper.from_array(
        numpy_helper.to_array(init).astype(np.float16), init.name))


def _drop_weight_scale_dq(graph):
    scale_dq = _node(graph, "node_linear.weight.scale_dq")
    _node(graph, "node_linear.weight.dq").input[1] = scale_dq.input[0]
    graph.node.remove(scale_dq)


def _drop_input_dq(graph):
    matmul = _node(graph, "node_linear_3")
    data_dq = next(n for n in graph.node if n.output[0] == matmul.input[0])
    matmul.input[0] = data_dq.input[0]
    graph.node.remove(data_dq)


def _dangling_dq(graph):
    graph.node.append(helper.make_node("DequantizeLinear", ["node_linear.weight.block_scales",
                                                             "node_linear.weight.global_scale"], ["unused"]))


def _scale_type(graph):
    node = next(n for n in graph.node if n.op_type == "TRT_FP4DynamicQuantize")
    next(a for a in node.attribute if a.name == "scale_type").i = TensorProto.FLOAT16


@pytest.mark.parametrize("edit, message", [
    (_set_block_size, "block_size is 32, expected 16"),
    (_fp16_scales, "FLOAT8E4M3FN initializer, got FLOAT16"),
    (_drop_weight_scale_dq, "block scales do not come from a DequantizeLinear"),
    (_drop_input_dq, "MatMul node_linear_3 input: expected a DequantizeLinear pair"),
    (_dangling_dq, "output 'unused' is used by nothing"),
    (_scale_type, "scale_type is 10, expected 17"),
])
def test_the_checker_catches_broken_graphs(quantized, edit, message):
    problems = _edit(quantized[1], edit)
    assert any(message in p for p in problems), problems


def test_the_checker_wants_opset_23(quantized):
    broken = onnx.ModelProto()
    broken.CopyFrom(quantized[1])
    next(o for o in broken.opset_import if o.domain == "").version = 21
    assert any("opset is 21" in p for p in nvfp4_onnx.check_nvfp4_graph(broken))


def test_bad_calibration_feeds_are_refused(quantized, tmp_path):
    original = tmp_path / "in.onnx"
    onnx.save(quantized[0], original)
    with pytest.raises(QuantizationError, match="no feeds"):
        nvfp4_onnx.quantize_onnx(original, tmp_path / "out.onnx", [])
    with pytest.raises(QuantizationError, match=r"lack the graph inputs \['measure'\]"):
        feed = step_feed(quantized[3][:2], 2)
        del feed["measure"]
        nvfp4_onnx.quantize_onnx(original, tmp_path / "out.onnx", [feed])


def test_big_models_keep_external_data(quantized, tmp_path, monkeypatch):
    monkeypatch.setattr(export_writer, "EXTERNAL_DATA_BYTES", 0)
    original = tmp_path / "in.onnx"
    onnx.save(quantized[0], original)
    nvfp4_onnx.quantize_onnx(original, tmp_path / "out.onnx", [step_feed(quantized[3][:2], 2)])
    assert (tmp_path / "out.onnx.data").is_file()
    assert nvfp4_onnx.check_nvfp4_graph(onnx.load(tmp_path / "out.onnx")) == []


def test_a_float16_graph_stays_float16(tmp_path):
    model = random_model(LLADA)  # two layers: a quicker export than the tiny model's four
    onnx_function.register_schema()
    onnx.save(onnx_export.export_graph(model.half(), "full", None, 18, 8, 48), tmp_path / "fp16.onnx")
    ids = calibration_ids(model)[:2]
    nvfp4_onnx.quantize_onnx(tmp_path / "fp16.onnx", tmp_path / "out.onnx", [step_feed(ids, 2)])
    model = onnx.load(tmp_path / "out.onnx")
    assert nvfp4_onnx.check_nvfp4_graph(model) == []
    onnx.checker.check_model(model, full_check=True)
    data_dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("fp4")]
    assert data_dqs and all(
        {a.name: a.i for a in n.attribute}["output_dtype"] == TensorProto.FLOAT16 for n in data_dqs)


def test_the_opset_move_keeps_the_step_graph_s_outputs(quantized):
    import onnxruntime as ort

    original, _, _, ids = quantized
    moved = onnx.ModelProto()
    moved.CopyFrom(original)
    nvfp4_onnx._set_opset(moved)  # what quantize_onnx does to the rest of the graph and to ParallelUnmask
    feed = step_feed(ids, 2)
    feed["temperature"][:] = 0.7  # the sampling path of the functions too
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
           for m in (original, moved)]
    for before, after in zip(*run):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_quantizer_agrees_with_modelopts_nvfp4_tensor(device):
    """modelopt's NVFP4 tensor (its torch path) is the format as TensorRT's tooling writes it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                                  reason="needs nvidia-modelopt's torch side (pip install 'dlmrt[quant]')")
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(32, 128, generator=generator) * torch.exp(3 * torch.randn(32, 128, generator=generator))
    x[0, :16] = 0  # a zero block
    x[1, :16] = 1e-6 * torch.randn(16, generator=generator)  # a block whose scale underflows
    x = x.to(device)
    data, block_scales, global_scale = qtensor.NVFP4QTensor.quantize(x, 16)
    ours = nvfp4.quantize(x)
    assert torch.equal(global_scale.reshape(()), ours.global_scale)
    assert torch.equal(block_scales.view(torch.uint8), ours.block_scales.view(torch.uint8))
    theirs = data.dequantize(dtype=torch.float32, scale=block_scales, double_scale=global_scale,
                             block_sizes={-1: 16})
    assert torch.equal(theirs, nvfp4.dequantize(ours))
