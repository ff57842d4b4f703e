"""`dlmrt::ParallelUnmask` as Triton kernels, and the helpers `dlmrt::ResidualContext`'s kernel shares
(the online softmax, input checks).

Kernels (the semantics are `reference.py`; the tests hold them to it):

- `position_kernel`, one program per position: a pass over the vocabulary in tiles of BLOCK_V keeps
  an online softmax (running max, sum of exponentials, and the sum that gives the entropy), the
  argmax and the top two logits without the mask token; rows with temperature > 0 take a second
  pass for LLaDA's Gumbel-max in float64. It writes the candidate x0 into `new_ids` and the
  confidence (-inf where the position is not masked). A committed position is read only where the
  row edits and the position is editable; `new_ids` then gets its id after editing.
- `commit_kernel`, one program per row: each position's rank in the stable descending sort of
  the confidences (ties to the earlier position), k = min(masked, max(count, #{c >= threshold},
  factor prefix)), then `new_ids` (committed positions keep what the position kernel wrote),
  `commit` and `committed`.
- `parallel_unmask_kernel`: both in one launch, one program per row. TensorRT's AOT plugin
  launches a single kernel, so the engine runs this one; its arguments are ordered as the plugin
  passes them (the node's inputs, the extra scalars, the outputs). It is slow at a large vocabulary
  (docs/gpu-runs.md: 3240 µs greedy on [1, 32, 126464] against the two kernels' 290): one program, on
  one SM, reads the row's W positions one after another, and samples in float64 on that SM alone.
  No torch path runs it; `split_kernels` is the form that spreads a position over programs.

The random numbers are the reference's counter-based hash in uint32 arithmetic, bit for bit.
Tile sizes are compile-time constants and every loop runs over the actual W and V, so one compiled
kernel serves any shape. `parallel_unmask` launches the kernels on CUDA tensors, or on CPU tensors
when this module was imported under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dlmrt.core.errors import KernelInputError, MissingExtraError
from dlmrt.ops.parallel_unmask.reference import (_MULTIPLIERS, _RANDOM_CONFIDENCE_SALT, MEASURE_CODES,
                                                     EditParams, UnmaskParams, UnmaskResult)

try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise MissingExtraError("dlmrt's Triton kernels need Triton: pip install 'dlmrt[triton]'") from error

_MIX0 = tl.constexpr(_MULTIPLIERS[0])
_MIX1 = tl.constexpr(_MULTIPLIERS[1])
_SALT = tl.constexpr(_RANDOM_CONFIDENCE_SALT)
_PROB = tl.constexpr(MEASURE_CODES["prob"])
_MARGIN = tl.constexpr(MEASURE_CODES["margin"])
_ENTROPY = tl.constexpr(MEASURE_CODES["entropy"])
_INT32_LIMIT = 2**31


class LaunchConfig(NamedTuple):
    """A kernel's tile sizes (its constexpr arguments) and warps, shared by the launchers and `aot`."""

    constexprs: dict[str, int]
    num_warps: int


CONFIGS = {
    "position_kernel": LaunchConfig({"BLOCK_V": 1024}, num_warps=4),
    "commit_kernel": LaunchConfig({"BLOCK_W": 64}, num_warps=4),
    "parallel_unmask_kernel": LaunchConfig({"BLOCK_V": 2048, "BLOCK_W": 64}, num_warps=8),
}


# -- the counter-based hash (reference._mix32, uniform) ----------------------------------------

@triton.jit
def _mix32(x):
    """reference._mix32 on uint32: the products wrap modulo 2**32, as the reference's masks make them."""
    x = x ^ (x >> 16)
    x = x * _MIX0
    x = x ^ (x >> 15)
    x = x * _MIX1
    return x ^ (x >> 16)


