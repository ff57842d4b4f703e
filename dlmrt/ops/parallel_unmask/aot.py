"""Ahead-of-time compilation of dlmrt's Triton kernels to PTX, for GPUs this machine need not have.

`compile_kernel(name, cc)` runs `triton.compile` for `GPUTarget("cuda", cc, 32)` and returns what a
TensorRT AOT plugin needs: the PTX, its entry name, the threads per block and the shared memory.
It compiles the kernels of every custom op (`MODULES` says where each lives: `dlmrt::ParallelUnmask`'s
here, `dlmrt::ResidualContext`'s in `dlmrt.ops.residual_context`, `dlmrt::EntropyBoundStep`'s in
`dlmrt.ops.entropy_bound`). `types` overrides argument
types of the signature, e.g. `{"logits": "*bf16"}` for a kernel that serves several dtypes.

Triton (3.3+) appends two pointer parameters to every kernel (global and profile scratch) that its
own launcher fills in. TensorRT passes only the node's inputs, the extra scalars and the outputs,
so the PTX is handed over without them; that is refused when the kernel does use scratch memory.

Under TRITON_INTERPRET=1 `triton.jit` makes interpreted functions, which cannot be compiled. Then
the compilation runs in a fresh interpreter without the variable (`python -m
dlmrt.ops.parallel_unmask.aot KERNEL CC [TYPES_JSON]` prints the result as JSON), so tests and
tools may mix the interpreter and AOT compilation in one process.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from dlmrt.core.errors import KernelInputError
from dlmrt.ops.entropy_bound import triton_kernels as entropy_bound_kernels
from dlmrt.ops.parallel_unmask import triton_kernels

TARGETS = (90, 100, 120)  # H100/H200, B200, RTX 5090

_PARALLEL_UNMASK = {
    "logits": "*fp32", "ids": "*i64", "positions": "*i64", "count": "*i64", "threshold": "*fp32",
    "factor": "*fp32", "temperature": "*fp32", "seed": "*i64", "step": "*i64", "measure": "*i64",
    "edit_threshold": "*fp32", "editable": "*i1", "W": "i32", "V": "i32", "mask_id": "i32",
    "new_ids": "*i64", "confidence": "*fp32", "commit": "*i1", "committed": "*i64",
}
# The non-constexpr arguments of each kernel, in order, with Triton's type names.
SIGNATURES = {
    "parallel_unmask_kernel": _PARALLEL_UNMASK,
    "position_kernel": {name: _PARALLEL_UNMASK[name] for name in (
        "logits", "ids", "positions", "seed", "step", "temperature", "measure", "edit_threshold", "editable", "W",
        "V", "mask_id", "new_ids", "confidence")},
    "commit_kernel": {name: _PARALLEL_UNMASK[name] for name in (
        "ids", "count", "threshold", "factor", "W", "mask_id", "new_ids", "confidence", "commit", "committed")},
    "split_kernel": {**{name: _PARALLEL_UNMASK[name] for name in (
        "logits", "ids", "positions", "seed", "step", "temperature", "edit_threshold", "editable", "W", "V")},
        "S": "i32", "span": "i32", "mask_id": "i32", "stats": "*fp32", "index": "*i32", "sampled": "*fp64"},
    "merge_kernel": {**{name: _PARALLEL_UNMASK[name] for name in (
        "logits", "ids", "positions", "seed", "step", "temperature", "measure", "edit_threshold", "editable", "W",
        "V")}, "S": "i32", "mask_id": "i32", "stats": "*fp32", "index": "*i32", "sampled": "*fp64",
        "new_ids": "*i64", "confidence": "*fp32"},
    "residual_kernel": {"logits": "*fp32", "embedding": "*fp32", "N": "i32", "V": "i32", "H": "i32", "z": "*fp32",
                        "certainty": "*fp32"},
    **entropy_bound_kernels.SIGNATURES,
}
# The module holding each kernel and its CONFIGS.
MODULES = {**dict.fromkeys(("parallel_unmask_kernel", "position_kernel", "commit_kernel"),
                           "dlmrt.ops.parallel_unmask.triton_kernels"),
           **dict.fromkeys(("split_kernel", "merge_kernel"), "dlmrt.ops.parallel_unmask.split_kernels"),
           "residual_kernel": "dlmrt.ops.residual_context.triton_kernels",
           **dict.fromkeys(entropy_bound_kernels.SIGNATURES, "dlmrt.ops.entropy_bound.triton_kernels")}


@dataclass(frozen=True)
class CompiledKernel:
    kernel: str  # the function in its MODULES module
    cc: int  # compute capability, e.g. 90 for sm_90
    name: str  # the PTX entry
    ptx: str
    threads: int  # threads per block (block_x); the grid is the launcher's (one program per row for the op)
    shared_mem: int  # dynamic shared memory in bytes
    constexprs: dict[str, int]


def compile_kernel(kernel: str = "parallel_unmask_kernel", cc: int = 90,
                   types: dict[str, str] | None = None) -> CompiledKernel:
    if kernel not in SIGNATURES:
        raise KernelInputError(f"unknown kernel {kernel!r} (known: {', '.join(SIGNATURES)})")
    unknown = set(types or {}) - set(SIGNATURES[kernel])
    if unknown:
        raise KernelInputError(f"{kernel} has no arguments {sorted(unknown)} (it has {', '.join(SIGNATURES[kernel])})")
    if triton_kernels.interpreted():
        return _compile_in_subprocess(kernel, cc, types)
    import triton
    from triton.backends.compiler import GPUTarget

    module = importlib.import_module(MODULES[kernel])
    config = module.CONFIGS[kernel]
    signature = dict(SIGNATURES[kernel], **(types or {}), **{name: "constexpr" for name in config.constexprs})
    source = triton.compiler.ASTSource(getattr(module, kernel), signature, constexprs=config.constexprs)
    # No FMA contraction: the interpreter, where the kernels are tested, has none either.
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": config.num_warps, "enable_fp_fusion": False})
    metadata = compiled.metadata
    if metadata.global_scratch_size or metadata.profile_scratch_size:
        raise KernelInputError(f"{kernel} for sm_{cc} needs Triton scratch memory, which a TensorRT plugin "
                               "cannot pass")
    ptx = _drop_params(compiled.asm["ptx"], metadata.name, keep=len(SIGNATURES[kernel]))
    return CompiledKernel(kernel, cc, metadata.name, ptx, metadata.num_warps * 32, metadata.shared,
                          dict(config.constexprs))


def _drop_params(ptx: str, entry: str, keep: int) -> str:
    """The PTX with the entry's parameters from index `keep` on removed; each must be unused."""
    match = re.search(rf"\.entry {re.escape(entry)}\((.*?)\)", ptx, flags=re.S)
    if match is None:
        raise KernelInputError(f"no entry {entry} in the PTX")
    params = [p.strip() for p in match.group(1).split(",")]
    for param in params[keep:]:
        name = param.split()[-1]
        if ptx.count(name) != 1:
            raise KernelInputError(f"{entry}: Triton's parameter {name} is used by the kernel")
    kept = ",\n\t".join(params[:keep])
    return ptx[:match.start(1)] + f"\n\t{kept}\n" + ptx[match.end(1):]


def _compile_in_subprocess(kernel: str, cc: int, types: dict[str, str] | None) -> CompiledKernel:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", __name__, kernel, str(cc), json.dumps(types or {})], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {kernel} for sm_{cc} in a subprocess failed:\n{done.stderr}")
    return CompiledKernel(**json.loads(done.stdout))


def main(argv: list[str]) -> None:
    kernel, cc, *types = argv
    print(json.dumps(dataclasses.asdict(compile_kernel(kernel, int(cc), json.loads(types[0]) if types else None))))


if __name__ == "__main__":
    main(sys.argv[1:])
