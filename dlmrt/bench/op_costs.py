"""What each aten op of a step reads, writes and computes, summed per roofline row.

`OpCosts` is a TorchDispatchMode: run a step inside it (on meta tensors: only shapes are needed) and
every op dispatched adds to its row (`step_scopes.row_name` of the group running it):

- bytes read: the input tensors' bytes, each distinct tensor once per op, the tensors of one storage
  never more than the storage; a tensor broadcast by a zero stride counts its distinct elements;
- bytes written: the outputs' bytes, counted the same way;
- FLOPs: torch's FLOP registry and `flop_formulas` (matrix products and attention; elementwise ops
  count none);
- weight bytes: the part of bytes read that lies in the weights (`weights`: the model's parameters and
  buffers, and stand-ins for them).

Three rules keep the counts what a kernel moves rather than what a tensor holds:

- a view (`view`, `transpose`, `expand`, `split`, ...) and an allocation read and write nothing;
- a gather (`embedding`, `index_select`, `gather`, indexing) reads only what it gathers from its source:
  the output's elements;
- a grouped matrix product `torch._grouped_mm(x [M, K], w [E, K, N], offs)`, the MoE expert GEMM,
  reads only the experts its rows are routed to. Shapes do not say which; under uniform routing of
  `M / top_k` tokens choosing `top_k` distinct experts each, the expected number touched is
  `expected_experts(E, M / top_k, top_k)`, and `w` counts that many experts' bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlmrt.bench.flop_formulas import all_formulas

aten = torch.ops.aten
# Ops that only allocate, or only describe a tensor, beside the view ops (OpOverload.is_view).
_FREE = frozenset({aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided,
                   aten._unsafe_view, aten.lift_fresh, aten.detach, aten.alias, aten._reshape_alias,
                   torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit})
# Ops that gather from the source at this argument position: they read the output's elements of it.
_GATHERS = {aten.embedding: 0, aten.index_select: 0, aten.gather: 0, aten.index: 0}


def expected_experts(experts: int, tokens: float, top_k: int) -> float:
    """Experts touched by `tokens` tokens that each choose `top_k` distinct experts of `experts`
    uniformly: E * (1 - (1 - k/E)^T). With top_k 1 it is E * (1 - (1 - 1/E)^M) over M draws."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the distinct elements a tensor views (a zero stride repeats elements)."""
    counts = [size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0]
    return 0 if 0 in tensor.shape else math.prod(counts) * tensor.element_size()


@dataclass
class Cost:
    """One row's sums; `ops` counts the aten ops dispatched in it."""

    ops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    weight_bytes: float = 0.0  # of bytes_read (a float: routed experts are an expectation)
    flops: int = 0
    # FLOPs by the dtype of the op's inputs, which sets the peak rate they run at
    flops_by_dtype: dict[torch.dtype, int] | None = None

    def add(self, read: float, written: int, weights: float, flops: int, dtype: torch.dtype) -> None:
        self.ops += 1
        self.bytes_read += round(read)
        self.bytes_written += written
        self.weight_bytes += weights
        if flops:
            self.flops += flops
            self.flops_by_dtype = self.flops_by_dtype or {}
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0) + flops


def _strided(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


def _per_storage(tensors: Iterable[tuple[torch.Tensor, float]]) -> dict[int, float]:
    """The bytes of each storage's distinct views (a view twice counts once), at most the storage's."""
    views: dict[int, dict[tuple, float]] = defaultdict(dict)
    limit: dict[int, int] = {}
    for tensor, size in tensors:
        storage = tensor.untyped_storage()
        views[storage._cdata][tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())] = size
        limit[storage._cdata] = storage.nbytes()
    return {storage: min(sum(sizes.values()), limit[storage]) for storage, sizes in views.items()}


def _inputs(args, kwargs, scaled: dict[int, float]) -> Iterable[tuple[torch.Tensor, float]]:
    """Each input tensor with its bytes: `scaled[position]` where a rule set them."""
    for position, value in enumerate(args):
        if _strided(value):
            yield value, scaled.get(position, tensor_bytes(value))
        else:  # the tensors of a list (cat, stack)
            yield from ((t, tensor_bytes(t)) for t in tree_leaves(value) if _strided(t))
    yield from ((t, tensor_bytes(t)) for t in tree_leaves(kwargs) if _strided(t))


class OpCosts(TorchDispatchMode):
    """Sums each op's cost into `rows[row(op name)]`; `weights` are the tensors whose bytes are weight
    bytes (their storages are looked up), `top_k` the experts each token chooses (grouped GEMMs)."""

    def __init__(self, row: Callable[[str], str], weights: Iterable[torch.Tensor], top_k: int = 1):
        super().__init__()
        self.row, self.top_k = row, top_k
        self.weight_storages = {t.untyped_storage()._cdata for t in weights}
        self.rows: dict[str, Cost] = defaultdict(Cost)
        self._formulas = all_formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or packet in _FREE:
            return out
        outputs = [t for t in tree_leaves(out) if _strided(t)]
        read, weights = self._read(packet, args, kwargs, outputs)
        written = round(sum(_per_storage((t, tensor_bytes(t)) for t in outputs).values()))
        formula = self._formulas.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        inputs = [t for t in tree_leaves((args, kwargs)) if _strided(t) and t.is_floating_point()]
        dtype = inputs[0].dtype if inputs else torch.float32
        self.rows[self.row(packet.__name__)].add(read, written, weights, flops, dtype)
        return out

    def _read(self, packet, args, kwargs, outputs) -> tuple[float, float]:
        """(bytes read, of which weight bytes) of the op's inputs."""
        scaled: dict[int, float] = {}  # argument position -> its bytes, where a rule sets them
        if packet in _GATHERS and outputs:
            source = args[_GATHERS[packet]]
            scaled[_GATHERS[packet]] = min(tensor_bytes(source), outputs[0].numel() * source.element_size())
        if packet is aten._grouped_mm and args[1].dim() == 3:
            rows, (experts, k, n) = args[0].shape[0], args[1].shape
            touched = min(experts, expected_experts(experts, rows / self.top_k, self.top_k))
            scaled[1] = touched * k * n * args[1].element_size()
        sizes = _per_storage(_inputs(args, kwargs, scaled))
        return sum(sizes.values()), sum(size for storage, size in sizes.items() if storage in self.weight_storages)
