"""`dlmrt::ResidualContext` in every form against its torch reference: the torch op, the ONNX function
run by ONNX Runtime, the node in an exported ORL step graph, the Triton kernel (in the interpreter,
see helpers.run_in_interpreter, and on a GPU), its AOT compilation for sm_90/100/120 and the
TensorRT plugin."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dlmrt.core.errors import KernelInputError, MissingExtraError
from dlmrt.models.residual import next_residual
from dlmrt.ops.residual_context import residual_context
from helpers import (LLADA, ORL, check_plugin_registration, config, cuda_kernels, fresh_module, interpret_cases,
                     random_model, run_in_interpreter)

onnx = pytest.importorskip("onnx", reason="the ONNX path needs the 'onnx' extra")
ort = pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

from dlmrt.ops.residual_context import onnx_function  # noqa: E402

KERNELS = "dlmrt.ops.residual_context.triton_kernels"
INF = math.inf


def crafted_logits(vocab: int = 11) -> torch.Tensor:
    """Rows [2, 4, V]: one-hot (certainty 1, z = E[3]), uniform (certainty 0, z = mean of E), a row with
    impossible tokens, a peaked row, and two random rows."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, vocab, generator=g) * 3
    logits[0, 0] = -INF
    logits[0, 0, 3] = 0.0
    logits[0, 1] = 0.0
    logits[0, 2, : vocab // 2] = -INF
    logits[0, 3] = torch.arange(vocab) * 8.0
    return logits


def random_inputs(seed: int, shape: tuple[int, int, int], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], hidden, generator=g)


def assert_close_to_reference(z, certainty, logits, embedding, atol=2e-5):
    expected_z, expected_certainty = residual_context(logits, embedding)
    assert z.dtype == certainty.dtype == embedding.dtype
    torch.testing.assert_close(z, expected_z, atol=atol, rtol=1e-5)
    torch.testing.assert_close(certainty, expected_certainty, atol=1e-6, rtol=0)


# -- the reference and the torch op --------------------------------------------------------------

def test_crafted_rows_have_the_documented_values():
    logits, embedding = crafted_logits(), torch.randn(11, 5, generator=torch.Generator().manual_seed(0))
    z, certainty = residual_context(logits, embedding)
    assert certainty[0, :2].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    torch.testing.assert_close(z[0, 0], embedding[3])
    torch.testing.assert_close(z[0, 1], embedding.mean(0), atol=1e-6, rtol=0)
    assert bool(((certainty >= 0) & (certainty <= 1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_residual_without_topk_is_the_op(dtype):
    logits, embedding = random_inputs(1, (2, 3, 13), 6)
    expected = torch.ops.dlmrt.residual_context(logits.to(dtype), embedding.to(dtype))
    got = next_residual(logits.to(dtype), embedding.to(dtype), topk=0)
    assert torch.equal(got.z, expected[0]) and torch.equal(got.certainty, expected[1])


def test_the_op_and_its_fake_agree():
    logits, embedding = random_inputs(2, (2, 3, 13), 6)
    torch.library.opcheck(torch.ops.dlmrt.residual_context.default, (logits, embedding.to(torch.float16)))


class NextResidual(nn.Module):
    def __init__(self, topk: int):
        super().__init__()
        self.topk = topk

    def forward(self, logits, embedding):
        return tuple(next_residual(logits, embedding, self.topk))


@pytest.mark.parametrize("topk, expected", [(0, True), (13, True), (4, False)])
def test_only_the_full_distribution_exports_as_the_op(topk, expected):
    program = torch.export.export(NextResidual(topk), random_inputs(3, (2, 3, 13), 6))
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert (torch.ops.dlmrt.residual_context.default in targets) == expected, targets


# -- the ONNX function in ONNX Runtime -----------------------------------------------------------

@pytest.fixture(scope="module")
def sessions():
    onnx_function.register_schema()

    def session(*dtypes):
        model = onnx_function.standalone_model(*dtypes)
        onnx.checker.check_model(model, full_check=True)
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return {dtypes: session(*dtypes) for dtypes in [("float32", "float32"), ("float16", "float16"),
                                                     ("float32", "float16")]}


def run_onnx(sessions, logits, embedding):
    dtypes = (str(logits.dtype).split(".")[-1], str(embedding.dtype).split(".")[-1])
    z, certainty = sessions[dtypes].run(None, {"logits": logits.numpy(), "embedding": embedding.numpy()})
    return torch.from_numpy(z), torch.from_numpy(certainty)


@pytest.mark.parametrize("shape, hidden", [((1, 1, 2), 1), ((3, 8, 17), 12), ((2, 5, 100), 33)])
def test_onnx_function_on_random_inputs(sessions, shape, hidden):
    for seed in range(5):
        logits, embedding = random_inputs(seed, shape, hidden)
        assert_close_to_reference(*run_onnx(sessions, logits, embedding), logits, embedding)


def test_onnx_function_on_crafted_rows(sessions):
    logits, embedding = crafted_logits(), torch.randn(11, 5, generator=torch.Generator().manual_seed(0))
    z, certainty = run_onnx(sessions, logits, embedding)
    assert_close_to_reference(z, certainty, logits, embedding)
    assert certainty[0, :2].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.float16])
def test_onnx_function_in_half_precision(sessions, logits_dtype):
    logits, embedding = random_inputs(6, (2, 4, 19), 8)
    logits, embedding = logits.to(logits_dtype), embedding.half()
    z, certainty = run_onnx(sessions, logits, embedding)
    expected_z, expected_certainty = residual_context(logits, embedding)
    assert z.dtype == certainty.dtype == torch.float16
    torch.testing.assert_close(z, expected_z, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(certainty, expected_certainty, atol=1e-3, rtol=0)


def test_the_node_carries_the_plugin_namespace():
    node = onnx_function.standalone_model().graph.node[0]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.domain, node.op_type, list(node.input), list(node.output)) == (
        "dlmrt", "ResidualContext", ["logits", "embedding"], ["z", "certainty"])
    assert attributes == {"plugin_namespace": b"dlmrt", "plugin_version": b"1"}


def test_the_schema_refuses_integer_logits():
    model = onnx_function.standalone_model()
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    with pytest.raises(onnx.shape_inference.InferenceError, match=r"logits .* unsupported type: tensor\(int64\)"):
        onnx.checker.check_model(model, full_check=True)


# -- the exported ORL step graph -----------------------------------------------------------------

@pytest.fixture(scope="module")
def orl_graph():
    from dlmrt.export import onnx_export

    model = random_model(config(LLADA, residual_context=ORL), seed=3)
    return onnx_export.export_graph(model, "full", None, onnx_export.DEFAULT_OPSET, max_batch=4, max_length=32)


def test_the_orl_graph_holds_one_residual_context_node(orl_graph):
    nodes = [n for n in orl_graph.graph.node if n.domain == "dlmrt"]
    assert sorted(n.op_type for n in nodes) == ["ParallelUnmask", "ResidualContext"]
    residual = next(n for n in nodes if n.op_type == "ResidualContext")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in residual.attribute}
    assert attributes == {"plugin_namespace": b"dlmrt", "plugin_version": b"1"}
    assert list(residual.output) == ["next_z", "next_certainty"]
    functions = [f.name for f in orl_graph.functions if f.domain == "dlmrt"]
    assert functions.count("ResidualContext") == 1
    assert "LogSoftmax" not in {n.op_type for n in orl_graph.graph.node}  # the residual's, before the op


