"""Custom ops, one package each with its torch reference, ONNX schema and function, Triton kernels and
TensorRT plugin:

- `parallel_unmask`: `dlmrt::ParallelUnmask`, the parallel unmasking step of every step graph;
- `residual_context`: `dlmrt::ResidualContext`, the residual an ORL step hands to the next;
- `entropy_bound`: `dlmrt::EntropyBoundStep`, the denoising step of uniform-noise models (DiffusionGemma).
"""


def register_tensorrt_plugins() -> None:
    """Register every dlmrt op's TensorRT plugin (once per process): before parsing a graph that holds
    them, and before deserializing an engine built from one."""
    from dlmrt.ops.entropy_bound import trt_plugin as entropy_bound
    from dlmrt.ops.parallel_unmask import trt_plugin as parallel_unmask
    from dlmrt.ops.residual_context import trt_plugin as residual_context

    parallel_unmask.register()
    residual_context.register()
    entropy_bound.register()