@triton.jit
def _row_hash(seed, step, position):
    """The hash of (seed, step, position) before a vocabulary index is mixed in; int64 to uint32 keeps
    the low 32 bits, the reference's `& 0xFFFFFFFF`."""
    h = _mix32(seed.to(tl.uint32))
    h = _mix32(h ^ step.to(tl.uint32))
    return _mix32(h ^ position.to(tl.uint32))


@triton.jit
def _uniform(row_hash, index):
    h = _mix32(row_hash ^ index.to(tl.uint32))
    return (h.to(tl.float64) + 0.5) / 4294967296.0


@triton.jit
def _random_confidence(row_hash):
    # (floor(u * 2**23) + 0.5) / 2**23 with u = (h + 0.5) / 2**32 is exactly ((h >> 9) + 0.5) / 2**23
    h = _mix32(row_hash ^ _SALT)
    return ((h >> 9).to(tl.float32) + 0.5) / 8388608.0


# -- online softmax ------------------------------------------------------------------------------

@triton.jit
def _softmax_update(m, s, t, x, AXIS: tl.constexpr):
    """Fold a tile `x` into the running max m, s = sum exp(x - m) and t = sum exp(x - m) * (x - m)
    along AXIS (entropy = log s - t / s). Tiles of -inf only leave s = 0, with no NaN."""
    m_new = tl.maximum(m, tl.max(x, axis=AXIS))
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    gap = tl.where(s > 0, m - shift, 0.0)  # m is finite once s > 0
    rescale = tl.where(s > 0, tl.exp(gap), 0.0)
    t = rescale * (t + s * gap)
    s = rescale * s
    d = x - tl.expand_dims(shift, AXIS)
    e = tl.exp(d)
    s += tl.sum(e, axis=AXIS)
    t += tl.sum(e * tl.where(e > 0, d, 0.0), axis=AXIS)
    return m_new, s, t


# -- one position ----------------------------------------------------------------------------------

@triton.jit
def _sample(row, V, end, mask_id, row_hash, temperature, BLOCK_V: tl.constexpr):
    """LLaDA's Gumbel-max in float64: the first argmax of exp(l) / (-log u)^T, the mask token's logit
    being -inf. (-log u)^T is exp(T log(-log u)): Triton's interpreter has no float64 pow."""
    t = temperature.to(tl.float64)
    best = tl.full((), -1.0, tl.float64)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        x = tl.where(offs == mask_id, float("-inf"), x)
        noise = tl.exp(t * tl.log(-tl.log(_uniform(row_hash, offs))))
        score = tl.where(offs < V, tl.exp(x.to(tl.float64)) / noise, -1.0)
        tile_best = tl.max(score, axis=0)
        best_index = tl.where(tile_best > best, start + tl.argmax(score, axis=0), best_index)
        best = tl.maximum(best, tile_best)
    return best_index


@triton.jit
def _store_prediction(picked, x0, m, s, t, best, second, reads, V, code, row_hash, is_masked, may_edit, old, edit_tau,
                      new_ids, confidence, i):
    """Position i's token and confidence from its softmax statistics: running max m, sum s of exp(x - m), t of
    (x - m) * exp(x - m), the two best logits and the picked token x0's logit, all float32."""
    m = tl.where(reads, m, 0.0)
    log_s = tl.log(tl.where(reads, s, 1.0))
    prob = tl.exp((picked - m) - log_s)
    margin = tl.exp((best - m) - log_s) - tl.exp((second - m) - log_s)
    entropy = log_s - t / tl.exp(log_s)
    certainty = 1.0 - entropy / tl.log(V.to(tl.float64)).to(tl.float32)
    conf = tl.where(code == _PROB, prob,
                    tl.where(code == _MARGIN, margin,
                             tl.where(code == _ENTROPY, certainty, _random_confidence(row_hash))))
    edited = may_edit & (x0.to(tl.int64) != old) & (prob >= edit_tau)
    tl.store(new_ids + i, tl.where(is_masked | edited, x0.to(tl.int64), old))
    tl.store(confidence + i, tl.where(is_masked, conf, float("-inf")))


