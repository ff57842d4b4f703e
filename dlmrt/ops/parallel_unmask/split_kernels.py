"""`dlmrt::ParallelUnmask` with the vocabulary split across programs: the form for one GPU's large
vocabularies, where `triton_kernels.position_kernel` gives a whole 126k row to one program (32 programs
for a block of 32 at batch 1, a fraction of the GPU's SMs, each reading its row serially).

- `split_kernel`, one program per (position, vocabulary split): the online softmax, argmax, top two
  and (temperature > 0) the float64 Gumbel-max over its slice, into a small workspace;
- `merge_kernel`, one program per position: the splits merged in vocabulary order (the first maximum
  wins, as in the reference), then the confidence, x0 and the edit, as the position kernel writes them;
- then `triton_kernels.commit_kernel`, unchanged.

It reads bfloat16, float16 or float32 logits and accumulates in float32, so a bf16 model's block needs
no float32 copy. Not yet measured on a GPU: `unmask="auto"` does not pick it (`choice.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.ops.parallel_unmask import triton_kernels as tk
from dlmrt.ops.parallel_unmask.reference import EditParams, UnmaskParams, UnmaskResult
from dlmrt.ops.parallel_unmask.triton_kernels import (LaunchConfig, _row_hash, _softmax_update, _store_prediction,
                                                          _uniform, tl, triton)

CONFIGS = {
    "split_kernel": LaunchConfig({"BLOCK_V": 1024}, num_warps=4),
    "merge_kernel": LaunchConfig({"BLOCK_S": 64}, num_warps=1),
}
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPLIT_V = 8192  # vocabulary entries per program, at most: 16 splits of a 126,464 row


@triton.jit
def split_kernel(logits, ids, positions, seed, step, temperature, edit_threshold, editable, W, V, S, span, mask_id,
                 stats, index, sampled, BLOCK_V: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    b = i // W
    old = tl.load(ids + i)
    is_masked = old == mask_id
    may_edit = (tl.load(editable + i) != 0) & (tl.load(edit_threshold + b) < float("inf")) & (is_masked == 0)
    begin = j * span
    end = tl.where(is_masked | may_edit, tl.minimum(begin + span, V), begin)  # nothing to read: no work
    row = logits + i.to(tl.int64) * V
    temp = tl.load(temperature + b)
    row_hash = _row_hash(tl.load(seed + b), tl.load(step + b), tl.load(positions + i))
    t64 = temp.to(tl.float64)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    t = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    second = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32) + begin
    score_best = tl.full((), -1.0, tl.float64)
    score_index = tl.full((), 0, tl.int32) + begin
    for start in range(begin, end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inside = offs < end
        x = tl.load(row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        m, s, t = _softmax_update(m, s, t, x, 0)
        candidates = tl.where(offs == mask_id, float("-inf"), x)
        tile_best = tl.max(candidates, axis=0)
        tile_index = tl.argmax(candidates, axis=0)
        tile_second = tl.max(tl.where(offs == start + tile_index, float("-inf"), candidates), axis=0)
        second = tl.maximum(tl.maximum(second, tile_second), tl.minimum(best, tile_best))
        best_index = tl.where(tile_best > best, start + tile_index, best_index)
        best = tl.maximum(best, tile_best)
        if temp > 0:  # LLaDA's Gumbel-max in float64, as triton_kernels._sample
            noise = tl.exp(t64 * tl.log(-tl.log(_uniform(row_hash, offs))))
            score = tl.where(inside, tl.exp(candidates.to(tl.float64)) / noise, -1.0)
            tile_score = tl.max(score, axis=0)
            score_index = tl.where(tile_score > score_best, start + tl.argmax(score, axis=0), score_index)
            score_best = tl.maximum(score_best, tile_score)
    at = i.to(tl.int64) * S + j
    plane = tl.num_programs(0).to(tl.int64) * S  # stats is [5, B * W, S], index [2, B * W, S]
    tl.store(stats + at, m)
    tl.store(stats + plane + at, s)
    tl.store(stats + 2 * plane + at, t)
    tl.store(stats + 3 * plane + at, best)
    tl.store(stats + 4 * plane + at, second)
    tl.store(index + at, best_index)
    tl.store(index + plane + at, score_index)
    tl.store(sampled + at, score_best)


@triton.jit
def merge_kernel(logits, ids, positions, seed, step, temperature, measure, edit_threshold, editable, W, V, S, mask_id,
                 stats, index, sampled, new_ids, confidence, BLOCK_S: tl.constexpr):
    """The splits of position i merged: m and s as one online-softmax step over the splits' maxima, t
    shifted to the common maximum, the first split holding the best (so the first index overall)."""
    i = tl.program_id(0)
    b = i // W
    old = tl.load(ids + i)
    is_masked = old == mask_id
    edit_tau = tl.load(edit_threshold + b)
    may_edit = (tl.load(editable + i) != 0) & (edit_tau < float("inf")) & (is_masked == 0)
    reads = is_masked | may_edit
    plane = tl.num_programs(0).to(tl.int64) * S
    splits = tl.arange(0, BLOCK_S)
    valid = splits < S
    at = i.to(tl.int64) * S + splits
    m_j = tl.load(stats + at, mask=valid, other=float("-inf"))
    s_j = tl.load(stats + plane + at, mask=valid, other=0.0)
    t_j = tl.load(stats + 2 * plane + at, mask=valid, other=0.0)
    best_j = tl.load(stats + 3 * plane + at, mask=valid, other=float("-inf"))
    second_j = tl.load(stats + 4 * plane + at, mask=valid, other=float("-inf"))
    m = tl.max(m_j, axis=0)
    shift = tl.where(m > float("-inf"), m, 0.0)
    gap = tl.where(s_j > 0, m_j - shift, 0.0)
    rescale = tl.where(s_j > 0, tl.exp(gap), 0.0)
    s = tl.sum(rescale * s_j, axis=0)
    t = tl.sum(rescale * (t_j + s_j * gap), axis=0)
    best = tl.max(best_j, axis=0)
    first = tl.argmax(best_j, axis=0)  # the first split with the maximum: the smallest index
    x0 = tl.load(index + i.to(tl.int64) * S + first)
    second = tl.maximum(tl.max(second_j, axis=0), tl.max(tl.where(splits == first, float("-inf"), best_j), axis=0))
    row_hash = _row_hash(tl.load(seed + b), tl.load(step + b), tl.load(positions + i))
    if tl.load(temperature + b) > 0:
        scores = tl.load(sampled + at, mask=valid, other=-2.0)
        x0 = tl.load(index + plane + i.to(tl.int64) * S + tl.argmax(scores, axis=0))

    picked = tl.load(logits + i.to(tl.int64) * V + x0).to(tl.float32)
    _store_prediction(picked, x0, m, s, t, best, second, reads, V, tl.load(measure + b), row_hash,
                      is_masked, may_edit, old, edit_tau, new_ids, confidence, i)


def splits_for(vocab: int, block_v: int, split_v: int = SPLIT_V) -> tuple[int, int]:
    """(S, span): the vocabulary in S slices of `span` entries, a multiple of the tile, at most `split_v`
    (rounded up to a tile) and at most CONFIGS' BLOCK_S slices."""
    tiles = triton.cdiv(vocab, block_v)
    per_split = max(1, triton.cdiv(split_v, block_v), triton.cdiv(tiles, CONFIGS["merge_kernel"].constexprs["BLOCK_S"]))
    return triton.cdiv(tiles, per_split), per_split * block_v


