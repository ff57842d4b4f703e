"""Targets, optimization profiles, build plans and the preflight, on the CPU (no TensorRT needed)."""

from __future__ import annotations

import copy
import json

import pytest
from onnx import TensorProto, helper

from dlmrt.engines import plan as plans
from dlmrt.engines import preflight, profiles, targets
from dlmrt.engines.plan import PlanError
from dlmrt.engines.profiles import DimRange, ProfileError
from dlmrt.export.export_manifest import ExportManifest, ExportManifestError, TensorContract
from helpers import load_graphs, plan_for


# ---- targets ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fp8, nvfp4", [("sm_89", True, False), ("sm_90", True, False),
                                              ("sm_100", True, True), ("sm_120", True, True)])
def test_each_target_supports_what_its_compute_capability_allows(name, fp8, nvfp4):
    target = targets.target_named(name)
    assert ("fp8" in target.precisions) == fp8 and ("nvfp4" in target.precisions) == nvfp4
    assert target.compute_capability >= (8, 9)
    assert targets.target_for_capability(target.compute_capability) is target


def test_fp8_below_sm89_and_nvfp4_below_sm100_are_refused_with_the_reason():
    with pytest.raises(targets.TargetError, match=r"nvfp4 needs compute capability 10.0.*sm_90.*9\.0"):
        targets.check_precision(targets.target_named("sm_90"), "nvfp4")
    with pytest.raises(targets.TargetError, match="no recipe"):
        targets.target_for_capability((8, 6), "RTX 3090")
    with pytest.raises(targets.TargetError, match="unknown target"):
        targets.target_named("sm_80")


@pytest.mark.skipif(targets.running_gpu() is not None, reason="a GPU is visible: auto resolves to it")
def test_auto_without_a_gpu_says_to_name_the_target():
    with pytest.raises(targets.TargetError, match="--target auto needs a CUDA GPU"):
        targets.resolve("auto")


# ---- profiles ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("1:4:8", DimRange(1, 4, 8)), ("16", DimRange(16, 16, 16))])
def test_ranges_parse_like_trtexec(text, expected):
    assert profiles.parse_range(text, "batch") == expected


@pytest.mark.parametrize("text", ["4:1:8", "0:1:2", "1:2", "a:b:c", ""])
def test_malformed_ranges_are_refused(text):
    with pytest.raises(ProfileError, match="--batch"):
        profiles.parse_range(text, "batch")


def test_shapes_follow_the_contract_including_scaled_dimensions():
    ranges = {"batch": DimRange(1, 2, 4), "prefix": DimRange(1, 16, 32), "window": DimRange(1, 8, 8),
              "block": DimRange(1, 8, 8)}
    contract = [TensorContract("past_kv", "float32", (4, 2, "2*batch", 2, "prefix", 32)),
                TensorContract("cfg_scale", "float32", (1,)), TensorContract("ids", "int64", ("batch", "window"))]
    shapes = profiles.input_shapes(contract, ranges)
    assert shapes["past_kv"] == [[4, 2, 2, 2, 1, 32], [4, 2, 4, 2, 16, 32], [4, 2, 8, 2, 32, 32]]
    assert "cfg_scale" not in shapes  # static inputs need no profile
    assert profiles.trtexec_flags({"ids": shapes["ids"]}) == [
        "--minShapes=ids:1x1", "--optShapes=ids:2x8", "--maxShapes=ids:4x8"]
    with pytest.raises(ProfileError, match="'heads'"):
        profiles.input_shapes([TensorContract("x", "float32", ("heads",))], ranges)


# ---- plans ------------------------------------------------------------------------------------------------

def test_default_plan_covers_the_exports_limits(tiny_export, tmp_path):
    plan = plan_for(tiny_export, tmp_path)
    export = ExportManifest.read(tiny_export)
    assert plan.ranges["batch"] == f"1:1:{export.limits.max_batch}"
    assert plan.ranges["prefix"].endswith(f":{export.limits.max_length}")
    assert plan.ranges["window"].split(":")[1] == "8"  # the tiny model's block length
    assert [graph.name for graph in plan.graphs] == ["full", "cached"]
    assert {graph.sha256 for graph in plan.graphs} == {export.files["step_full.onnx"], export.files["step_cached.onnx"]}
    assert plan.output == str(tmp_path / "store" / "tiny-llada" / "sm_90-bf16")
    assert plan.plugins == [{"name": "ParallelUnmask", "namespace": "dlmrt", "version": "2"}]
    json.loads(plan.to_json())