@triton.jit
def _unmask_position(logits, ids, positions, seed, step, temperature, measure, edit_threshold, editable, new_ids,
                     confidence, b, i, V, mask_id, BLOCK_V: tl.constexpr):
    """Candidate and confidence of the position at flat index i (row b): for a masked position x0 goes
    to new_ids[i], where the commit step keeps it or puts the old id back; a committed one gets its
    id after editing. The confidence goes to confidence[i]."""
    old = tl.load(ids + i)
    is_masked = old == mask_id
    edit_tau = tl.load(edit_threshold + b)
    may_edit = (tl.load(editable + i) != 0) & (edit_tau < float("inf")) & (is_masked == 0)
    reads = is_masked | may_edit
    row = logits + i.to(tl.int64) * V
    row_hash = _row_hash(tl.load(seed + b), tl.load(step + b), tl.load(positions + i))
    end = tl.where(reads, V, 0)  # a committed position that cannot be edited reads nothing

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    t = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    second = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        m, s, t = _softmax_update(m, s, t, x, 0)
        candidates = tl.where(offs == mask_id, float("-inf"), x)
        tile_best = tl.max(candidates, axis=0)
        tile_index = tl.argmax(candidates, axis=0)  # the first of equal maxima
        tile_second = tl.max(tl.where(offs == start + tile_index, float("-inf"), candidates), axis=0)
        second = tl.maximum(tl.maximum(second, tile_second), tl.minimum(best, tile_best))
        best_index = tl.where(tile_best > best, start + tile_index, best_index)
        best = tl.maximum(best, tile_best)

    temp = tl.load(temperature + b)
    x0 = best_index
    if temp > 0:
        x0 = _sample(row, V, end, mask_id, row_hash, temp, BLOCK_V)

    _store_prediction(tl.load(row + x0), x0, m, s, t, best, second, reads, V, tl.load(measure + b), row_hash,
                      is_masked, may_edit, old, edit_tau, new_ids, confidence, i)


# -- one row's commit --------------------------------------------------------------------------

@triton.jit
def _rank(confidence, row, c, offs, W, BLOCK_W: tl.constexpr):
    """Where each position of a chunk lands in the row's stable descending sort of confidences."""
    rank = tl.zeros([BLOCK_W], tl.int32)
    for start in range(0, W, BLOCK_W):
        others = start + tl.arange(0, BLOCK_W)
        c_other = tl.load(confidence + row + others, mask=others < W, other=float("-inf"))
        ahead = (c_other[None, :] > c[:, None]) | ((c_other[None, :] == c[:, None]) & (others[None, :] < offs[:, None]))
        rank += tl.sum((ahead & (others < W)[None, :]).to(tl.int32), axis=1)
    return rank


