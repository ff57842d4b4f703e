"""The backend contract: run K steps of a step graph on a bucket's static buffers, in place.

A backend owns the state of each shape bucket (`dlmrt.runtime.device_state`): `prepare(bucket)` hands
out its buffers, allocated once; `prepare_steps` is where a step of one kind, run K times back to
back, is compiled or captured; `run` enqueues those K steps without reading anything back. The step
itself is `dlmrt.runtime.device_step.step`, the same function for every backend: what differs is how
the step graph runs (eager torch, torch.compile, a CUDA graph, an ONNX Runtime session). The loop
never knows which backend runs the step.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dlmrt.core.errors import ArgumentError

if TYPE_CHECKING:
    from pathlib import Path

    from dlmrt.export.export_manifest import ExportManifest
    from dlmrt.runtime.canvas_state import CanvasBucket, CanvasState
    from dlmrt.runtime.device_state import Bucket, BucketLadder, DeviceState
    from dlmrt.runtime.device_step import StepKind


@dataclass(frozen=True)
class ModelSpec:
    """What the loop needs to know about the model behind a backend."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    mask_id: int | None  # None for uniform-noise models
    eos_ids: tuple[int, ...]
    pad_id: int
    block_causal: bool
    has_residual: bool
    dtype: torch.dtype
    device: torch.device
    # How to lift the limits of what a compiled backend was built for.
    limits_hint: str = ""
    block_grid: int | None = None  # the block-causal grid a compiled graph was built with
    supports_guidance: bool = True
    supports_editing: bool = True  # the graphs take token editing's inputs (exports before it do not)
    logits_shift: int = 0  # Denoiser.logits_shift: a window over a cache starts this many positions early
    noise: str = "mask"  # Denoiser.noise: "uniform" for models with no mask token (DiffusionGemma)

    @classmethod
    def of_export(cls, manifest: ExportManifest, export_dir: Path, device: torch.device) -> ModelSpec:
        """The spec of the graphs in an export directory, from its manifest alone."""
        from dlmrt.export.models import FAMILIES

        model, tokens = manifest.model, manifest.tokens
        return cls(
            name=model.name, vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            max_positions=manifest.limits.max_length, mask_id=tokens.mask_id, eos_ids=tokens.eos_ids,
            pad_id=tokens.pad_id, block_causal=model.block_causal, has_residual=model.residual,
            dtype=getattr(torch, model.dtype), device=device,
            limits_hint=f"re-export with `dlmrt export ... -o {export_dir} --max-batch B --max-length N`",
            block_grid=model.block_grid, supports_guidance=manifest.supports_guidance,
            supports_editing=manifest.supports_editing,
            logits_shift=FAMILIES[model.model_type].model_class.logits_shift, noise=model.noise)


class Backend(ABC):
    def __init__(self, spec: ModelSpec, ladder: BucketLadder):
        self.spec, self.ladder = spec, ladder
        self._states: dict[Bucket, DeviceState] = {}
        self._owners: dict[Bucket, weakref.ref] = {}

    def prepare(self, bucket: Bucket | CanvasBucket, owner: object) -> DeviceState | CanvasState:
        """The static state of `bucket` (allocated on first use) for `owner`, a running request: a
        DeviceState for a mask model's Bucket, a CanvasState for a uniform-noise model's CanvasBucket.
        A bucket runs one request at a time; it is free again once `release` was called or its owner
        is gone."""
        holder = self._owners.get(bucket)
        if holder is not None and holder() is not None and holder() is not owner:
            raise ArgumentError("this backend is already decoding a batch of the same shape: finish or close the "
                                "other generate stream first, or give each concurrent stream its own backend")
        if bucket not in self._states:
            self._states[bucket] = self._allocate(bucket)
        self._owners[bucket] = weakref.ref(owner)
        return self._states[bucket]

    def _allocate(self, bucket: Bucket | CanvasBucket) -> DeviceState | CanvasState:
        from dlmrt.runtime.canvas_state import CanvasBucket, CanvasState
        from dlmrt.runtime.device_state import DeviceState

        if isinstance(bucket, CanvasBucket):
            return CanvasState.allocate(self.spec, bucket, self.cache_groups())
        return DeviceState.allocate(self.spec, bucket)

    def release(self, state: DeviceState | CanvasState) -> None:
        self._owners.pop(state.bucket, None)

    def prepare_steps(self, state: DeviceState, kind: StepKind, steps: int) -> float:
        """Make `steps` back-to-back steps of `kind` runnable on `state`: compile or capture them on
        first use. Returns the seconds this call spent doing so."""
        return 0.0

    @abstractmethod
    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        """Enqueue `steps` steps of `kind` on `state`, in place, without reading anything back."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)
