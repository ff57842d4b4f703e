"""`dlmrt::EntropyBoundStep` as a TensorRT plugin, on the CPU: its registration against a recording fake
of `tensorrt.plugin`, and the engine side's preflight of a graph holding the node.

The fake (`FakePluginModule`) checks what TensorRT 10.9+'s `tensorrt.plugin` checks when the
decorators run (its `_validate.py`): a `namespace::name` id outside the reserved namespaces,
registered once; a descriptor function whose arguments are all annotated, TensorDescs first and
then serializable attributes, returning a Tuple of TensorDescs; an AOT implementation for a
registered id whose arguments are the descriptor's tensors, a subset of its attributes, `outputs`
and `tactic`, annotated `-> Tuple[str | bytes, str | bytes, KernelLaunchParams, SymExprs]`. Shape
expressions are the ONNX node's dimension names (B, W, V), so the descriptors the plugin returns
and the launch it asks for can be read back symbolically and compared with the ONNX contract
(`onnx_function.standalone_model`) and the kernel's signature (`aot.SIGNATURES`).
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from types import ModuleType, SimpleNamespace

import pytest

from dlmrt.core.errors import MissingExtraError
from helpers import check_plugin_registration, fresh_module

onnx = pytest.importorskip("onnx", reason="the ONNX path needs the 'onnx' extra")

from dlmrt.engines import plan as plans  # noqa: E402
from dlmrt.engines import plugin_specs, preflight  # noqa: E402
from dlmrt.ops.entropy_bound import onnx_function  # noqa: E402
from dlmrt.ops.parallel_unmask import trt_plugin as shared_trt_plugin  # noqa: E402

PLUGIN_ID = "dlmrt::EntropyBoundStep"
TRT_DTYPES = {onnx.TensorProto.FLOAT: "FLOAT", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.BOOL: "BOOL"}


# -- a recording fake of tensorrt.plugin ------------------------------------------------------------

class TensorDesc:
    def __init__(self, shape_expr, dtype):
        self.shape_expr, self.dtype = tuple(shape_expr), dtype

    def like(self) -> TensorDesc:
        return TensorDesc(self.shape_expr, self.dtype)


class SymInt32(typing.NamedTuple):
    expr: object


class SymExprs:
    def __init__(self, exprs):
        self.exprs = list(exprs)


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, exprs) -> SymIntExprs:
        assert all(isinstance(e, (SymInt32, int)) for e in exprs), exprs
        return cls(exprs)


class KernelLaunchParams:
    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for name in self.FIELDS:
            setattr(self, name, 0 if name == "shared_mem" else 1)

    def __setattr__(self, name, value):
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        self.__dict__[name] = value if isinstance(value, SymInt32) else SymInt32(value)


class FakePluginModule(ModuleType):
    """Stands in for `tensorrt.plugin`; `definitions` holds what was registered, by plugin id."""

    TensorDesc, SymInt32, SymExprs, SymIntExprs, KernelLaunchParams = (TensorDesc, SymInt32, SymExprs, SymIntExprs,
                                                                       KernelLaunchParams)

    def __init__(self):
        super().__init__("tensorrt.plugin")
        self.definitions: dict[str, SimpleNamespace] = {}

    @staticmethod
    def from_shape_expr(shape_expr, dtype) -> TensorDesc:
        return TensorDesc(shape_expr, dtype)

    def register(self, plugin_id: str):
        def decorator(function):
            namespace, name = plugin_id.split("::")
            assert "." not in namespace + name and namespace not in ("", "trt", "tensorrt", "std"), plugin_id
            assert plugin_id not in self.definitions, f"{plugin_id} is already registered"
            tensors, attributes = [], {}
            for arg, param in inspect.signature(function).parameters.items():
                assert param.annotation is not inspect.Parameter.empty and param.default is inspect.Parameter.empty
                if isinstance(param.annotation, type) and issubclass(param.annotation, TensorDesc):
                    assert not attributes, "TensorDescs come before the attributes"
                    tensors.append(arg)
                else:
                    assert param.annotation in (int, float, bytes, bool, str), (arg, param.annotation)
                    attributes[arg] = param.annotation
            returned = inspect.signature(function).return_annotation
            assert typing.get_origin(returned) is tuple and all(issubclass(a, TensorDesc)
                                                                for a in typing.get_args(returned)), returned
            self.definitions[plugin_id] = SimpleNamespace(describe=function, tensors=tensors, attributes=attributes,
                                                          outputs=len(typing.get_args(returned)), aot_impl=None)
            return function
        return decorator

    def aot_impl(self, plugin_id: str):
        def decorator(function):
            assert plugin_id in self.definitions, f"{plugin_id} is not registered"
            definition = self.definitions[plugin_id]
            signature = inspect.signature(function)
            names = list(signature.parameters)
            attributes = [n for n in definition.attributes if n in names]
            assert names == [*definition.tensors, *attributes, "outputs", "tactic"], names
            returned = signature.return_annotation
            assert typing.get_origin(returned) is tuple, f"an aot_impl needs its return annotation, got {returned}"
            name, code, launch, scalars = typing.get_args(returned)
            assert set(typing.get_args(name)) == set(typing.get_args(code)) == {str, bytes}
            assert launch is KernelLaunchParams and issubclass(scalars, SymExprs)
            definition.aot_impl = function
            return function
        return decorator


@pytest.fixture
def fake_trt(monkeypatch):
    """(tensorrt, tensorrt.plugin) fakes in sys.modules, and a fresh record of registered plugins."""
    trtp = FakePluginModule()
    trt = ModuleType("tensorrt")
    trt.float32, trt.int64, trt.bool = "FLOAT", "INT64", "BOOL"
    trt.plugin = trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(shared_trt_plugin, "_registered", set())
    return trt, trtp


def registered(fake_trt, monkeypatch, cc: int = 90) -> SimpleNamespace:
    module = fresh_module("dlmrt.ops.entropy_bound.trt_plugin")
    monkeypatch.setattr(module, "_build_target", lambda: cc)
    module.register()
    module.register()  # once counts: the fake refuses a second registration
    return fake_trt[1].definitions[PLUGIN_ID]


def onnx_descs(values) -> dict[str, TensorDesc]:
    """The TensorDescs of the standalone model's inputs or outputs, dimensions by name."""
    return {v.name: TensorDesc([d.dim_param for d in v.type.tensor_type.shape.dim],
                               TRT_DTYPES[v.type.tensor_type.elem_type]) for v in values}


