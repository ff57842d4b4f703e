"""TorchBackend: the step graph in eager PyTorch, on whatever device the denoiser lives on."""

from __future__ import annotations

import torch

from dlmrt.export.models import Denoiser
from dlmrt.export.models.denoiser import PastKV
from dlmrt.export.models.residual import Residual
from dlmrt.plugins.parallel_unmask import parallel_unmask
from dlmrt.runtime.backend import Backend, ModelSpec, StepInputs, StepOutputs, StepShapes


def spec_of(model: Denoiser) -> ModelSpec:
    if model.tokens is None:
        raise ValueError(f"{model.name} has no special token ids (mask/eos/pad): load it with "
                         f"dlmrt.load or give them to the model")
    return ModelSpec(
        name=model.name, vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_positions=model.max_positions, mask_id=model.tokens.mask_id,
        eos_ids=tuple(model.tokens.eos_ids), pad_id=model.tokens.pad_id,
        block_causal=model.block_causal, has_residual=model.residual_config is not None,
        dtype=model.dtype, device=model.device)


class TorchBackend(Backend):
    """Runs the denoiser eagerly; outputs are copied into buffers owned per shape bucket, as an
    IO-bound ONNX Runtime session or a TensorRT engine would write them."""

    def __init__(self, model: Denoiser):
        model.eval()
        self.model = model
        self.spec = spec_of(model)
        self._buffers: dict[StepShapes, StepOutputs] = {}

    def prepare(self, shapes: StepShapes) -> None:
        if shapes in self._buffers:
            return
        s, device = self.spec, self.spec.device
        rows = shapes.batch * (2 if shapes.guided else 1)
        kv = None
        if shapes.return_kv:
            kv = torch.empty(s.num_layers, 2, rows, s.num_kv_heads, shapes.window, s.head_dim,
                             dtype=s.dtype, device=device)
        z = certainty = None
        if s.has_residual:
            z = torch.empty(rows, shapes.window, s.hidden_size, dtype=s.dtype, device=device)
            certainty = torch.empty(rows, shapes.window, dtype=s.dtype, device=device)
        self._buffers[shapes] = StepOutputs(
            ids=torch.empty(shapes.batch, shapes.block, dtype=torch.long, device=device),
            confidence=torch.empty(shapes.batch, shapes.block, dtype=torch.float32, device=device),
            commit=torch.empty(shapes.batch, shapes.block, dtype=torch.bool, device=device),
            committed=torch.empty(shapes.batch, dtype=torch.long, device=device),
            kv=kv, z=z, certainty=certainty)

    @torch.no_grad()
    def step(self, inputs: StepInputs) -> StepOutputs:
        shapes = inputs.shapes()
        self.prepare(shapes)
        buffers = self._buffers[shapes]
        ids, positions, key_mask = inputs.ids, inputs.positions, inputs.key_mask
        block = slice(inputs.block_offset, inputs.block_offset + inputs.block_length)
        if shapes.guided:
            is_prompt = positions < inputs.prompt_lengths[:, None]
            ids = torch.cat((ids, ids.masked_fill(is_prompt, self.spec.mask_id)))
            positions, key_mask = positions.repeat(2, 1), key_mask.repeat(2, 1)
        past = None
        if inputs.past_kv is not None:
            past_positions = inputs.past_positions.repeat(2, 1) if shapes.guided else inputs.past_positions
            past = PastKV(inputs.past_kv, past_positions)
        residual = None if inputs.z is None else Residual(inputs.z, inputs.certainty)
        out = self.model.denoise(ids, positions=positions, key_mask=key_mask, past=past,
                                 residual=residual, return_kv=inputs.return_kv,
                                 block_length=inputs.grid, logits_range=(block.start, block.stop))
        logits = out.logits.float()
        if shapes.guided:
            cond, uncond = logits.chunk(2)
            logits = uncond + (inputs.cfg_scale + 1) * (cond - uncond)
        result = parallel_unmask(logits, inputs.ids[:, block], inputs.positions[:, block], inputs.params,
                                 mask_id=self.spec.mask_id, confidence=inputs.confidence,
                                 sampling=inputs.sampling)

        buffers.ids.copy_(result.ids)
        buffers.confidence.copy_(result.confidence)
        buffers.commit.copy_(result.commit)
        buffers.committed.copy_(result.committed)
        if buffers.kv is not None:
            buffers.kv.copy_(out.kv)
        if buffers.z is not None:
            buffers.z.copy_(out.residual.z)
            buffers.certainty.copy_(out.residual.certainty)
        return buffers
