"""`dlmrt::EntropyBoundStep` as Triton kernels (the semantics are `reference.py`; the tests hold them to it).

Kernels:

- `entropy_position_kernel`, one program per position, two passes over the vocabulary in tiles of BLOCK_V:
  the first divides the logits by the row's temperature (IEEE float32 division, `div_rn`, as torch
  divides), writes the scaled logits, keeps their first argmax and an online softmax (running max m
  and s = sum exp(z - m)); the second recomputes z and sums p log p with log p = (z - m) - log s,
  as torch's log_softmax writes it (0 log 0 = 0), and takes the float64 Gumbel-max sample
  argmax_v z_v - log(-log u_v) with dlmrt's counter-based hash over v. It writes the argmax, the
  entropy (into a scratch row) and the sample (into the next canvas, where `entropy_accept_kernel` decides).
- `entropy_accept_kernel`, one program per row (W <= BLOCK_W, one tile): the positions taken in ascending
  (entropy, position) order, a selection over the row's W entropies (the smallest remaining
  entropy, among equal ones the earliest position: the order of a stable sort; -0.0 and 0.0 are
  equal, as for torch.sort), each accepted while the float64 sum of the entropies taken before it,
  accumulated in that order as the reference's CPU cumsum does, is <= the bound (float64 of the
  float32 bound). So the sums are the reference's to the bit. Then the next canvas (sample where
  accepted, else the uniform refill floor(u V) with u at (seed, step + 1, position,
  RANDOM_TOKEN_SALT)), `finished` rows keeping their canvas and accepting nothing, and the mean
  entropy (a float64 sum divided by W, rounded to float32).
- `entropy_bound_kernel`: both in one launch, one program per row, the row's entropies and samples
  kept in registers (no scratch memory), for a TensorRT AOT plugin that launches one kernel; its
  arguments are ordered as such a plugin passes them (the node's inputs, the extra scalars, the
  outputs).

The hash is parallel_unmask's in-kernel one (`_row_hash`, `_uniform`, `_mix32`), imported. Tile sizes
are compile-time constants and the loops run over the actual W and V, so one compiled kernel serves
any V and any W <= BLOCK_W. `entropy_bound_step` launches the kernels on CUDA tensors, or on CPU
tensors when this module was imported under TRITON_INTERPRET=1.

Agreement with the reference (tests/ops/test_entropy_bound_triton.py): scaled logits, argmax and
samples to the bit; entropies to float32 rounding (a different summation order over V, and the GPU's
exp/log); the acceptance is the reference's exactly for the entropies the kernel computed, so it
can only differ where two entropies lie within float32 rounding of each other or a sum within that
of the bound.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.ops.entropy_bound.reference import RANDOM_TOKEN_SALT, RenoiseParams, RenoiseResult
# Triton (and the MissingExtraError naming the extra without it), the hash and the checks, shared.
from dlmrt.ops.parallel_unmask.triton_kernels import (_INT32_LIMIT, LaunchConfig, _block, _check, _check_device,
                                                          _check_tensor, _mix32, _row_hash, _uniform, tl, triton)

_TOKEN_SALT = tl.constexpr(RANDOM_TOKEN_SALT)
MAX_W = 1024  # the widest row the launcher takes (BLOCK_W is W rounded up to a power of two)

CONFIGS = {
    "entropy_position_kernel": LaunchConfig({"BLOCK_V": 1024}, num_warps=4),
    "entropy_accept_kernel": LaunchConfig({"BLOCK_W": 256}, num_warps=4),
    "entropy_bound_kernel": LaunchConfig({"BLOCK_V": 2048, "BLOCK_W": 256}, num_warps=8),
}

_ENTROPY_BOUND = {
    "logits": "*fp32", "canvas": "*i64", "positions": "*i64", "temperature": "*fp32", "entropy_bound": "*fp32",
    "seed": "*i64", "step": "*i64", "finished": "*i1", "W": "i32", "V": "i32",
    "next_canvas": "*i64", "argmax": "*i64", "scaled_logits": "*fp32", "accepted": "*i1", "mean_entropy": "*fp32",
}
# The non-constexpr arguments of each kernel, in order, with Triton's type names (for AOT compilation).
SIGNATURES = {
    "entropy_bound_kernel": _ENTROPY_BOUND,
    "entropy_position_kernel": {**{name: _ENTROPY_BOUND[name] for name in (
        "logits", "positions", "temperature", "seed", "step", "W", "V", "next_canvas", "argmax", "scaled_logits")},
        "token_entropy": "*fp32"},
    "entropy_accept_kernel": {**{name: _ENTROPY_BOUND[name] for name in (
        "canvas", "positions", "entropy_bound", "seed", "step", "finished", "W", "V", "next_canvas", "accepted",
        "mean_entropy")}, "token_entropy": "*fp32"},
}


# -- one position ----------------------------------------------------------------------------------

@triton.jit
def _step_position(logits, positions, temperature, seed, step, argmax, scaled_logits, b, i, V,
                   BLOCK_V: tl.constexpr):
    """Scaled logits and argmax of the position at flat index i (row b), stored; returns its entropy
    (float32) and its Gumbel-max sample (int64)."""
    row = logits + i.to(tl.int64) * V
    out = scaled_logits + i.to(tl.int64) * V
    temp = tl.load(temperature + b)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.math.div_rn(tl.load(row + offs, mask=offs < V, other=float("-inf")), temp)
        tl.store(out + offs, z, mask=offs < V)
        tile_best = tl.max(z, axis=0)
        best_index = tl.where(tile_best > best, start + tl.argmax(z, axis=0), best_index)  # the first maximum
        best = tl.maximum(best, tile_best)
        m_new = tl.maximum(m, tile_best)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.where(s > 0, tl.exp(m - shift), 0.0) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
    tl.store(argmax + i, best_index.to(tl.int64))

    log_s = tl.log(s)
    row_hash = _row_hash(tl.load(seed + b), tl.load(step + b), tl.load(positions + i))
    plogp = tl.full((), 0.0, tl.float32)
    gumbel = tl.full((), float("-inf"), tl.float64)
    sample = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.math.div_rn(tl.load(row + offs, mask=offs < V, other=float("-inf")), temp)
        logp = (z - m) - log_s
        p = tl.exp(logp)
        plogp += tl.sum(p * tl.where(p > 0, logp, 0.0), axis=0)  # 0 log 0 = 0
        score = tl.where(offs < V, z.to(tl.float64) - tl.log(-tl.log(_uniform(row_hash, offs))), float("-inf"))
        tile_best = tl.max(score, axis=0)
        sample = tl.where(tile_best > gumbel, start + tl.argmax(score, axis=0), sample)
        gumbel = tl.maximum(gumbel, tile_best)
    return -plogp, sample.to(tl.int64)


# -- one row's acceptance --------------------------------------------------------------------------

@triton.jit
def _refill(seed, step, position, V):
    """reference.random_tokens at (seed, step, position): floor(u V) in float64, at most V - 1."""
    h = _mix32(_row_hash(seed, step, position) ^ _TOKEN_SALT)
    u = (h.to(tl.float64) + 0.5) / 4294967296.0
    return tl.minimum(tl.floor(u * V.to(tl.float64)).to(tl.int64), V.to(tl.int64) - 1)


@triton.jit
def _accept_row(token_entropy, sample, canvas, positions, entropy_bound, seed, step, finished, next_canvas, accepted,
                mean_entropy, b, W, V, BLOCK_W: tl.constexpr):
    """Row b from its entropies and samples `[BLOCK_W]` (lanes from W on unused): accepted, the next
    canvas and the mean entropy, stored."""
    offs = tl.arange(0, BLOCK_W)
    valid = offs < W
    base = b.to(tl.int64) * W
    bound = tl.load(entropy_bound + b).to(tl.float64)
    remaining = valid
    take = offs < 0
    total = tl.full((), 0.0, tl.float64)  # the float64 sum of the entropies taken so far, in order
    for k in range(0, W):  # noqa: B007 (the k-th smallest)
        h = tl.min(tl.where(remaining, token_entropy, float("inf")), axis=0)
        first = tl.min(tl.where(remaining & (token_entropy == h), offs, BLOCK_W), axis=0)
        take = tl.where(offs == first, total <= bound, take)
        total += h.to(tl.float64)
        remaining = remaining & (offs != first)

    seed_b = tl.load(seed + b)
    step_b = tl.load(step + b)
    done = tl.load(finished + b) != 0
    position = tl.load(positions + base + offs, mask=valid, other=0)
    fresh = tl.where(take, sample, _refill(seed_b, step_b + 1, position, V))
    old = tl.load(canvas + base + offs, mask=valid, other=0)
    tl.store(next_canvas + base + offs, tl.where(done, old, fresh), mask=valid)
    tl.store(accepted + base + offs, take & (done == 0), mask=valid)
    mean = tl.sum(tl.where(valid, token_entropy, 0.0).to(tl.float64), axis=0) / W.to(tl.float64)
    tl.store(mean_entropy + b, mean.to(tl.float32))


# -- kernels -------------------------------------------------------------------------------------

@triton.jit
def entropy_position_kernel(logits, positions, temperature, seed, step, W, V, next_canvas, argmax, scaled_logits,
                            token_entropy, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    h, sample = _step_position(logits, positions, temperature, seed, step, argmax, scaled_logits, i // W, i, V,
                               BLOCK_V)
    tl.store(token_entropy + i, h)
    tl.store(next_canvas + i, sample)  # a candidate: entropy_accept_kernel keeps it or puts the refill there


@triton.jit
def entropy_accept_kernel(canvas, positions, entropy_bound, seed, step, finished, W, V, next_canvas, accepted,
                          mean_entropy, token_entropy, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_W)
    row = b.to(tl.int64) * W + offs
    h = tl.load(token_entropy + row, mask=offs < W, other=0.0)
    sample = tl.load(next_canvas + row, mask=offs < W, other=0)
    _accept_row(h, sample, canvas, positions, entropy_bound, seed, step, finished, next_canvas, accepted,
                mean_entropy, b, W, V, BLOCK_W)


@triton.jit
def entropy_bound_kernel(logits, canvas, positions, temperature, entropy_bound, seed, step, finished, W, V,
                         next_canvas, argmax, scaled_logits, accepted, mean_entropy, BLOCK_V: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_W)
    token_entropy = tl.zeros([BLOCK_W], tl.float32)
    samples = tl.zeros([BLOCK_W], tl.int64)
    for w in range(0, W):
        h, sample = _step_position(logits, positions, temperature, seed, step, argmax, scaled_logits, b, b * W + w, V,
                                   BLOCK_V)
        token_entropy = tl.where(offs == w, h, token_entropy)
        samples = tl.where(offs == w, sample, samples)
    _accept_row(token_entropy, samples, canvas, positions, entropy_bound, seed, step, finished, next_canvas, accepted,
                mean_entropy, b, W, V, BLOCK_W)


# -- launcher ------------------------------------------------------------------------------------

def entropy_bound_step(logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams, *,
                       finished: Tensor | None = None, fused: bool = False, block_v: int | None = None,
                       block_w: int | None = None, token_entropy: Tensor | None = None) -> RenoiseResult:
    """One `dlmrt::EntropyBoundStep` (reference.entropy_bound_step): logits [B, W, V] float32, canvas and
    positions [B, W] int64, params [B] each (temperature and entropy_bound float32, seed and step int64),
    `finished` [B] bool (None: no row has stopped). `fused` runs the single kernel a TensorRT plugin
    would run; `block_v` / `block_w` override the tile sizes (block_w must be a power of two >= W).
    `token_entropy`, a [B, W] float32 tensor, receives each position's entropy (the two-kernel form's
    scratch row; not with `fused`)."""
    _check(isinstance(logits, Tensor) and logits.dim() == 3, "logits must be a [B, W, V] tensor")
    _check(logits.dtype == torch.float32, f"logits must be torch.float32, got {logits.dtype}")
    batch, width, vocab = logits.shape
    device = logits.device
    _check(1 <= width <= MAX_W and vocab >= 1, f"logits [B, W, V] need 1 <= W <= {MAX_W} and V >= 1, "
                                               f"got {list(logits.shape)}")
    _check(batch * width < _INT32_LIMIT and vocab < _INT32_LIMIT,
           f"logits {list(logits.shape)}: B * W and V must be below 2**31")
    _check_tensor("canvas", canvas, (batch, width), torch.int64, device)
    _check_tensor("positions", positions, (batch, width), torch.int64, device)
    row_dtypes = {"temperature": torch.float32, "entropy_bound": torch.float32, "seed": torch.int64,
                  "step": torch.int64}
    for name, dtype in row_dtypes.items():
        _check_tensor(name, getattr(params, name), (batch,), dtype, device)
    if finished is None:
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
    _check_tensor("finished", finished, (batch,), torch.bool, device)
    bw = block_w or _block(width, MAX_W)
    _check(bw >= width and bw & (bw - 1) == 0, f"block_w {bw} must be a power of two >= W = {width}")
    if token_entropy is not None:
        _check(not fused, "the fused kernel keeps the entropies in registers: token_entropy needs fused=False")
        _check_tensor("token_entropy", token_entropy, (batch, width), torch.float32, device)
        _check(token_entropy.is_contiguous(), "token_entropy must be contiguous")
    _check_device(device)

    logits, canvas, positions, finished = (t.contiguous() for t in (logits, canvas, positions, finished))
    temperature, entropy_bound, seed, step = (t.contiguous() for t in params)
    next_canvas = torch.empty_like(canvas)
    argmax = torch.empty_like(canvas)
    scaled = torch.empty_like(logits)
    accepted = torch.empty(canvas.shape, dtype=torch.bool, device=device)
    mean_entropy = torch.empty(batch, dtype=torch.float32, device=device)
    if batch:
        if fused:
            config = CONFIGS["entropy_bound_kernel"]
            bv = block_v or _block(vocab, config.constexprs["BLOCK_V"])
            entropy_bound_kernel[(batch,)](
                logits, canvas, positions, temperature, entropy_bound, seed, step, finished, width, vocab,
                next_canvas, argmax, scaled, accepted, mean_entropy, BLOCK_V=bv, BLOCK_W=bw,
                num_warps=config.num_warps, enable_fp_fusion=False)
        else:
            config = CONFIGS["entropy_position_kernel"]
            bv = block_v or _block(vocab, config.constexprs["BLOCK_V"])
            if token_entropy is None:
                token_entropy = torch.empty(canvas.shape, dtype=torch.float32, device=device)
            entropy_position_kernel[(batch * width,)](
                logits, positions, temperature, seed, step, width, vocab, next_canvas, argmax, scaled,
                token_entropy, BLOCK_V=bv, num_warps=config.num_warps, enable_fp_fusion=False)
            entropy_accept_kernel[(batch,)](
                canvas, positions, entropy_bound, seed, step, finished, width, vocab, next_canvas, accepted,
                mean_entropy, token_entropy, BLOCK_W=bw, num_warps=CONFIGS["entropy_accept_kernel"].num_warps,
                enable_fp_fusion=False)
    return RenoiseResult(next_canvas, argmax, scaled, accepted, mean_entropy)


__all__ = ["CONFIGS", "MAX_W", "SIGNATURES", "entropy_accept_kernel", "entropy_bound_kernel", "entropy_bound_step",
           "entropy_position_kernel"]
