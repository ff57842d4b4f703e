"""One recipe per GPU target: what it supports and how engines for it are built by default.

A TensorRT engine runs only on the compute capability it was built on, so a target is a compute
capability. FP8 needs 8.9 or newer, NVFP4 10.0 or newer. `--target auto` takes the running GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlmrt.core.errors import DlmrtError

PRECISIONS = ("bf16", "fp16", "fp8", "nvfp4")
GiB = 1 << 30


class TargetError(DlmrtError):
    """A target or precision that cannot be built, or no GPU to take the target from."""


@dataclass(frozen=True)
class Target:
    name: str  # "sm_90"
    compute_capability: tuple[int, int]
    gpus: tuple[str, ...]  # examples, for messages and `dlmrt inspect`
    precisions: tuple[str, ...]  # what the tensor cores run; the first is the default
    workspace_bytes: int  # default workspace pool limit (a limit, not an allocation)
    optimization_level: int = 3  # TensorRT's default builder optimization level
    opt_batch: int = 1  # the batch the default profile is tuned for (interactive use)

    @property
    def default_precision(self) -> str:
        return self.precisions[0]


TARGETS: dict[str, Target] = {target.name: target for target in (
    Target("sm_89", (8, 9), ("RTX 4090", "L40S", "L4"), ("bf16", "fp16", "fp8"), workspace_bytes=4 * GiB),
    Target("sm_90", (9, 0), ("H100", "H200", "GH200"), ("bf16", "fp16", "fp8"), workspace_bytes=16 * GiB),
    Target("sm_100", (10, 0), ("B200", "GB200"), ("bf16", "fp16", "fp8", "nvfp4"), workspace_bytes=16 * GiB),
    Target("sm_120", (12, 0), ("RTX 5090", "RTX PRO 6000"), ("bf16", "fp16", "fp8", "nvfp4"),
           workspace_bytes=8 * GiB),
)}

# Where each precision first appears, for the refusal message.
_MINIMUM = {"fp8": ("8.9", "sm_89"), "nvfp4": ("10.0", "sm_100")}


def target_named(name: str) -> Target:
    if name not in TARGETS:
        raise TargetError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)} or 'auto'")
    return TARGETS[name]


def target_for_capability(capability: tuple[int, int], device_name: str = "this GPU") -> Target:
    for target in TARGETS.values():
        if target.compute_capability == tuple(capability):
            return target
    major, minor = capability
    raise TargetError(f"{device_name} has compute capability {major}.{minor}, which dlmrt has no recipe for "
                      f"(recipes: {', '.join(f'{t.name} ({t.gpus[0]})' for t in TARGETS.values())})")


def running_gpu() -> tuple[tuple[int, int], str] | None:
    """(compute capability, device name) of the current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability()), torch.cuda.get_device_name()


def resolve(name: str) -> Target:
    """The target called `name`, or with "auto" the running GPU's."""
    if name != "auto":
        return target_named(name)
    gpu = running_gpu()
    if gpu is None:
        raise TargetError("--target auto needs a CUDA GPU and none is visible: name the target "
                          f"({', '.join(TARGETS)}) to plan a build without one")
    return target_for_capability(*gpu)


def check_precision(target: Target, precision: str) -> None:
    if precision not in PRECISIONS:
        raise TargetError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if precision not in target.precisions:
        capability, first = _MINIMUM[precision]
        raise TargetError(
            f"{precision} needs compute capability {capability} or newer ({first} and up); {target.name} "
            f"({', '.join(target.gpus)}) is {'.'.join(map(str, target.compute_capability))}: choose one of "
            f"{', '.join(target.precisions)}")
