"""`dlmrt::EntropyBoundStep` as a TensorRT plugin (`tensorrt.plugin`, AOT implementations: TensorRT 10.9+).

`register()` registers the shape/type descriptor and an AOT implementation: at build time it hands
TensorRT the PTX of `triton_kernels.entropy_bound_kernel` (the fused step, one program per row)
compiled for the build GPU (see `dlmrt.ops.parallel_unmask.aot`), so a serialized engine runs
the kernel without Python. The TensorRT ONNX parser maps a `dlmrt::EntropyBoundStep` node to this
plugin by its `plugin_namespace` attribute; the node carries no other attributes, so the plugin
has no fields.

Types: the I/O keep the ONNX node's types (logits, temperature, entropy_bound float32; canvas,
positions, seed, step int64; finished BOOL), and the outputs are next_canvas and argmax int64
[B, W], scaled_logits float32 [B, W, V], accepted BOOL [B, W] (one byte per element, as the kernel
writes it) and mean_entropy float32 [B]. W and V are passed as int32 scalars (`SymInt32`) between
the input and output pointers, as the kernel takes them.

The kernel is compiled with `triton_kernels.CONFIGS["entropy_bound_kernel"]`: it serves any V, and
W up to its BLOCK_W (256); a profile with a wider canvas needs another build of the kernel.

Not verified here (no TensorRT on the development machines): that the parser passes no fields on
for a node without attributes beyond the plugin's, and that this TensorRT version takes BOOL plugin
inputs and outputs. The test marked `trt` checks the registration; building an engine from an
exported denoising step graph is the check for both.
"""

from typing import Tuple, Union

from dlmrt.ops.parallel_unmask.trt_plugin import _build_target, aot_launch, register_plugin


def register() -> None:
    """Register the plugin with TensorRT's plugin registry (once per process)."""
    from dlmrt.ops.entropy_bound import onnx_function
    register_plugin(onnx_function, _define)


def _define(trt, trtp, name: str) -> None:
    from dlmrt.ops.parallel_unmask import aot

    Desc = trtp.TensorDesc

    @trtp.register(name)
    def describe(logits: Desc, canvas: Desc, positions: Desc, temperature: Desc, entropy_bound: Desc, seed: Desc,
                 step: Desc, finished: Desc) -> Tuple[Desc, Desc, Desc, Desc, Desc]:
        return (canvas.like(), canvas.like(), logits.like(), trtp.from_shape_expr(canvas.shape_expr, dtype=trt.bool),
                trtp.from_shape_expr(temperature.shape_expr, dtype=trt.float32))

    # tensorrt.plugin refuses an AOT implementation without this return annotation
    @trtp.aot_impl(name)
    def compiled(logits: Desc, canvas: Desc, positions: Desc, temperature: Desc, entropy_bound: Desc, seed: Desc,
                 step: Desc, finished: Desc, outputs: Tuple[Desc], tactic: int
                 ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        kernel = aot.compile_kernel("entropy_bound_kernel", _build_target())
        # one program per row; the kernel's scalars: W, V
        return aot_launch(trtp, kernel, (logits.shape_expr[1], logits.shape_expr[2]), logits.shape_expr[0])
