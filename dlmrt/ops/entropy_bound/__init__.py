"""`dlmrt::EntropyBoundStep`, DiffusionGemma's denoising step (uniform noise, no mask token).

- `reference`: the semantics, written once in torch: the temperature schedule, the entropy-bound
  acceptance with its Gumbel-max samples and uniform refills, the stable-and-confident stopping
  rule and the padding after EOS. Every other form is to be tested against it.
- `triton_kernels` (the step as Triton kernels), `onnx_function` (the ONNX local function) and `trt_plugin` (TensorRT).
"""

from dlmrt.ops.entropy_bound.reference import (RANDOM_TOKEN_SALT, RenoiseParams, RenoiseResult, accept_by_entropy,
                                                   contains_eos, entropy, entropy_bound_step, gumbel_sample,
                                                   initial_canvas, pad_after_eos, random_tokens, should_stop,
                                                   stability, temperature_schedule)

__all__ = ["RANDOM_TOKEN_SALT", "RenoiseParams", "RenoiseResult", "accept_by_entropy", "contains_eos", "entropy",
           "entropy_bound_step", "gumbel_sample", "initial_canvas", "pad_after_eos", "random_tokens", "should_stop",
           "stability", "temperature_schedule"]
