"""The step graph as a torch module: the denoiser forward over a window, fused with
`dlmrt::ParallelUnmask` on the block inside it (docs/architecture.md, "Step graph").

Two graphs cover every cache mode:

- `full`: no cached prefix. The whole canvas (cache none, and the refresh forward of the
  bidirectional caches), or for block-causal models everything up to the block's end;
- `cached`: a window over a cached prefix (prefix and dual caches, the exact block cache).

Both return the window's K/V, so either can write the cache. The block is given as window indices
(`block_index`), so one graph serves every block position and block length.

The same module is the step of every torch path (eager, compiled, captured into a CUDA graph;
`dlmrt.runtime.device_step` runs it over a bucket's static buffers). Outside export, the unmasking is
the op's torch reference rather than the opaque custom op, so that torch.compile sees through it, and
three static options drop work a step does not need: `return_kv=False` (a step that writes no cache;
its `kv` output is None), `sampling=False` (every temperature is 0: no noise is drawn, and no host
read asks), `confidence` (every row uses this measure, so the others are not computed) and
`editing=False` (no row edits committed tokens, so the edit pass is skipped). Exports always return
the K/V and take every temperature, measure and editing threshold as inputs.

With bfloat16 or float16 logits the torch unmasking upcasts the block a few positions at a time
(`parallel_unmask.chunked`: the same values as the whole block upcast, without its float32 copy), except
where the graph needs the whole block in float32 anyway: guidance, `return_logits`, export, Triton.

`return_logits=True` also returns the block's float32 logits (after guidance), from which the step loop
takes each committed token's log-probability when some row asks (docs/logprobs.md). Exports always
name them as their last output, `logits`; a binding that does not ask leaves that output unbound, so
ONNX Runtime frees them as it did before. On a tensor-parallel rank, which holds a slice of the
vocabulary, it returns instead the logprobs of the step's own ids, computed over the whole vocabulary
(`VocabShard.token_logprobs`): their log-probabilities, and the recorded alternatives' log-probabilities
and ids.

Token editing (LLaDA2.1) may overwrite the block's committed positions that are neither prompt nor
padding: the graph derives them from the window's key mask, positions and each row's prompt length.

`unmask="triton"` runs the op's Triton kernels instead of its torch reference (same semantics; CUDA
tensors, or CPU tensors under TRITON_INTERPRET=1), `unmask="triton-split"` its vocabulary-split kernels
(`split_kernels`, which read bf16 logits as they are); `unmask="auto"` picks as
`dlmrt.ops.parallel_unmask.choice` says (the torch backend passes its mode there first).

With classifier-free guidance (`full_guided`, `cached_guided`) the graph also takes each row's
prompt length and the scale, runs the prompt-masked copy of every row beside it (the model's K/V,
`z` and their outputs have 2B rows: the unconditional rows follow the conditional ones), and mixes
`uncond + (scale + 1) * (cond - uncond)` before unmasking.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dlmrt.core import limits
from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.models.denoiser import PastKV
from dlmrt.models.residual import Residual
from dlmrt.ops.parallel_unmask import EditParams, UnmaskParams, choice, chunked, parallel_unmask
from dlmrt.ops.parallel_unmask import torch_op  # noqa: F401  (registers torch.ops.dlmrt.parallel_unmask)

GRAPHS = ("full", "cached")
GUIDED_GRAPHS = ("full_guided", "cached_guided")
POLICY_INPUTS = ("count", "threshold", "factor", "temperature", "seed", "step", "measure")
# The inputs of token editing (ParallelUnmask v2); exports made before it lack them.
EDITING_INPUTS = ("edit_threshold", "prompt_lengths")
# The block's logits [B, block, V], the last output; exports made before it lack it.
LOGITS_OUTPUT = "logits"


def graph_name(cached: bool, guided: bool) -> str:
    return ("cached" if cached else "full") + ("_guided" if guided else "")


def input_names(graph: str, residual: bool) -> list[str]:
    names = ["ids", "positions", "key_mask", "block_index", *POLICY_INPUTS, *EDITING_INPUTS]
    if graph.startswith("cached"):
        names += ["past_kv", "past_positions", "past_key_mask"]
    if residual:
        names += ["z", "certainty"]
    if graph.endswith("_guided"):
        names += ["cfg_scale"]
    return names


def output_names(residual: bool) -> list[str]:
    return ["new_ids", "confidence", "commit", "committed", "kv", *(["next_z", "next_certainty"] if residual else []),
            LOGITS_OUTPUT]


class StepGraph(nn.Module):
    def __init__(self, model: Denoiser, graph: str, grid: int | None, *, return_kv: bool = True,
                 sampling: bool | None = None, confidence: str | None = None, editing: bool = True,
                 unmask: str = "torch", return_logits: bool = False):
        super().__init__()
        self.model, self.grid = model, grid
        self.cached, self.guided = graph.startswith("cached"), graph.endswith("_guided")
        self.residual = model.residual_config is not None
        self.return_kv, self.sampling, self.confidence, self.editing = return_kv, sampling, confidence, editing
        self.return_logits = return_logits
        sharded = model.vocab_shard is not None
        if sharded and unmask.startswith("triton"):
            raise ArgumentError("a tensor-parallel step holds a vocabulary slice of the logits: it unmasks with its "
                                "own torch code (unmask='torch')")
        self.triton_kernels = None  # a module whose `parallel_unmask` launches the op's Triton kernels
        self.unmask = choice.resolve(unmask, model.device, sharded=sharded)
        if self.unmask == "triton":
            from dlmrt.ops.parallel_unmask import triton_kernels

            self.triton_kernels = triton_kernels
        elif self.unmask == "triton-split":
            from dlmrt.ops.parallel_unmask import split_kernels

            self.triton_kernels = split_kernels

    def forward(self, ids: Tensor, positions: Tensor, key_mask: Tensor, block_index: Tensor, count: Tensor,
                threshold: Tensor, factor: Tensor, temperature: Tensor, seed: Tensor, step: Tensor,
                measure: Tensor, edit_threshold: Tensor, prompt_lengths: Tensor, past_kv: Tensor | None = None,
                past_positions: Tensor | None = None, past_key_mask: Tensor | None = None, z: Tensor | None = None,
                certainty: Tensor | None = None, cfg_scale: Tensor | None = None) -> tuple[Tensor, ...]:
        mask_id = self.model.tokens.mask_id
        model_ids, model_positions = ids, positions
        window_key_mask = key_mask  # before the cache's joins it
        if self.cached:
            key_mask = torch.cat((past_key_mask, key_mask), dim=1)
        if self.guided:
            unconditional = ids.masked_fill(positions < prompt_lengths[:, None], mask_id)
            model_ids, model_positions = torch.cat((ids, unconditional)), positions.repeat(2, 1)
            key_mask = key_mask.repeat(2, 1)
            past_positions = None if past_positions is None else past_positions.repeat(2, 1)
        past = PastKV(past_kv, past_positions) if self.cached else None
        residual = Residual(z, certainty) if self.residual else None
        exporting = torch.compiler.is_exporting()
        out = self.model.denoise(model_ids, positions=model_positions, key_mask=key_mask, past=past,
                                 residual=residual, return_kv=self.return_kv or exporting, block_length=self.grid,
                                 logits_index=block_index)
        # A bf16/fp16 block stays as it is where nothing needs all of it in float32 at once: the torch
        # unmasking upcasts it a slice at a time, the split kernels read it as it is.
        upcast = (exporting or self.guided or self.return_logits or self.unmask == "triton"
                  or self.model.vocab_shard is not None)
        logits = out.logits.float() if upcast else out.logits
        if self.guided:
            cond, uncond = logits[:ids.shape[0]], logits[ids.shape[0]:]  # not chunk(): it guards the batch
            logits = uncond + (cfg_scale + 1) * (cond - uncond)
        block_ids, block_positions = ids.index_select(1, block_index), positions.index_select(1, block_index)
        params = UnmaskParams(count, threshold, factor, temperature, seed, step)
        edits = None  # only built where some row may edit: the step loop's default pays nothing for it
        if exporting or self.editing:
            editable = window_key_mask.index_select(1, block_index) & (block_positions >= prompt_lengths[:, None])
            edits = EditParams(edit_threshold, editable)
        if exporting:
            unmasked = torch.ops.dlmrt.parallel_unmask(logits, block_ids, block_positions, *params, measure, *edits,
                                                       mask_id)
        elif self.model.vocab_shard is not None:  # tensor parallelism: this rank's logits are a vocabulary slice
            unmasked = self.model.vocab_shard.unmask(logits, block_ids, block_positions, params, mask_id=mask_id,
                                                     confidence=self.confidence or measure, sampling=self.sampling,
                                                     edits=edits)
        elif self.triton_kernels is not None:
            unmasked = self.triton_kernels.parallel_unmask(logits, block_ids, block_positions, params, mask_id, measure,
                                                           edits=edits)
        else:
            unmask = parallel_unmask if logits.dtype == torch.float32 else chunked.parallel_unmask
            unmasked = unmask(logits, block_ids, block_positions, params, mask_id=mask_id,
                              confidence=self.confidence or measure, sampling=self.sampling, edits=edits)
        extra = (out.residual.z, out.residual.certainty) if self.residual else ()
        if self.return_logits and self.model.vocab_shard is not None:  # no rank holds them all: their logprobs
            extra = (*extra, *self.model.vocab_shard.token_logprobs(
                logits, unmasked[0], limits.recorded_alternatives(self.model.vocab_size), mask_id))
        elif exporting or self.return_logits:
            extra = (*extra, logits)
        return (*unmasked, out.kv, *extra)
