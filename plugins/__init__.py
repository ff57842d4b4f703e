"""Custom ops, one package each with its torch reference, ONNX schema and function, Triton kernels and
TensorRT plugin:

- `parallel_unmask`: `dlmrt::ParallelUnmask`, the parallel unmasking step of every step graph;
- `residual_context`: `dlmrt::ResidualContext`, the residual an ORL step hands to the next.
"""
