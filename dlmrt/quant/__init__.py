"""Quantized step graphs: FP8 through nvidia-modelopt's ONNX post-training quantization, NVFP4
through an exact fake quantizer of the format written in TensorRT's Q/DQ form, and the calibration
inputs both take from the task suite (or a user file)."""
