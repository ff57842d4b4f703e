"""`dlmrt::ParallelUnmask`, the parallel unmasking step, in every form it takes.

- `reference`: the semantics, written once in torch; every other form is tested against it.
- `onnx_function`: the ONNX node (domain `dlmrt`) and the local function with the same semantics
  built from standard ops, so that ONNX Runtime runs an exported graph as it is.
- `triton_kernels`: the op as Triton kernels, with launchers for CUDA tensors (CPU tensors under
  TRITON_INTERPRET=1). Needs the `dlmrt[triton]` extra, so it is not imported here.
- `aot`: the Triton kernels of every dlmrt op (this one's and `dlmrt::ResidualContext`'s) compiled
  ahead of time to PTX for sm_90, sm_100 and sm_120, no GPU needed.
- `trt_plugin`: `register()` registers the op with `tensorrt.plugin` (TensorRT 10.9+) as an AOT
  plugin running the fused kernel, so an engine needs no Python.
"""

from dlmrt.ops.parallel_unmask.reference import (CONFIDENCE_MEASURES, MEASURE_CODES, EditParams, UnmaskParams,
                                                     UnmaskResult, candidates, commit_count, confidence_of,
                                                     parallel_unmask, strictly_above, uniform)

__all__ = ["CONFIDENCE_MEASURES", "EditParams", "MEASURE_CODES", "UnmaskParams", "UnmaskResult", "candidates",
           "commit_count", "confidence_of", "parallel_unmask", "strictly_above", "uniform"]