def test_attach_adds_only_the_functions_of_ops_the_graph_uses():
    from dlmrt.export import onnx_export
    from dlmrt.ops.parallel_unmask import onnx_function as unmask_function

    def model_with(*nodes):
        return onnx.helper.make_model(onnx.helper.make_graph(list(nodes), "g", [], []))

    bare = onnx.helper.make_node("ResidualContext", ["l", "e"], ["z", "c"], domain="dlmrt")
    attached = onnx_export.attach_custom_op(model_with(bare))
    assert [f.name for f in attached.functions] == ["ResidualContext"]
    assert {a.name for a in attached.graph.node[0].attribute} == {"plugin_namespace", "plugin_version"}
    unmask = unmask_function.node(list(unmask_function.INPUTS), list(unmask_function.OUTPUTS), mask_id=1)
    assert "ResidualContext" not in {f.name for f in onnx_export.attach_custom_op(model_with(unmask)).functions}


# -- the Triton kernel in the interpreter ----------------------------------------------------------

def kernel_cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(7)
    small = torch.randn(2, 3, 37, generator=g) * 3
    small[0, 0, 5:] = -INF  # a row with impossible tokens
    small[1, 2] = -INF
    small[1, 2, 4] = 0.0  # one-hot: certainty 1
    return {
        "small": dict(logits=small, embedding=torch.randn(37, 20, generator=g)),
        "tiles": dict(logits=torch.randn(1, 17, 100, generator=g) * 2, embedding=torch.randn(100, 70, generator=g)),
        "crafted": dict(logits=crafted_logits(), embedding=torch.randn(11, 5, generator=g)),
        "float16": dict(logits=torch.randn(2, 5, 40, generator=g).half(),
                        embedding=torch.randn(40, 9, generator=g).half()),
    }


CASES = kernel_cases()


