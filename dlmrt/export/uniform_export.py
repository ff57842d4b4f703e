"""`dlmrt export` of a uniform-noise model (DiffusionGemma): its encoder, decoder and soft tokens as ONNX.

    OUT_DIR/encode.onnx        the cache commit: the causal encoder over ids after a cached prefix
    OUT_DIR/decode.onnx        the denoising step: the bidirectional decoder over [cache; canvas]
    OUT_DIR/soft_tokens.onnx   the next step's self-conditioning from this step's scaled logits
    OUT_DIR/dlmrt.json         the manifest (`export_manifest.ExportManifest`, model.noise "uniform")
    OUT_DIR/tokenizer.json, tokenizer_config.json, generation_config.json   copied from the model (those it has)

The graphs and their contract (B batch, T the ids' length, W the canvas, P the cached prefix;
every one of them dynamic, up to the manifest's limits):

    encode       ids [B, T] int64, positions [B, T] int64, key_mask [B, T] bool,
                 past_key_mask [B, P] bool, past_sliding [Ls, 2, B, Hs, P, Ds], past_full [Lf, 2, B, Hf, P, Df],
                 past_positions [B, P] int64
              -> sliding [Ls, 2, B, Hs, P + T, Ds], full [Lf, 2, B, Hf, P + T, Df], positions [B, P + T]
    decode       canvas [B, W] int64, positions [B, W] int64, key_mask [B, W] bool, past_key_mask [B, P] bool,
                 past_sliding, past_full, past_positions (as above), z [B, W, H]
              -> logits [B, W, V] float32 (soft-capped)
    soft_tokens  scaled_logits [B, W, V] float32 -> z [B, W, H], certainty [B, W] float32

Choices, and why:

- The encoder returns the cache EXTENDED by the new ids' K/V, as `DiffusionGemma.encode` does: the
  runtime keeps what the graph returns and concatenates nothing itself.
- The prompt has no cache: it runs the same `encode` graph with an empty prefix (P = 0, past tensors
  of zero positions). torch.export takes the prefix dimension with `min=0` and the traced graph holds
  no branch on it (concatenating an empty past is a no-op in ONNX), so no `prefill` graph of its own
  is needed, which saves a third of the export time; tests/export/test_diffusion_gemma_onnx.py checks P = 0
  against the torch encoder. `decode` takes P = 0 too (a canvas with no context, `past=None`).
- The key mask comes in two parts, the prefix's `past_key_mask [B, P]` and the new positions'
  `key_mask [B, T]`, as in the mask models' `step_cached` graph: a single `[B, P + T]` input would
  need a dimension that is the sum of two others, which torch.export cannot declare. The runtime
  splits the loop's `[B, P + T]` mask (`dlmrt.runtime.ort_backend`).
- The decoder always takes `z`: zeros on a canvas's first step, which is exactly the model's
  `residual=None` path (its self-conditioning signal is then zeros either way).
- `soft_tokens` is a graph of its own, so the embedding matrix it multiplies by is exported with it
  (hashed in the manifest like every file) instead of being dug out of the decoder graph's
  initializers, whose names and layout the exporter does not promise.

The MoE layers run every expert on every token under export (`Experts.forward` in a fixed-shape
graph), weighted by a routing matrix that is zero where a token did not choose the expert: the same
sums as the eager code's routed tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from dlmrt.core.errors import UnsupportedFeatureError
from dlmrt.export.export_manifest import CANVAS_GRAPHS
from dlmrt.export.export_writer import to_onnx, write_export
from dlmrt.models import Denoiser
from dlmrt.models.residual import Residual

EXAMPLE_BATCH, EXAMPLE_WINDOW, EXAMPLE_PREFIX = 3, 6, 5  # distinct, so that no two dimensions are unified
CACHE_INPUTS = ("past_key_mask", "past_sliding", "past_full", "past_positions")
INPUTS = {"encode": ("ids", "positions", "key_mask", *CACHE_INPUTS),
          "decode": ("canvas", "positions", "key_mask", *CACHE_INPUTS, "z"),
          "soft_tokens": ("scaled_logits",)}
OUTPUTS = {"encode": ("sliding", "full", "cache_positions"), "decode": ("logits",),
           "soft_tokens": ("z", "certainty")}


def graph_file(graph: str) -> str:
    return f"{graph}.onnx"


def _past(past_sliding: Tensor, past_full: Tensor, past_positions: Tensor):
    from dlmrt.models.denoiser import LayerGroupKV

    return LayerGroupKV(past_sliding, past_full, past_positions)


class EncodeGraph(nn.Module):
    """`model.encode` over a cached prefix (which may be empty), returning the extended cache."""

    def __init__(self, model: Denoiser):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, key_mask, past_key_mask, past_sliding, past_full, past_positions):
        cache = self.model.encode(ids, positions=positions, key_mask=torch.cat((past_key_mask, key_mask), dim=1),
                                  past=_past(past_sliding, past_full, past_positions))
        return cache.sliding, cache.full, cache.positions


class DecodeGraph(nn.Module):
    """`model.denoise` over [cache; canvas], self-conditioned on `z` (zeros: none)."""

    def __init__(self, model: Denoiser):
        super().__init__()
        self.model = model

    def forward(self, canvas, positions, key_mask, past_key_mask, past_sliding, past_full, past_positions, z):
        return self.model.denoise(canvas, positions=positions, key_mask=torch.cat((past_key_mask, key_mask), dim=1),
                                  past=_past(past_sliding, past_full, past_positions),
                                  residual=Residual(z, None)).logits


class SoftTokensGraph(nn.Module):
    """`model.soft_tokens`: z = softmax(scaled logits) @ E, and the certainty beside it."""

    def __init__(self, model: Denoiser):
        super().__init__()
        self.model = model

    def forward(self, scaled_logits):
        soft = self.model.soft_tokens(scaled_logits)
        return soft.z, soft.certainty


GRAPH_MODULES = {"encode": EncodeGraph, "decode": DecodeGraph, "soft_tokens": SoftTokensGraph}


def cache_shape(model: Denoiser, kind: str, batch: int, prefix: int) -> tuple[int, ...]:
    """The shape of one group of the K/V cache: `[layers of the kind, 2, B, K/V heads, P, head size]`."""
    layers = model.config.layer_types.count(kind)
    return layers, 2, batch, model.config.kv_heads(kind), prefix, model.config.head_dim(kind)


def _example_inputs(model: Denoiser, graph: str) -> dict[str, Tensor]:
    from dlmrt.models.diffusion_gemma import FULL, SLIDING

    batch, window, prefix = EXAMPLE_BATCH, EXAMPLE_WINDOW, EXAMPLE_PREFIX
    device, dtype = model.device, model.dtype
    long = dict(dtype=torch.long, device=device)
    ids = (torch.arange(batch * window, **long).view(batch, window) * 7) % model.vocab_size
    generator = torch.Generator().manual_seed(0)
    values = {
        "ids": ids, "canvas": ids,
        "positions": (torch.arange(window, **long) + prefix).repeat(batch, 1),
        "key_mask": torch.ones(batch, window, dtype=torch.bool, device=device),
        "past_key_mask": torch.ones(batch, prefix, dtype=torch.bool, device=device),
        "past_sliding": torch.randn(cache_shape(model, SLIDING, batch, prefix), generator=generator).to(device, dtype),
        "past_full": torch.randn(cache_shape(model, FULL, batch, prefix), generator=generator).to(device, dtype),
        "past_positions": torch.arange(prefix, **long).repeat(batch, 1),
        "z": torch.zeros(batch, window, model.hidden_size, dtype=dtype, device=device),
        "scaled_logits": torch.randn(batch, window, model.vocab_size, generator=generator).to(device),
    }
    return {name: values[name] for name in INPUTS[graph]}


def _dynamic_shapes(graph: str, max_batch: int, max_length: int) -> dict[str, dict]:
    # As in onnx_export: each range reaches past the example inputs; the manifest's limits are the
    # ones the runtime enforces.
    max_batch = max(max_batch, EXAMPLE_BATCH)
    max_length = max(max_length, EXAMPLE_WINDOW + EXAMPLE_PREFIX)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    window = torch.export.Dim("window", min=1, max=max_length)
    prefix = torch.export.Dim("prefix", min=0, max=max_length)  # 0: the prompt's encode
    shapes = {"ids": {0: batch, 1: window}, "canvas": {0: batch, 1: window}, "positions": {0: batch, 1: window},
              "key_mask": {0: batch, 1: window}, "past_key_mask": {0: batch, 1: prefix},
              "past_sliding": {2: batch, 4: prefix}, "past_full": {2: batch, 4: prefix},
              "past_positions": {0: batch, 1: prefix}, "z": {0: batch, 1: window},
              "scaled_logits": {0: batch, 1: window}}
    return {name: shapes[name] for name in INPUTS[graph]}


def export_graph(model: Denoiser, graph: str, opset: int, max_batch: int, max_length: int) -> onnx.ModelProto:
    return to_onnx(GRAPH_MODULES[graph](model), _example_inputs(model, graph),
                   _dynamic_shapes(graph, max_batch, max_length), opset, list(OUTPUTS[graph]))


def check_exportable(model: Denoiser) -> None:
    from dlmrt.models.diffusion_gemma import FULL, SLIDING

    missing = [kind for kind in (SLIDING, FULL) if kind not in model.config.layer_types]
    if missing:
        raise UnsupportedFeatureError(f"exporting a {model.model_type} model without {missing[0]} layers is not "
                                      f"supported: the graphs carry one cache tensor per kind of layer")


def export(model: Denoiser, out_dir: str | Path, *, opset: int, max_batch: int, max_length: int,
           on_graph: Callable[[str], None] | None = None) -> Path:
    """Write the encode, decode and soft-token graphs of the uniform-noise `model` and their manifest to
    `out_dir`, atomically. The arguments are checked by `onnx_export.export`, which calls this."""
    check_exportable(model)
    model.eval()
    return write_export(model, out_dir, {graph: functools.partial(export_graph, model, graph, opset, max_batch,
                                                                  max_length) for graph in CANVAS_GRAPHS},
                        graph_file, block_grid=None, opset=opset, max_batch=max_batch, max_length=max_length,
                        on_graph=on_graph)
