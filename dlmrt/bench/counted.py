"""Counted work: what one benchmark case does, in counts that are the same run after run.

A timed gate cannot see a 10% slowdown in the noise of a shared machine; counts see it on any
machine. `count_work` runs one instrumented generate of a case and counts its forwards, host reads,
blocks, FLOPs, aten ops, compiled graphs and peak tensor bytes:

    counts = count_work("torch:eager", model, prompts, settings)
    counts.as_dict()   # {"nfe": ..., "forwards_executed": ..., "host_reads": ..., ...}

Each count runs on a backend built here, as `dlmrt bench` builds the case's (the ort case over the
case's export), so that no count depends on what ran on the case's own backend before: warm-ups,
timed rounds, a re-run. A torch:compile backend runs once uncounted and is counted warm. The
instrumentation lives in the counted run only; timed runs never see it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from dlmrt.bench.backend_specs import fp8_model, split_case
from dlmrt.bench.flop_formulas import custom_formulas
from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.runtime import Fixed, GenerationResult, GenerationSettings, Generator, reference
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batch_resources import resources
from dlmrt.runtime.torch_backend import TorchBackend, resolve_mode

# Tensor methods that hand a tensor's values to the host: Python values, a NumPy array, a host copy.
READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})
# The profiler's event for a run of a compiled graph, followed by the graph's compile id.
COMPILED_REGION = "Torch-Compiled Region: "


@dataclass(frozen=True)
class WorkCounts:
    """One generate's counted work; None where the case's kind is not counted so."""

    nfe: int  # forwards that did work (GenerationMetrics.nfe)
    forwards_executed: int  # forwards run, no-op steps included (the reference loop runs none)
    host_reads: int  # READS of a tensor on the run's device, in the whole run
    blocks: int  # blocks the loop ran
    # FLOPs of the run's matrix products per generated token: FlopCounterMode's (torch eager, reference),
    # or 2*M*K*N of every MatMul and Gemm of the ONNX graphs at the shapes each step bound (ort)
    flops_per_token: int | None
    aten_ops_per_step: int | None  # aten ops one step dispatched: the first (torch eager), the second (reference)
    compiled_graphs: int | None  # distinct compiled graphs a warm run ran (torch:compile)
    recompiles: int | None  # graphs dynamo compiled in that warm run: a guard that fails run after run
    # The most bytes that tensors the run allocated on its device held at once (torch eager, reference, ort)
    peak_bytes: int | None
    # The intra-op threads ONNX Runtime's sessions were given (0: its default, every core), the most of
    # any graph's (ort): a session pinned to fewer threads runs the same work slower
    ort_threads: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def count_work(kind: str, model: Denoiser, prompts: Sequence[Sequence[int]], settings: GenerationSettings, *,
               export_dir: str | Path | None = None) -> WorkCounts:
    """The counted work of the bench case `kind` (reference, torch:eager, torch:compile, torch:auto,
    each with `:fp8`, and ort) decoding `prompts`, on a backend built as `dlmrt bench` builds the case's:
    a TorchBackend of `len(prompts)` rows, an OrtBackend over `export_dir` (the case's export of `model`). The reference
    loop decodes `settings` as the bench's reference case does: the fixed policy, no cache."""
    if kind == "reference":
        return _count_reference(model, prompts, dataclasses.replace(settings, policy=Fixed(), cache="none"))
    if kind.partition(":")[0] == "ort":  # ort, or ort:int8 ... over the case's quantized export
        if export_dir is None:
            raise ArgumentError("counting the ort case needs the case's export: give export_dir")
        from dlmrt.runtime.ort_backend import OrtBackend

        # threads that do not spin after a run, which would slow a case timed right after this count
        return _count_ort(OrtBackend(export_dir, spinning=False), prompts, settings)
    name, _, case = kind.partition(":")
    mode, precision = split_case(case)
    resolved = resolve_mode(mode or "auto", model.device) if name == "torch" else None
    if resolved not in ("eager", "compile"):
        raise ArgumentError(f"cannot count the case {kind!r}: counted cases are reference, torch:eager, "
                            f"torch:compile, torch:auto (eager or compile), each with :fp8, and ort")
    backend = TorchBackend(fp8_model(model) if precision == "fp8" else model, mode=resolved, max_batch=len(prompts))
    if resolved == "compile":
        return _count_compiled(backend, prompts, settings)
    return _count_eager(backend, prompts, settings)


class HostReads(TorchFunctionMode):
    """Counts the reads (READS) of tensors on `device` by the host: on CUDA each waits for the
    device; on a CPU every tensor is on the device, so the loop's reads of its own small tensors
    (prompt lengths, say) count too."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type, self.count = device.type, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__name__", None) in READS and args and isinstance(args[0], torch.Tensor)
                and args[0].device.type == self.device_type):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _has_storage(value: object) -> bool:
    """A tensor with a storage to count: not a weight packed for oneDNN (dlmrt/runtime/onednn.py), which is
    opaque, made once per backend like the weights themselves."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


class _Dispatched(TorchDispatchMode):
    """Counts the aten ops dispatched, and the bytes of the tensors they allocate on `device` that are
    alive at once, at their peak. A storage is allocated by the op that first returns it when no input
    holds it (tensors made before, such as weights, are inputs first), or by `lift_fresh` (a tensor
    made from host data), and freed when its finalizer runs. With the garbage collector off
    (`deterministic_frees`), storages are freed by reference counting alone, in the same order every run."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type, self.ops, self.live, self.peak = device.type, 0, 0, 0
        self.marks: list[int] = []  # `ops` where `mark` was called, the first two times
        # by id(storage): torch keeps a storage's Python object for as long as the storage lives
        self._finalizers: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        inputs = set() if func is torch.ops.aten.lift_fresh.default else {
            id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if _has_storage(t)}
        for tensor in tree_leaves(out):
            if _has_storage(tensor) and tensor.device.type == self.device_type:
                self._allocated(tensor.untyped_storage(), inputs)
        return out

    def _allocated(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key = id(storage)
        if key in inputs or key in self._finalizers:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self._finalizers[key] = weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        del self._finalizers[key]

    def mark(self) -> None:
        if len(self.marks) < 2:
            self.marks.append(self.ops)

    def __exit__(self, *exc):
        for finalizer in self._finalizers.values():  # what outlives the run is no longer followed
            finalizer.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)


@contextlib.contextmanager
def deterministic_frees() -> Iterator[None]:
    """No garbage collection inside: a tensor held in a reference cycle stays alive to the end,
    instead of being freed whenever a collection happens to run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, which also counts the CPU's flash attention as the other attention kernels,
    the oneDNN linear layers of the CPU path as the linear layers they stand for, and grouped matrix
    products (`dlmrt.bench.flop_formulas`)."""
    return FlopCounterMode(display=False, custom_mapping=custom_formulas())


def _count_reference(model: Denoiser, prompts: Sequence[Sequence[int]], plain: GenerationSettings) -> WorkCounts:
    with (deterministic_frees(), _Dispatched(model.device) as dispatched, flop_counter() as flops,
          HostReads(model.device) as reads):
        result = reference.generate(model, prompts, plain, on_step=dispatched.mark)
    metrics = result.metrics
    first, second = dispatched.marks  # the ends of the first two steps: the first holds the loop's set-up
    return WorkCounts(nfe=metrics.nfe, forwards_executed=metrics.nfe, host_reads=reads.count,
                      blocks=plain.num_blocks, flops_per_token=flops.get_total_flops() // metrics.generated_tokens,
                      aten_ops_per_step=second - first, compiled_graphs=None, recompiles=None,
                      peak_bytes=dispatched.peak)


def _count_eager(backend: TorchBackend, prompts, settings: GenerationSettings) -> WorkCounts:
    device = backend.spec.device
    dispatched = _Dispatched(device)
    executor = resources(backend).executor
    run = executor.run

    def first_step_counted(state, program, steps: int) -> None:
        first = not dispatched.marks  # the run's first call runs one step: the first block's first
        if first:
            dispatched.mark()
        run(state, program, steps)
        if first:
            dispatched.mark()

    executor.run = first_step_counted
    with deterministic_frees(), dispatched, flop_counter() as flops, HostReads(device) as reads:
        result, blocks = _generate(backend, prompts, settings)
    before, after = dispatched.marks
    return _counts(result, blocks, reads, flops.get_total_flops(), aten_ops_per_step=after - before,
                   peak_bytes=dispatched.peak)


def _count_ort(backend, prompts, settings: GenerationSettings) -> WorkCounts:
    if backend.spec.noise == "uniform":
        raise ArgumentError(f"the ort case of {backend.spec.name} cannot be counted: its FLOPs are counted "
                            f"over the step graphs of mask models")
    flops = OnnxFlops(backend)
    executor = resources(backend).executor
    run = executor.run

    def flops_counted(state, program, steps: int) -> None:
        flops.add(state, program, steps)
        run(state, program, steps)

    executor.run = flops_counted
    device = backend.spec.device
    with deterministic_frees(), _Dispatched(device) as dispatched, HostReads(device) as reads:
        result, blocks = _generate(backend, prompts, settings)
    threads = max(session.get_session_options().intra_op_num_threads for session in backend.sessions.values())
    return _counts(result, blocks, reads, flops.total, peak_bytes=dispatched.peak, ort_threads=threads)


def _count_compiled(backend: TorchBackend, prompts, settings: GenerationSettings) -> WorkCounts:
    """Counted warm, after a run that compiles (or finds the graphs compiled in this process for a
    backend before: how many the first run compiles depends on the process, so it is not counted)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    Generator(backend).generate(prompts, settings)
    executor = resources(backend).executor
    run = executor.run

    def outside_the_mode(state, program, steps: int) -> None:
        # dynamo guards on the torch function modes: under HostReads the steps would compile again.
        # A compiled step holds no host read (fullgraph), so none goes uncounted.
        with torch.overrides._pop_mode_temporarily():
            run(state, program, steps)

    executor.run = outside_the_mode
    compiled_before = counters["stats"]["unique_graphs"]
    with profile(activities=[ProfilerActivity.CPU]) as profiler, HostReads(backend.spec.device) as reads:
        result, blocks = _generate(backend, prompts, settings)
    regions = {event.name for event in profiler.events() if event.name.startswith(COMPILED_REGION)}
    return _counts(result, blocks, reads, None, compiled_graphs=len(regions),
                   recompiles=counters["stats"]["unique_graphs"] - compiled_before)


def _generate(backend: Backend, prompts, settings: GenerationSettings) -> tuple[GenerationResult, int]:
    """The generate's result, and the blocks its loop ran: every row starts at block 0, and each row's
    last update names its last block."""
    stream = Generator(backend).stream(prompts, settings)
    blocks = 1 + max(update.block for update in stream)
    return stream.result, blocks


def _counts(result: GenerationResult, blocks: int, reads: HostReads, flops: int | None, *,
            aten_ops_per_step: int | None = None, compiled_graphs: int | None = None, recompiles: int | None = None,
            peak_bytes: int | None = None, ort_threads: int | None = None) -> WorkCounts:
    metrics = result.metrics
    return WorkCounts(nfe=metrics.nfe, forwards_executed=metrics.forwards_executed, host_reads=reads.count,
                      blocks=blocks, flops_per_token=None if flops is None else flops // metrics.generated_tokens,
                      aten_ops_per_step=aten_ops_per_step, compiled_graphs=compiled_graphs, recompiles=recompiles,
                      peak_bytes=peak_bytes, ort_threads=ort_threads)


class OnnxFlops:
    """FLOPs of an OrtBackend's step graphs at the shapes each step binds: 2 * M * K * N for every MatMul
    and Gemm, over shapes from ONNX Runtime's symbolic shape inference of the graph with its inputs
    fixed to those shapes, inferred once a graph and shapes."""

    def __init__(self, backend):
        self.backend, self.total = backend, 0
        self._per_step: dict[tuple, int] = {}

    def add(self, state, kind, steps: int) -> None:
        from dlmrt.runtime.device_step import graph_inputs

        graph = kind.graph(state.bucket.guided)
        shapes = {name: tuple(tensor.shape) for name, tensor in graph_inputs(state, kind).items()}
        key = (graph, *shapes.items())
        if key not in self._per_step:
            entry = self.backend.manifest.graphs[graph]
            self._per_step[key] = matmul_flops(self.backend.export_dir / entry.file, shapes)
        self.total += steps * self._per_step[key]


def matmul_flops(path: Path, shapes: Mapping[str, Sequence[int]]) -> int:
    """2 * M * K * N summed over the MatMul and Gemm nodes of the ONNX model at `path` (its local
    functions inlined: the residual context's holds one), its inputs given these `shapes`."""
    import onnx
    import onnx.inliner
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = onnx.inliner.inline_local_functions(onnx.load(path, load_external_data=False))
    _constants_as_tensors(model.graph)
    del model.graph.value_info[:]  # the exporter's shapes, in symbols that would stay symbols
    for value in model.graph.input:
        for dim, size in zip(value.type.tensor_type.shape.dim, shapes.get(value.name, ())):
            dim.dim_value = size  # replaces the symbol (a oneof)
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    known = {value.name: [dim.dim_value if dim.HasField("dim_value") else None
                          for dim in value.type.tensor_type.shape.dim]
             for value in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    known.update({tensor.name: list(tensor.dims) for tensor in inferred.graph.initializer})
    total = 0
    for node in inferred.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        first, out = known.get(node.input[0]), known.get(node.output[0])
        if not first or not out or None in first + out:
            raise RuntimeError(f"{path}: the shapes of {node.op_type} node {node.name!r} are not known at "
                               f"{dict(shapes)}: its FLOPs cannot be counted")
        transposed = any(a.name == "transA" and a.i for a in node.attribute)
        total += 2 * math.prod(out) * (first[0] if transposed else first[-1])
    return total


def _constants_as_tensors(graph) -> None:
    """Rewrite Constant nodes of a number or numbers (value_int, value_floats, ...) to hold a tensor,
    the one form ONNX Runtime's shape inference reads."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    for node in graph.node:
        form = node.attribute[0].name if node.op_type == "Constant" else None
        if form in ("value_int", "value_ints", "value_float", "value_floats"):
            value = np.array(helper.get_attribute_value(node.attribute[0]),
                             dtype=np.int64 if form.startswith("value_int") else np.float32)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _constants_as_tensors(attribute.g)
