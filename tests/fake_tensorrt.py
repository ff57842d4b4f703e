"""A recording fake of the TensorRT calls TrtBackend makes, honest about the binding contract.

An "engine" is what `engine_builder` (a stand-in for `dlmrt.engines.builder.build_graph`) writes: the
ONNX file it was built from and the plan's profile. Deserialized, it exposes the graph's tensors as
TensorRT would (dynamic axes as -1, the profile's min/opt/max), and its execution context:

- refuses an input shape outside the profile, as TensorRT does (returns False);
- on `execute_async_v3`, fails unless every input has a shape and every input and output an address;
- reads each input from its address (CPU memory), runs the graph with ONNX Runtime, checks each
  output has the shape the context reports for it, and writes it to the output's address;
- records every shape and address call and the addresses of every execution.

So the backend's tokens come out right only if it bound the right buffers and reads the outputs
where the engine wrote them.
"""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

_SCALED = re.compile(r"^(\d+)\*(\w+)$")


class TensorIOMode:
    INPUT = "INPUT"
    OUTPUT = "OUTPUT"


class Logger:
    WARNING = 2

    def __init__(self, level):
        self.level = level


def engine_builder(plan, graph, onnx_path, timing_cache) -> tuple[bytes, bytes]:
    """Stands in for `builder.build_graph`: the 'engine' names its ONNX file and profile."""
    return json.dumps({"onnx": str(Path(onnx_path).resolve()), "profile": graph.shapes}).encode(), timing_cache or b""


class FakeTensorRT:
    """Stands in for the `tensorrt` module."""

    TensorIOMode = TensorIOMode
    Logger = Logger

    def __init__(self, version: str):
        self.__version__ = version
        self.events: list[str] = []
        self.contexts: list[FakeContext] = []

    def register_plugins(self) -> None:
        self.events.append("register plugins")

    def Runtime(self, logger):  # noqa: N802 (TensorRT's name)
        return FakeRuntime(self)


class FakeRuntime:
    def __init__(self, trt: FakeTensorRT):
        self.trt = trt

    def deserialize_cuda_engine(self, data: bytes):
        assert "register plugins" in self.trt.events, "an engine was deserialized before the plugins were registered"
        self.trt.events.append("deserialize")
        return FakeEngine(self.trt, json.loads(data))


def _tensors(values) -> dict[str, tuple[np.dtype, list]]:
    found = {}
    for value in values:
        tensor = value.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        found[value.name] = (onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type), dims)
    return found


class FakeEngine:
    def __init__(self, trt: FakeTensorRT, spec: dict):
        self.trt, self.profile = trt, spec["profile"]
        model = onnx.load(spec["onnx"], load_external_data=False)
        self.inputs, self.outputs = _tensors(model.graph.input), _tensors(model.graph.output)
        self.session = ort.InferenceSession(spec["onnx"], providers=["CPUExecutionProvider"])
        self.names = list(self.inputs) + list(self.outputs)

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> str:
        return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        _, dims = self.inputs.get(name) or self.outputs[name]
        return tuple(d if isinstance(d, int) else -1 for d in dims)

    def get_tensor_profile_shape(self, name: str, profile: int):
        assert profile == 0 and name in self.inputs and -1 in self.get_tensor_shape(name)
        return [tuple(shape) for shape in self.profile[name]]

    def create_execution_context(self):
        context = FakeContext(self)
        self.trt.contexts.append(context)
        return context


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.shape_calls = self.address_calls = 0
        self.executions: list[dict[str, int]] = []

    def set_input_shape(self, name: str, shape) -> bool:
        self.shape_calls += 1
        declared = self.engine.get_tensor_shape(name)
        shape = tuple(shape)
        if len(shape) != len(declared):
            return False
        if -1 in declared:
            low, _, high = self.engine.get_tensor_profile_shape(name, 0)
            if any(not lo <= size <= hi for size, lo, hi in zip(shape, low, high)):
                return False
        elif shape != declared:
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        assert name in self.engine.names, name
        self.address_calls += 1
        self.addresses[name] = address
        return True

    def _dims(self) -> dict[str, int]:
        sizes = {}
        for name, (_, dims) in self.engine.inputs.items():
            for dim, size in zip(dims, self.shapes[name]):
                if isinstance(dim, str) and _SCALED.match(dim) is None and "+" not in dim:
                    assert sizes.setdefault(dim, size) == size, f"axis {dim} has two sizes"
        return sizes

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        dims = self.engine.outputs[name][1] if name in self.engine.outputs else self.engine.inputs[name][1]
        sizes = self._dims()
        return tuple(dim if isinstance(dim, int) else sum(_size(term.strip(), sizes) for term in dim.split("+"))
                     for dim in dims)

    def execute_async_v3(self, stream: int) -> bool:
        unset = [name for name in self.engine.inputs if name not in self.shapes]
        unbound = [name for name in self.engine.names if name not in self.addresses]
        assert not unset and not unbound, f"executed with inputs {unset} shapeless, tensors {unbound} unbound"
        feeds = {name: _view(self.addresses[name], dtype, self.shapes[name]).copy()
                 for name, (dtype, _) in self.engine.inputs.items()}
        results = self.engine.session.run(list(self.engine.outputs), feeds)
        for name, result in zip(self.engine.outputs, results):
            assert result.shape == self.get_tensor_shape(name), (name, result.shape, self.get_tensor_shape(name))
            _view(self.addresses[name], self.engine.outputs[name][0], result.shape)[...] = result
        self.executions.append(dict(self.addresses))
        return True


def _size(term: str, sizes: dict[str, int]) -> int:
    """One term of a symbolic dimension: a named axis, or N*axis."""
    scaled = _SCALED.match(term)
    return int(scaled.group(1)) * sizes[scaled.group(2)] if scaled else sizes[term]


def _view(address: int, dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(address)
    return np.ctypeslib.as_array(raw).view(dtype).reshape(shape)