def parallel_unmask(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, mask_id: int,
                    measure_codes: Tensor, *, edits: EditParams | None = None, block_v: int | None = None,
                    split_v: int = SPLIT_V) -> UnmaskResult:
    """`triton_kernels.parallel_unmask` (the same checks and results) with the vocabulary split across
    programs, on float32, bfloat16 or float16 logits."""
    edits = tk.check_inputs(logits, ids, positions, params, mask_id, measure_codes, edits, LOGIT_DTYPES)
    batch, width, vocab = logits.shape
    device = logits.device
    logits, ids, positions, measure_codes = (t.contiguous() for t in (logits, ids, positions, measure_codes))
    count, threshold, factor, temperature, seed, step = (t.contiguous() for t in params)
    edit_threshold, editable = (t.contiguous() for t in edits)
    bv = block_v or tk._block(vocab, CONFIGS["split_kernel"].constexprs["BLOCK_V"])
    splits, span = splits_for(vocab, bv, split_v)
    rows = batch * width
    stats = torch.empty(5, rows, splits, dtype=torch.float32, device=device)
    index = torch.empty(2, rows, splits, dtype=torch.int32, device=device)
    sampled = torch.empty(rows, splits, dtype=torch.float64, device=device)
    new_ids = torch.empty_like(ids)
    confidence = torch.empty(ids.shape, dtype=torch.float32, device=device)
    commit = torch.empty(ids.shape, dtype=torch.bool, device=device)
    committed = torch.empty_like(count)
    if not batch:
        return UnmaskResult(new_ids, confidence, commit, committed)
    split_kernel[(rows, splits)](
        logits, ids, positions, seed, step, temperature, edit_threshold, editable, width, vocab, splits, span, mask_id,
        stats, index, sampled, BLOCK_V=bv, num_warps=CONFIGS["split_kernel"].num_warps, enable_fp_fusion=False)
    merge_kernel[(rows,)](
        logits, ids, positions, seed, step, temperature, measure_codes, edit_threshold, editable, width, vocab, splits,
        mask_id, stats, index, sampled, new_ids, confidence, BLOCK_S=CONFIGS["merge_kernel"].constexprs["BLOCK_S"],
        num_warps=CONFIGS["merge_kernel"].num_warps, enable_fp_fusion=False)
    bw = tk._block(width, tk.CONFIGS["commit_kernel"].constexprs["BLOCK_W"])
    tk.commit_kernel[(batch,)](
        ids, count, threshold, factor, width, mask_id, new_ids, confidence, commit, committed, BLOCK_W=bw,
        num_warps=tk.CONFIGS["commit_kernel"].num_warps, enable_fp_fusion=False)
    return UnmaskResult(new_ids, confidence, commit, committed)


__all__ = ["CONFIGS", "merge_kernel", "parallel_unmask", "split_kernel", "splits_for"]
