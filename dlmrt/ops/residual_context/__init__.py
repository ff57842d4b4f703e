"""`dlmrt::ResidualContext`, the ORL residual of a step, in every form it takes.

- `reference`: the semantics, written once in torch (`z = softmax(logits) @ E`, certainty
  `clamp(1 - H(p) / log V, 0, 1)`); `dlmrt/models/residual.py` computes the residual with it, and
  every other form is tested against it.
- `torch_op`: the same as one torch op, so that an exported graph holds a single node.
- `onnx_function`: the ONNX node (domain `dlmrt`) and the local function with the same semantics
  built from standard ops, so that ONNX Runtime runs an exported graph as it is.
- `triton_kernels`: the op as a Triton kernel, with a launcher for CUDA tensors (CPU tensors under
  TRITON_INTERPRET=1). Needs the `dlmrt[triton]` extra, so it is not imported here.
- `trt_plugin`: `register()` registers the op with `tensorrt.plugin` (TensorRT 10.9+) as an AOT
  plugin running the kernel (compiled by `dlmrt.ops.parallel_unmask.aot`).
"""

from dlmrt.ops.residual_context.reference import distribution, residual_context

__all__ = ["distribution", "residual_context"]
