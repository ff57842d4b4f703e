"""TensorRT engines: per-GPU recipes, build plans, quantization, the engine store.
Empty until the TensorRT issue lands."""