# -- the registration -----------------------------------------------------------------------------

def test_the_plugin_is_registered_under_the_onnx_nodes_id_with_its_inputs(fake_trt, monkeypatch):
    definition = registered(fake_trt, monkeypatch)
    assert list(fake_trt[1].definitions) == [f"{onnx_function.DOMAIN}::{onnx_function.OP_TYPE}"] == [PLUGIN_ID]
    assert definition.tensors == list(onnx_function.INPUTS) and definition.attributes == {}
    assert definition.outputs == len(onnx_function.OUTPUTS) and definition.aot_impl is not None


def test_the_output_descriptors_are_the_onnx_nodes_outputs(fake_trt, monkeypatch):
    definition = registered(fake_trt, monkeypatch)
    graph = onnx_function.standalone_model().graph
    inputs, expected = onnx_descs(graph.input), onnx_descs(graph.output)
    described = definition.describe(*(inputs[name] for name in onnx_function.INPUTS))
    assert [(d.shape_expr, d.dtype) for d in described] == [
        (expected[name].shape_expr, expected[name].dtype) for name in onnx_function.OUTPUTS]
    assert [d.dtype for d in described] == ["INT64", "INT64", "FLOAT", "BOOL", "FLOAT"]


@pytest.mark.parametrize("cc", [90, 100, 120])
def test_the_aot_implementation_hands_over_the_fused_kernel_for_the_build_gpu(fake_trt, monkeypatch, cc):
    pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")
    from dlmrt.ops.entropy_bound.triton_kernels import CONFIGS
    from dlmrt.ops.parallel_unmask import aot

    definition = registered(fake_trt, monkeypatch, cc)
    graph = onnx_function.standalone_model().graph
    inputs, outputs = onnx_descs(graph.input), onnx_descs(graph.output)
    name, ptx, launch, scalars = definition.aot_impl(*(inputs[n] for n in onnx_function.INPUTS),
                                                     outputs=tuple(outputs.values()), tactic=0)
    assert isinstance(name, bytes) and isinstance(ptx, bytes) and name == b"entropy_bound_kernel"
    ptx = ptx.decode()
    assert re.search(rf"^\.target sm_{cc}a?\b", ptx, flags=re.M), ptx[:400]
    entry = re.search(r"\.entry (\w+)\((.*?)\)", ptx, flags=re.S)
    assert entry.group(1) == "entropy_bound_kernel"
    # what TensorRT passes: the 8 inputs, the scalars W and V, the 5 outputs (Triton's scratch dropped)
    assert list(aot.SIGNATURES["entropy_bound_kernel"]) == [*onnx_function.INPUTS, "W", "V", *onnx_function.OUTPUTS]
    assert [p.split()[1] for p in entry.group(2).split(",")] == [".u64"] * 8 + [".u32"] * 2 + [".u64"] * 5
    config = CONFIGS["entropy_bound_kernel"]
    assert launch.grid_x == SymInt32("B")  # one program per row
    assert (launch.grid_y, launch.grid_z, launch.block_y, launch.block_z) == (SymInt32(1),) * 4
    assert launch.block_x == SymInt32(config.num_warps * 32)
    assert launch.shared_mem == SymInt32(aot.compile_kernel("entropy_bound_kernel", cc).shared_mem)
    assert isinstance(scalars, SymIntExprs) and scalars.exprs == [SymInt32("W"), SymInt32("V")]


