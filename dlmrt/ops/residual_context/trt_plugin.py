"""`dlmrt::ResidualContext` as a TensorRT plugin (`tensorrt.plugin`, TensorRT 10.9+).

`register()` registers the shape/type descriptor and an AOT implementation: at build time it hands
TensorRT the PTX of `triton_kernels.residual_kernel` compiled for the build GPU and the node's
float types (see `dlmrt.ops.parallel_unmask.aot`), so a serialized engine runs the kernel
without Python. The TensorRT ONNX parser maps a `dlmrt::ResidualContext` node to this plugin by its
`plugin_namespace` attribute.

Types: logits and embedding may each be float32, float16 or bfloat16 (an export in bf16 holds bf16
logits and E); z and certainty take the embedding's type, as in the ONNX node. The launch is the
launcher's 2-D grid, (cdiv(B * T, BLOCK_N), cdiv(H, BLOCK_H)), with N = B * T, V and H passed as
int32 scalars (`SymInt32`) between the input and output pointers.

Not verified here (no TensorRT on the development machines): that the parser passes no fields on
for a node without attributes beyond the plugin's, and which type combinations this TensorRT
version offers the plugin in a network that is not strongly typed. The tests marked `trt` check
the registration; building an engine from an exported ORL step graph is the check for both.
"""

from typing import Tuple, Union

from dlmrt.core.errors import KernelInputError
from dlmrt.ops.parallel_unmask.trt_plugin import _build_target, aot_launch, register_plugin


def register() -> None:
    """Register the plugin with TensorRT's plugin registry (once per process)."""
    from dlmrt.ops.residual_context import onnx_function
    register_plugin(onnx_function, _define)


def _pointer_types(trt, **tensors) -> dict[str, str]:
    """Triton's pointer type for each named TensorDesc, refusing types the kernel has no build for."""
    names = {trt.float32: "*fp32", trt.float16: "*fp16", trt.bfloat16: "*bf16"}
    for name, desc in tensors.items():
        if desc.dtype not in names:
            raise KernelInputError(f"dlmrt::ResidualContext: {name} is {desc.dtype}; the kernel takes float32, "
                                   "float16 or bfloat16")
    return {name: names[desc.dtype] for name, desc in tensors.items()}


def _define(trt, trtp, name: str) -> None:
    from dlmrt.ops.parallel_unmask import aot

    Desc = trtp.TensorDesc

    @trtp.register(name)
    def describe(logits: Desc, embedding: Desc) -> Tuple[Desc, Desc]:
        batch, length = logits.shape_expr[0], logits.shape_expr[1]
        return (trtp.from_shape_expr((batch, length, embedding.shape_expr[1]), dtype=embedding.dtype),
                trtp.from_shape_expr((batch, length), dtype=embedding.dtype))

    @trtp.aot_impl(name)
    def compiled(logits: Desc, embedding: Desc, outputs: Tuple[Desc], tactic: int
                 ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        z, certainty = outputs
        types = _pointer_types(trt, logits=logits, embedding=embedding, z=z, certainty=certainty)
        kernel = aot.compile_kernel("residual_kernel", _build_target(), types)
        rows = logits.shape_expr[0] * logits.shape_expr[1]
        hidden = embedding.shape_expr[1]
        grid = trtp.cdiv(rows, kernel.constexprs["BLOCK_N"]), trtp.cdiv(hidden, kernel.constexprs["BLOCK_H"])
        # the kernel's scalars: N = B * T, V, H
        return aot_launch(trtp, kernel, (rows, logits.shape_expr[2], hidden), *grid)
