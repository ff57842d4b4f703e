"""Custom ops (dlmrt::ParallelUnmask): torch reference, ONNX schema and function, Triton kernel,
TensorRT plugin. Empty until the ONNX-export issue lands."""
