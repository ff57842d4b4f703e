"""`dlmrt::ParallelUnmask` as a TensorRT plugin (`tensorrt.plugin`, TensorRT 10.9+).

`register()` registers the shape/type descriptor and an AOT implementation: at build time it hands
TensorRT the PTX of `triton_kernels.parallel_unmask_kernel` compiled for the build GPU (see `aot`),
so a serialized engine runs the kernel without Python. The TensorRT ONNX parser maps a
`dlmrt::ParallelUnmask` node to this plugin by its `plugin_namespace` attribute.

Version 2 of the op's interface (token editing) adds `edit_threshold` and `editable` (BOOL, one
byte per element) after `measure`.

Types: the I/O keep the ONNX node's types. TensorRT 10 has INT64 tensors and plugins take them, so
ids, positions, count, seed, step, measure, new_ids and committed stay int64 and the graph needs no
casts; `commit` is BOOL, one byte per element as the kernel writes it. Kernel scalars can only be
int32 (`SymInt32`): W, V and mask_id are passed as such.

Not verified here (no TensorRT on the development machines): that the parser passes only
`mask_id` on as a plugin field, and that this TensorRT version accepts BOOL plugin outputs (older
documentation of PluginTensorDesc lists kBOOL as unsupported). The tests marked `trt` check the
registration; building an engine from an exported step graph is the check for both.
"""

from typing import Tuple, Union

from dlmrt.core.errors import MissingExtraError

_registered: set[str] = set()  # the plugin ids registered in this process


def register() -> None:
    """Register the plugin with TensorRT's plugin registry (once per process)."""
    from dlmrt.ops.parallel_unmask import onnx_function
    register_plugin(onnx_function, _define)


def register_plugin(onnx_function, define) -> None:
    """Register the plugin of the dlmrt op that `onnx_function` (its module) describes, once per process:
    `define(trt, trtp, plugin_id)` declares it to `tensorrt.plugin`."""
    plugin = f"{onnx_function.DOMAIN}::{onnx_function.OP_TYPE}"
    if plugin in _registered:
        return
    if onnx_function.TENSORRT_PLUGIN_VERSION != "1":
        raise RuntimeError(f"tensorrt.plugin registers version 1, the ONNX node of {plugin} asks for "
                           f"{onnx_function.TENSORRT_PLUGIN_VERSION}")
    define(*tensorrt_modules(plugin), plugin)
    _registered.add(plugin)


def tensorrt_modules(plugin: str):
    """(tensorrt, tensorrt.plugin), or the MissingExtraError naming the extra that the plugin needs."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as error:
        raise MissingExtraError(f"the TensorRT plugin of {plugin} needs TensorRT 10.9 or newer: "
                                "pip install 'dlmrt[tensorrt]'") from error
    return trt, trtp


def _build_target() -> int:
    """The compute capability of the GPU the engine is built on (and for)."""
    from triton.runtime import driver
    return driver.active.get_current_target().arch


def aot_launch(trtp, kernel, scalars, grid_x, grid_y=None):
    """What an AOT implementation returns for the compiled `kernel`: its name and PTX, its launch over the
    grid (x, and y when given) and its int32 `scalars`, which TensorRT passes between the input and output
    pointers."""
    launch = trtp.KernelLaunchParams()
    launch.grid_x = grid_x
    if grid_y is not None:
        launch.grid_y = grid_y
    launch.block_x = kernel.threads
    launch.shared_mem = kernel.shared_mem
    return kernel.name.encode(), kernel.ptx.encode(), launch, trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(e) for e in scalars])


def _define(trt, trtp, name: str) -> None:
    from dlmrt.ops.parallel_unmask import aot

    Desc = trtp.TensorDesc

    @trtp.register(name)
    def describe(logits: Desc, ids: Desc, positions: Desc, count: Desc, threshold: Desc, factor: Desc,
                 temperature: Desc, seed: Desc, step: Desc, measure: Desc, edit_threshold: Desc, editable: Desc,
                 mask_id: int) -> Tuple[Desc, Desc, Desc, Desc]:
        return (ids.like(), trtp.from_shape_expr(ids.shape_expr, dtype=trt.float32),
                trtp.from_shape_expr(ids.shape_expr, dtype=trt.bool), count.like())

    @trtp.aot_impl(name)
    def compiled(logits: Desc, ids: Desc, positions: Desc, count: Desc, threshold: Desc, factor: Desc,
                 temperature: Desc, seed: Desc, step: Desc, measure: Desc, edit_threshold: Desc, editable: Desc,
                 mask_id: int, outputs: Tuple[Desc], tactic: int
                 ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        kernel = aot.compile_kernel("parallel_unmask_kernel", _build_target())
        # one program per row; the kernel's scalars: W, V, mask_id
        return aot_launch(trtp, kernel, (ids.shape_expr[1], logits.shape_expr[2], mask_id), ids.shape_expr[0])
