"""`dlmrt::ParallelUnmask`, the parallel unmasking step, in every form it takes.

- `reference`: the semantics, written once in torch; every other form is tested against it.
- `onnx_function`: the ONNX node (domain `dlmrt`) and the local function with the same semantics
  built from standard ops, so that ONNX Runtime runs an exported graph as it is.
"""

from dlmrt.plugins.parallel_unmask.reference import (CONFIDENCE_MEASURES, MEASURE_CODES, UnmaskParams,
                                                     UnmaskResult, candidates, commit_count, confidence_of,
                                                     parallel_unmask, strictly_above, uniform)

__all__ = ["CONFIDENCE_MEASURES", "MEASURE_CODES", "UnmaskParams", "UnmaskResult", "candidates", "commit_count",
           "confidence_of", "parallel_unmask", "strictly_above", "uniform"]
