"""TensorRT engines: per-GPU recipes (`targets`), build plans (`plan`), the ONNX preflight
(`preflight`), quantization (`quant`), the thin TensorRT builder (`builder`) and the engine store
with its manifests (`store`)."""