def test_registration_without_tensorrt_says_which_extra(monkeypatch):
    module = fresh_module("dlmrt.ops.entropy_bound.trt_plugin")
    monkeypatch.setattr(shared_trt_plugin, "_registered", set())
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingExtraError, match=re.escape(f"{PLUGIN_ID} needs TensorRT")):
        module.register()


@pytest.mark.trt
def test_plugin_is_registered_under_the_onnx_namespace_and_version():
    check_plugin_registration("entropy_bound")


# -- the engine side: plugin spec and preflight ---------------------------------------------------

def test_the_known_spec_matches_the_onnx_node():
    spec = plugin_specs.KNOWN[(onnx_function.DOMAIN, onnx_function.OP_TYPE)]
    node = onnx_function.node(list(onnx_function.INPUTS), list(onnx_function.OUTPUTS))
    assert set(spec.fields) == {a.name for a in node.attribute} - {"plugin_namespace", "plugin_version"} == set()
    assert (spec.version, spec.registry_version) == (onnx_function.PLUGIN_VERSION,
                                                     onnx_function.TENSORRT_PLUGIN_VERSION)
    assert (spec.inputs, spec.outputs) == (len(onnx_function.INPUTS), len(onnx_function.OUTPUTS))
    assert plugin_specs.outdated([spec.record()]) == []
    assert plugin_specs.outdated([dict(spec.record(), version="0")]) == [
        "dlmrt::EntropyBoundStep v0, this dlmrt has v1"]


def step_plan(model) -> plans.BuildPlan:
    """A plan building the standalone step model, with the plugins its nodes use."""
    low, opt, high = {"B": 1, "W": 1, "V": 8}, {"B": 2, "W": 32, "V": 64}, {"B": 4, "W": 256, "V": 128}
    shapes = {v.name: [[sizes[d.dim_param] for d in v.type.tensor_type.shape.dim] for sizes in (low, opt, high)]
              for v in model.graph.input}
    graph = plans.GraphPlan("step", "entropy_bound_step.onnx", "0" * 64, shapes)
    return plans.BuildPlan(model="step", export_dir=".", target="sm_90", compute_capability=[9, 0], precision="bf16",
                           tensorrt="10.13", typing="precision-flags", builder_flags=[], export_dtype="float32",
                           quantization=None, ranges={}, graphs=[graph], plugins=plugin_specs.used_by([model]),
                           options=plans.BuildOptions(1 << 30, 3), output="engines/step")


def test_a_graph_holding_the_node_finds_the_plugin_and_passes_preflight():
    model = onnx_function.standalone_model()
    plan = step_plan(model)
    assert plan.plugins == [{"name": "EntropyBoundStep", "namespace": "dlmrt", "version": "1"}]
    assert preflight.check(plan, {"step": model}) == []


def test_preflight_refuses_a_node_the_plugin_would_not_take():
    model = onnx_function.standalone_model()
    plan = step_plan(model)
    node = model.graph.node[0]
    node.attribute.remove(next(a for a in node.attribute if a.name == "plugin_version"))
    del node.input[-1]
    where = "step: node 'entropy_bound_step' (dlmrt::EntropyBoundStep)"
    assert [str(p) for p in preflight.check(plan, {"step": model})] == [
        f"{where}: plugin_version is None, the registered plugin is version '1': re-export with this dlmrt",
        f"{where}: has 7 inputs and 5 outputs, the plugin (v1) takes 8 and 5: an export made by another dlmrt; "
        "re-export with this one"]
    undeclared = plans.BuildPlan(**{**plan.__dict__, "plugins": []})
    assert [p.what for p in preflight.check(undeclared, {"step": onnx_function.standalone_model()})] == [
        "a custom-domain node with no plugin in the plan: TensorRT would inline its ONNX function, which this check "
        "does not cover; declare the plugin"]
