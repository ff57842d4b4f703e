"""`dlmrt::ResidualContext` as a Triton kernel (the semantics are `reference.py`; the tests hold it to it).

`residual_kernel` takes the logits as N = B * T rows of V and E [V, H]. Its grid is 2-D: program
(i, j) handles BLOCK_N rows and BLOCK_H columns of E. A first pass over the vocabulary in tiles of
BLOCK_V keeps an online softmax per row (running max, sum of exponentials, and the sum that gives
the entropy); a second accumulates p @ E for the program's columns. The programs of column block 0
also write the certainty clamp(1 - H(p) / log V, 0, 1). Loads are converted to float32 and stores
to the output's type, so one kernel serves float32, float16 and bfloat16 tensors; the arguments are
ordered as TensorRT's AOT plugin passes them (the node's inputs, the extra scalars, the outputs).

`residual_context` launches it on CUDA tensors, or on CPU tensors when this module was imported under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Triton through the shared module, which raises the MissingExtraError naming the extra without it.
from dlmrt.ops.parallel_unmask.triton_kernels import (_INT32_LIMIT, LaunchConfig, _check, _check_device,
                                                          _softmax_update, tl, triton)

CONFIGS = {"residual_kernel": LaunchConfig({"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_H": 64}, num_warps=4)}


@triton.jit
def residual_kernel(logits, embedding, N, V, H, z, certainty, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """z and certainty of BLOCK_N rows of logits [N, V], for BLOCK_H columns of E [V, H]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < N
    base = logits + rows.to(tl.int64)[:, None] * V
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs[None, :], mask=row_ok[:, None] & (offs < V)[None, :], other=float("-inf"))
        m, s, t = _softmax_update(m, s, t, x.to(tl.float32), 1)
    m = tl.where(s > 0, m, 0.0)
    s = tl.where(s > 0, s, 1.0)

    acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs[None, :], mask=row_ok[:, None] & (offs < V)[None, :], other=float("-inf"))
        p = tl.exp(x.to(tl.float32) - m[:, None]) / s[:, None]
        e = tl.load(embedding + offs.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=(offs < V)[:, None] & (cols < H)[None, :], other=0.0)
        acc += tl.dot(p, e.to(tl.float32), input_precision="ieee")
    tl.store(z + rows.to(tl.int64)[:, None] * H + cols[None, :], acc.to(z.dtype.element_ty),
             mask=row_ok[:, None] & (cols < H)[None, :])
    if tl.program_id(1) == 0:
        entropy = tl.log(s) - t / s
        value = tl.minimum(tl.maximum(1.0 - entropy / tl.log(V.to(tl.float64)).to(tl.float32), 0.0), 1.0)
        tl.store(certainty + rows, value.to(certainty.dtype.element_ty), mask=row_ok)


def grid(rows: int, hidden: int) -> tuple[int, int]:
    """The launch grid for N = B * T rows and H columns (TensorRT's plugin computes the same)."""
    blocks = CONFIGS["residual_kernel"].constexprs
    return triton.cdiv(rows, blocks["BLOCK_N"]), triton.cdiv(hidden, blocks["BLOCK_H"])


def _check_inputs(logits: Tensor, embedding: Tensor) -> None:
    _check(isinstance(logits, Tensor) and logits.dim() == 3, "logits must be a [B, T, V] tensor")
    _check(isinstance(embedding, Tensor) and embedding.dim() == 2, "embedding must be a [V, H] tensor")
    _check(logits.is_floating_point() and embedding.is_floating_point(),
           f"logits and embedding must be floating point, got {logits.dtype} and {embedding.dtype}")
    batch, length, vocab = logits.shape
    _check(embedding.shape[0] == vocab, f"embedding has {embedding.shape[0]} rows, the logits {vocab} tokens")
    _check(embedding.device == logits.device, f"embedding is on {embedding.device}, the logits on {logits.device}")
    _check(vocab >= 2 and max(batch * length, vocab, embedding.shape[1]) < _INT32_LIMIT,
           f"logits {list(logits.shape)} and embedding {list(embedding.shape)}: need V >= 2, and B * T, V and H "
           "below 2**31")
    _check_device(logits.device)


def residual_context(logits: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
    """(z [B, T, H], certainty [B, T]) in the embedding's dtype, as reference.residual_context: logits
    [B, T, V] and E [V, H], floating point."""
    _check_inputs(logits, embedding)
    batch, length, vocab = logits.shape
    hidden = embedding.shape[1]
    logits, embedding = logits.contiguous(), embedding.contiguous()
    z = torch.empty(batch, length, hidden, dtype=embedding.dtype, device=logits.device)
    certainty = torch.empty(batch, length, dtype=embedding.dtype, device=logits.device)
    if batch * length and hidden:
        config = CONFIGS["residual_kernel"]
        residual_kernel[grid(batch * length, hidden)](logits, embedding, batch * length, vocab, hidden, z, certainty,
                                                      **config.constexprs, num_warps=config.num_warps,
                                                      enable_fp_fusion=False)
    return z, certainty


__all__ = ["CONFIGS", "grid", "residual_context", "residual_kernel"]