@triton.jit
def _commit_row(ids, count, threshold, factor, new_ids, confidence, commit, committed, b, W, mask_id,
                BLOCK_W: tl.constexpr):
    """Commit the k most confident masked positions of row b (x0 waits in new_ids; a committed
    position's slot already holds its id after editing)."""
    row = b.to(tl.int64) * W
    tau = tl.load(threshold + b)
    f = tl.load(factor + b)
    masked = tl.full((), 0, tl.int32)
    above = tl.full((), 0, tl.int32)
    prefix = tl.full((), 0, tl.int32) + W  # the factor prefix: the first rank the rule rejects
    for start in range(0, W, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        valid = offs < W
        c = tl.load(confidence + row + offs, mask=valid, other=float("-inf"))
        is_masked = (tl.load(ids + row + offs, mask=valid, other=0) == mask_id) & valid
        rank = _rank(confidence, row, c, offs, W, BLOCK_W)
        masked += tl.sum(is_masked.to(tl.int32), axis=0)
        above += tl.sum(((c >= tau) & valid).to(tl.int32), axis=0)
        accepted = (rank + 2).to(tl.float32) * (1.0 - c) < f
        rejected = valid & (accepted == 0)
        prefix = tl.minimum(prefix, tl.min(tl.where(rejected, rank, W), axis=0))
    wanted = tl.maximum(tl.load(count + b), tl.maximum(above, prefix).to(tl.int64))
    k = tl.minimum(masked.to(tl.int64), wanted)
    for start in range(0, W, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        valid = offs < W
        c = tl.load(confidence + row + offs, mask=valid, other=float("-inf"))
        old = tl.load(ids + row + offs, mask=valid, other=0)
        chosen = (_rank(confidence, row, c, offs, W, BLOCK_W) < k) & (old == mask_id) & valid
        x0 = tl.load(new_ids + row + offs, mask=valid, other=0)
        tl.store(new_ids + row + offs, tl.where(chosen | (old != mask_id), x0, old), mask=valid)
        tl.store(commit + row + offs, chosen, mask=valid)
    tl.store(committed + b, k)


# -- kernels -------------------------------------------------------------------------------------

@triton.jit
def position_kernel(logits, ids, positions, seed, step, temperature, measure, edit_threshold, editable, W, V, mask_id,
                    new_ids, confidence, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    _unmask_position(logits, ids, positions, seed, step, temperature, measure, edit_threshold, editable, new_ids,
                     confidence, i // W, i, V, mask_id, BLOCK_V)


@triton.jit
def commit_kernel(ids, count, threshold, factor, W, mask_id, new_ids, confidence, commit, committed,
                  BLOCK_W: tl.constexpr):
    _commit_row(ids, count, threshold, factor, new_ids, confidence, commit, committed, tl.program_id(0), W, mask_id,
                BLOCK_W)


@triton.jit
def parallel_unmask_kernel(logits, ids, positions, count, threshold, factor, temperature, seed, step, measure,
                           edit_threshold, editable, W, V, mask_id, new_ids, confidence, commit, committed,
                           BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    for w in range(0, W):
        _unmask_position(logits, ids, positions, seed, step, temperature, measure, edit_threshold, editable, new_ids,
                         confidence, b, b * W + w, V, mask_id, BLOCK_V)
    tl.debug_barrier()  # the commit reads what every thread of the program wrote
    _commit_row(ids, count, threshold, factor, new_ids, confidence, commit, committed, b, W, mask_id, BLOCK_W)


# -- launchers -----------------------------------------------------------------------------------

def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (imported under TRITON_INTERPRET=1)."""
    return not isinstance(parallel_unmask_kernel, triton.runtime.JITFunction)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)


def _check_tensor(name: str, tensor: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    _check(isinstance(tensor, Tensor), f"{name} must be a torch tensor, got {type(tensor).__name__}")
    _check(tuple(tensor.shape) == shape, f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    _check(tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}")
    _check(tensor.device == device, f"{name} is on {tensor.device}, the logits on {device}")


def _check_device(device: torch.device) -> None:
    if interpreted():
        _check(device.type == "cpu", f"Triton's interpreter runs on CPU tensors, got {device}")
    else:
        _check(device.type == "cuda", f"the Triton kernels run on CUDA tensors, got {device} "
                                      "(set TRITON_INTERPRET=1 before importing them to run on the CPU)")


def _block(size: int, limit: int, floor: int = 16) -> int:
    return max(floor, min(limit, triton.next_power_of_2(size)))


def check_inputs(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, mask_id: int,
                 measure_codes: Tensor, edits: EditParams | None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
                 ) -> EditParams:
    """Each input's shape, dtype and device, or the one KernelInputError that names it; the edits to pass
    (none: editing off)."""
    _check(isinstance(logits, Tensor) and logits.dim() == 3, "logits must be a [B, W, V] tensor")
    _check(logits.dtype in dtypes, f"logits must be {' or '.join(map(str, dtypes))}, got {logits.dtype}")
    batch, width, vocab = logits.shape
    device = logits.device
    _check(width >= 1 and vocab >= 2, f"logits [B, W, V] need W >= 1 and V >= 2, got {list(logits.shape)}")
    _check(batch * width < _INT32_LIMIT and vocab < _INT32_LIMIT,
           f"logits {list(logits.shape)}: B * W and V must be below 2**31")
    _check(0 <= mask_id < vocab, f"mask_id {mask_id} is outside the vocabulary [0, {vocab})")
    _check_tensor("ids", ids, (batch, width), torch.int64, device)
    _check_tensor("positions", positions, (batch, width), torch.int64, device)
    row_dtypes = {"count": torch.int64, "threshold": torch.float32, "factor": torch.float32,
                  "temperature": torch.float32, "seed": torch.int64, "step": torch.int64}
    for name, dtype in row_dtypes.items():
        _check_tensor(name, getattr(params, name), (batch,), dtype, device)
    _check_tensor("measure_codes", measure_codes, (batch,), torch.int64, device)
    if edits is None:
        edits = EditParams(torch.full((batch,), float("inf"), device=device),
                           torch.zeros(batch, width, dtype=torch.bool, device=device))
    _check_tensor("edit threshold", edits.threshold, (batch,), torch.float32, device)
    _check_tensor("editable", edits.editable, (batch, width), torch.bool, device)
    _check_device(device)
    return edits


def parallel_unmask(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, mask_id: int,
                    measure_codes: Tensor, *, edits: EditParams | None = None, fused: bool = False,
                    block_v: int | None = None, block_w: int | None = None) -> UnmaskResult:
    """One `dlmrt::ParallelUnmask` step (reference.parallel_unmask): logits [B, W, V] float32, ids and
    positions [B, W] int64, params [B] each, measure_codes [B] int64 (MEASURE_CODES), `edits` as the
    reference's (None: no editing). `fused` runs the single kernel TensorRT's plugin runs; `block_v` /
    `block_w` override the tile sizes."""
    edits = check_inputs(logits, ids, positions, params, mask_id, measure_codes, edits)
    batch, width, vocab = logits.shape
    device = logits.device
    logits, ids, positions, measure_codes = (t.contiguous() for t in (logits, ids, positions, measure_codes))
    count, threshold, factor, temperature, seed, step = (t.contiguous() for t in params)
    edit_threshold, editable = (t.contiguous() for t in edits)
    new_ids = torch.empty_like(ids)
    confidence = torch.empty(ids.shape, dtype=torch.float32, device=device)
    commit = torch.empty(ids.shape, dtype=torch.bool, device=device)
    committed = torch.empty_like(count)
    if batch:
        name = "parallel_unmask_kernel" if fused else "position_kernel"
        config = CONFIGS[name]
        bv = block_v or _block(vocab, config.constexprs["BLOCK_V"])
        bw = block_w or _block(width, CONFIGS["commit_kernel"].constexprs["BLOCK_W"])
        if fused:
            parallel_unmask_kernel[(batch,)](
                logits, ids, positions, count, threshold, factor, temperature, seed, step, measure_codes,
                edit_threshold, editable, width, vocab, mask_id, new_ids, confidence, commit, committed, BLOCK_V=bv,
                BLOCK_W=bw, num_warps=config.num_warps, enable_fp_fusion=False)
        else:
            position_kernel[(batch * width,)](
                logits, ids, positions, seed, step, temperature, measure_codes, edit_threshold, editable, width, vocab,
                mask_id, new_ids, confidence, BLOCK_V=bv, num_warps=config.num_warps, enable_fp_fusion=False)
            commit_kernel[(batch,)](
                ids, count, threshold, factor, width, mask_id, new_ids, confidence, commit, committed, BLOCK_W=bw,
                num_warps=CONFIGS["commit_kernel"].num_warps, enable_fp_fusion=False)
    return UnmaskResult(new_ids, confidence, commit, committed)


__all__ = ["CONFIGS", "LaunchConfig", "check_inputs", "commit_kernel", "interpreted", "parallel_unmask",
           "parallel_unmask_kernel", "position_kernel"]