def run_case(kernels, case: dict):
    return kernels.residual_context(case["logits"], case["embedding"])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")
    return run_in_interpreter(__file__, CASES, tmp_path_factory.mktemp("interpreter"))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_reference(interpreted, name):
    case = CASES[name]
    z, certainty = interpreted[name]
    if case["embedding"].dtype == torch.float16:
        expected_z, expected_certainty = residual_context(case["logits"], case["embedding"])
        assert z.dtype == certainty.dtype == torch.float16
        torch.testing.assert_close(z, expected_z, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(certainty, expected_certainty, atol=1e-3, rtol=0)
    else:
        assert_close_to_reference(z, certainty, case["logits"], case["embedding"])


def test_kernel_on_crafted_rows(interpreted):
    z, certainty = interpreted["crafted"]
    assert certainty[0, :2].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    torch.testing.assert_close(z[0, 0], CASES["crafted"]["embedding"][3], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")
    return importlib.import_module(KERNELS)


@pytest.mark.parametrize("logits, embedding, message", [
    (torch.zeros(1, 2, 5), torch.zeros(4, 3), "embedding has 4 rows"),
    (torch.zeros(2, 5), torch.zeros(5, 3), r"\[B, T, V\]"),
    (torch.zeros(1, 2, 5), torch.zeros(5), r"\[V, H\]"),
    (torch.zeros(1, 2, 5, dtype=torch.long), torch.zeros(5, 3), "must be floating point"),
    (torch.zeros(1, 2, 1), torch.zeros(1, 3), "V >= 2"),
])
def test_bad_input_is_refused_before_any_launch(kernels, logits, embedding, message):
    with pytest.raises(KernelInputError, match=message):
        kernels.residual_context(logits, embedding)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the test process itself interprets")
def test_cpu_tensors_need_the_interpreter(kernels):
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        kernels.residual_context(torch.zeros(1, 2, 5), torch.zeros(5, 3))


def test_missing_triton_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "dlmrt.ops.parallel_unmask.triton_kernels", raising=False)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'dlmrt[triton]'")):
        fresh_module(KERNELS)


# -- ahead-of-time compilation -------------------------------------------------------------------

FLOATS = ("logits", "embedding", "z", "certainty")


@pytest.mark.parametrize("cc", [90, 100, 120])
def test_aot_ptx_for_each_target(cc):
    pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")
    from dlmrt.ops.parallel_unmask import aot
    compiled = aot.compile_kernel("residual_kernel", cc)
    assert re.search(rf"^\.target sm_{cc}a?\b", compiled.ptx, flags=re.M), compiled.ptx[:400]
    entry = re.search(r"\.entry (\w+)\((.*?)\)", compiled.ptx, flags=re.S)
    assert entry.group(1) == compiled.name == "residual_kernel"
    # what TensorRT passes: logits and E, then N, V, H, then z and certainty; Triton's scratch dropped
    params = [p.split()[1] for p in entry.group(2).split(",")]
    assert params == [".u64"] * 2 + [".u32"] * 3 + [".u64"] * 2
    assert compiled.threads == 4 * 32 and compiled.constexprs == {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 64}


def test_aot_compiles_each_float_type():
    pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")
    from dlmrt.ops.parallel_unmask import aot
    ptx = {dtype: aot.compile_kernel("residual_kernel", 90, dict.fromkeys(FLOATS, f"*{dtype}")).ptx
           for dtype in ("fp32", "bf16")}
    assert ptx["fp32"] != ptx["bf16"] and "bf16" in ptx["bf16"]
    with pytest.raises(KernelInputError, match=r"no arguments \['scale'\]"):
        aot.compile_kernel("residual_kernel", 90, {"scale": "*fp32"})


def test_every_kernel_aot_knows_lives_in_its_module():
    from dlmrt.ops.parallel_unmask import aot
    assert set(aot.MODULES) == set(aot.SIGNATURES)
    assert aot.MODULES["residual_kernel"] == KERNELS


# -- TensorRT and the GPU --------------------------------------------------------------------------

def test_plugin_registration_without_tensorrt_says_which_extra(monkeypatch):
    trt_plugin = fresh_module("dlmrt.ops.residual_context.trt_plugin")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingExtraError, match=re.escape("dlmrt::ResidualContext needs TensorRT 10.9")):
        trt_plugin.register()


def test_plugin_maps_tensorrt_types_to_kernel_builds():
    from dlmrt.ops.residual_context import trt_plugin
    trt = SimpleNamespace(float32="FLOAT", float16="HALF", bfloat16="BF16")
    desc = lambda dtype: SimpleNamespace(dtype=dtype)  # noqa: E731
    assert trt_plugin._pointer_types(trt, logits=desc("FLOAT"), z=desc("BF16")) == {"logits": "*fp32", "z": "*bf16"}
    with pytest.raises(KernelInputError, match="embedding is INT8"):
        trt_plugin._pointer_types(trt, embedding=desc("INT8"))


@pytest.mark.trt
def test_plugin_is_registered_under_the_onnx_namespace_and_version():
    check_plugin_registration("residual_context")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiles", "crafted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda_matches_the_reference(name, dtype):
    kernels = cuda_kernels(KERNELS)
    logits, embedding = CASES[name]["logits"].to(dtype), CASES[name]["embedding"].to(dtype)
    z, certainty = kernels.residual_context(logits.cuda(), embedding.cuda())
    expected_z, expected_certainty = residual_context(logits, embedding)
    assert z.dtype == certainty.dtype == dtype
    tolerance = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(z.cpu(), expected_z, **tolerance)
    torch.testing.assert_close(certainty.cpu(), expected_certainty, atol=tolerance["atol"], rtol=0)


if __name__ == "__main__":
    interpret_cases(KERNELS, run_case, *sys.argv[1:])