def test_tensorrt_10_uses_builder_flags_and_11_the_graphs_types(tiny_export, tmp_path):
    ten = plan_for(tiny_export, tmp_path, precision="fp8", tensorrt="10.13.0")
    assert (ten.typing, ten.builder_flags) == ("precision-flags", ["FP8", "BF16"])
    eleven = plan_for(tiny_export, tmp_path, precision="fp8", tensorrt="11.4.0")
    assert (eleven.typing, eleven.builder_flags) == ("strongly-typed", [])
    assert eleven.quantization["method"].startswith("nvidia-modelopt")
    assert any("float32" in note for note in eleven.notes)
    with pytest.raises(PlanError, match="export in bfloat16"):
        plan_for(tiny_export, tmp_path, precision="bf16", tensorrt="11.4.0")
    with pytest.raises(PlanError, match="too old"):
        plan_for(tiny_export, tmp_path, tensorrt="8.6.1")


def test_plans_refuse_what_the_export_cannot_give(tiny_export, tmp_path):
    with pytest.raises(PlanError, match="no full_guided graph.*--guidance"):
        plan_for(tiny_export, tmp_path, graphs=("full", "full_guided"))
    with pytest.raises(ProfileError, match="max-batch"):
        plan_for(tiny_export, tmp_path, ranges={"batch": DimRange(1, 4, 64)})
    with pytest.raises(ExportManifestError, match="not a dlmrt export"):
        plan_for(tmp_path, tmp_path)
    with pytest.raises(PlanError, match="optimization-level"):
        plan_for(tiny_export, tmp_path, optimization_level=9)


# ---- preflight --------------------------------------------------------------------------------------------

def test_the_exported_graphs_pass_preflight(tiny_export, tmp_path):
    for tensorrt in ("10.13", "11.4"):
        plan = plan_for(tiny_export, tmp_path, tensorrt=tensorrt, precision="fp8")
        assert preflight.check(plan, load_graphs(plan, tiny_export), quantized=False) == []


def unmask_node(model):
    return next(node for node in model.graph.node if node.op_type == "ParallelUnmask")


def test_preflight_reports_every_problem_at_once(tiny_export, tmp_path):
    plan = plan_for(tiny_export, tmp_path, tensorrt="11.4", precision="fp8")
    graphs = load_graphs(plan, tiny_export)
    broken = graphs["full"]
    node = unmask_node(broken)
    for attribute in node.attribute:
        if attribute.name == "plugin_namespace":
            attribute.s = b"other"
    node.attribute.remove(next(a for a in node.attribute if a.name == "mask_id"))
    broken.graph.node.append(helper.make_node("Unique", ["ids"], ["unique_ids"], name="unique"))
    broken.graph.node.append(helper.make_node("NoSuchOp", ["ids"], ["nothing"], name="invented"))
    for opset in broken.opset_import:
        if opset.domain == "":
            opset.version = 26
    full = plan.graphs[0]
    uncovered = plans.GraphPlan(full.name, full.onnx, full.sha256,
                                {k: v for k, v in full.shapes.items() if k != "positions"})
    plan = plans.BuildPlan(**{**plan.__dict__, "graphs": [uncovered, plan.graphs[1]]})
    problems = [str(p) for p in preflight.check(plan, graphs, quantized=False)]
    expected = ["plugin_namespace is 'other'", "lacks the plugin field 'mask_id'",
                "does not implement this operator", "not an ONNX operator", "opset 26",
                "input 'positions'"]
    for text in expected:
        assert any(text in problem for problem in problems), (text, problems)
    assert all(problem.startswith("full:") for problem in problems)
    with pytest.raises(preflight.PreflightError, match=f"{len(problems) + 2} problems"):
        preflight.require_clean(plan, graphs)  # and, with no Q/DQ in either graph, two more


