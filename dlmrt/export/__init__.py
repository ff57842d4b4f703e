"""Denoiser families in PyTorch (`models/`), Hugging Face checkpoints, and (later) ONNX export."""
