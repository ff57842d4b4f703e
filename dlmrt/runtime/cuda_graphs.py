"""K steps captured into one CUDA graph: how TorchBackend's cudagraph mode and TrtBackend capture.

The steps run once on a side stream first, so lazy initialization (cuBLAS handles, TensorRT's
first-enqueue setup, allocator growth) stays out of the graph; the state is then restored, and the
same steps are captured into a `torch.cuda.CUDAGraph` in the backend's memory pool. A replay reads
and writes the bucket's static buffers, whose addresses never change, so a captured graph never
needs updating: each bucket, step kind and K is captured once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlmrt.runtime.static_buffers import StaticBuffers


def capture(run_steps: Callable[[], None], state: StaticBuffers, device: torch.device, pool) -> Callable[[], None]:
    """`run_steps` (K steps on `state`) warmed up and captured; returns the graph's replay."""
    saved = state.snapshot()
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            run_steps()
        torch.cuda.current_stream(device).wait_stream(side)
    finally:
        state.restore(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run_steps()
    return graph.replay