def qdq_model(*, scale_is_input=False, zero_point=0, consumer="DequantizeLinear", block_size=None):
    """x -> QuantizeLinear(fp8) -> consumer -> MatMul with a weight, for the Q/DQ checks."""
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [0.5])
    zero = helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [zero_point])
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.1] * 16)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    if scale_is_input:
        inputs.append(helper.make_tensor_value_info("dynamic_scale", TensorProto.FLOAT, []))
    dq_attrs = {"block_size": block_size} if block_size else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "dynamic_scale" if scale_is_input else "scale", "zero"],
                              ["xq"], name="q"),
             helper.make_node(consumer, ["xq", "scale", "zero"] if consumer == "DequantizeLinear" else ["xq"],
                              ["xd"], name="dq", **dq_attrs),
             helper.make_node("MatMul", ["xd", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "qdq", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[scale, zero, weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def qdq_plan(tmp_path, tiny_export, precision="fp8"):
    plan = plan_for(tiny_export, tmp_path, target="sm_100", precision=precision)
    graph = plans.GraphPlan("full", "qdq.onnx", "0" * 64, {"x": [[1, 4], [2, 4], [8, 4]]})
    return plans.BuildPlan(**{**plan.__dict__, "graphs": [graph]})


def test_a_clean_fp8_qdq_graph_passes(tmp_path, tiny_export):
    assert preflight.check(qdq_plan(tmp_path, tiny_export), {"full": qdq_model()}) == []


@pytest.mark.parametrize("change, message", [
    (dict(scale_is_input=True), "scale is not a constant"),
    (dict(zero_point=1), "zero point is not zero"),
    (dict(consumer="Relu"), "feeds something other than DequantizeLinear"),
])
def test_broken_qdq_patterns_are_reported(tmp_path, tiny_export, change, message):
    problems = [str(p) for p in preflight.check(qdq_plan(tmp_path, tiny_export), {"full": qdq_model(**change)})]
    assert any(message in problem for problem in problems), problems


def test_a_quantized_precision_needs_its_qdq_nodes(tmp_path, tiny_export):
    problems = [str(p) for p in preflight.check(qdq_plan(tmp_path, tiny_export, "nvfp4"), {"full": qdq_model()})]
    assert any("holds no nvfp4 Q/DQ nodes" in problem for problem in problems), problems
    unquantized = plan_for(tiny_export, tmp_path, precision="fp8")
    problems = preflight.check(unquantized, load_graphs(unquantized, tiny_export))
    assert len(problems) == 2 and all("holds no fp8 Q/DQ" in str(p) for p in problems)


def test_fp4_blocks_must_be_16(tmp_path, tiny_export):
    model = qdq_model()
    fp4 = helper.make_node("TRT_FP4DynamicQuantize", ["x", "scale"], ["x4", "x4_scale"], domain="trt",
                           name="fp4", axis=-1, block_size=32, scale_type=TensorProto.FLOAT8E4M3FN)
    model.graph.node.insert(0, fp4)
    model.opset_import.append(helper.make_opsetid("trt", 1))
    problems = [str(p) for p in preflight.check(qdq_plan(tmp_path, tiny_export, "nvfp4"), {"full": model})]
    assert any("block_size is 32" in problem for problem in problems), problems
    model = copy.deepcopy(model)
    next(a for a in model.graph.node[0].attribute if a.name == "block_size").i = 16
    problems = [str(p) for p in preflight.check(qdq_plan(tmp_path, tiny_export, "nvfp4"), {"full": model})]
    assert not any("block_size" in problem for problem in problems), problems


def test_an_orl_export_needs_both_plugins_and_passes_preflight(exports, tmp_path):
    export_dir = exports["orl"]
    plan = plan_for(export_dir, tmp_path, graphs=("full",))
    assert plan.plugins == [{"name": "ParallelUnmask", "namespace": "dlmrt", "version": "2"},
                            {"name": "ResidualContext", "namespace": "dlmrt", "version": "1"}]
    graphs = load_graphs(plan, export_dir)
    assert preflight.check(plan, graphs) == []
    node = next(node for node in graphs["full"].graph.node if node.op_type == "ResidualContext")
    node.attribute.remove(next(a for a in node.attribute if a.name == "plugin_version"))
    assert [str(p) for p in preflight.check(plan, graphs)] == [
        f"full: node {node.name!r} (dlmrt::ResidualContext): plugin_version is None, the registered plugin "
        f"is version '1': re-export with this dlmrt"]
