"""Custom ops (dlmrt::ParallelUnmask): torch reference, ONNX schema and function, Triton kernels,
TensorRT plugin."""
