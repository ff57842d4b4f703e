"""What `--mode auto` runs on a CPU: `compile` where the work saves more time than compiling costs,
else `eager`.

Both modes run the model's larger matmuls on prepacked oneDNN weights; a compiled step also fuses the
elementwise ops between them and drops eager's per-op dispatch, about 1.2x faster (llada-512x6, 2 cores:
18.7 ms a forward against 22.3 ms). But each process pays about 5 s before its first compiled step even
when inductor's cache under $DLMRT_HOME holds the kernels (importing the compiler, tracing the step,
loading its kernels), and some 10-20 s more the first time a shape is compiled at all.
A one-off command on a small model is over before that is repaid; many prompts, long outputs or a big
model repay it many times.

So `auto` estimates both sides from the work the command is about to do: the matmul FLOPs of its
forwards (at most one token a step, every row the forward runs through), at eager's and at compiled
rates measured on the 2-core machine this project benchmarks on, against the warm cost. The estimate
errs toward compile (it counts every step a policy could take), and a cold cache costs the first run
more than the estimate says; later runs find the kernels cached. The rates and the cost are in
docs/device-loop.md, with the commands that measure them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dlmrt.models import Denoiser
from dlmrt.runtime import onednn
from dlmrt.runtime.layout import canvas_length
from dlmrt.runtime.settings import GenerationSettings

EAGER_FLOP_RATE = 290e9  # float32 matmul FLOP/s of an eager step (oneDNN, and eager's overheads)
EAGER_BLAS_FLOP_RATE = 150e9  # the same where eager's linears stay on torch's BLAS (not float32, no oneDNN)
COMPILED_FLOP_RATE = 350e9  # compiled: fused elementwise ops, no per-op dispatch
WARM_COMPILE_SECONDS = 5.0  # what a new process pays to compile, its kernels found in inductor's cache


@dataclass(frozen=True)
class Work:
    forwards: int  # forwards the command may run, summed over its batches
    rows: int  # positions a forward runs through the model: the batch's rows times the block (or canvas)


def work_of(model: Denoiser, settings: GenerationSettings, prompts: Sequence[Sequence[int]], max_batch: int,
            repeats: int = 1) -> Work:
    """The work of decoding `prompts` `repeats` times, in batches of at most `max_batch`."""
    batches = -(-len(prompts) // max_batch)
    total_steps = getattr(settings.policy, "total_steps", None)
    forwards = total_steps(settings) if total_steps is not None else settings.gen_length
    if settings.cache == "none":
        positions = canvas_length(prompts, settings.gen_length, settings.block_length, block_causal=model.block_causal)
    else:
        positions = settings.block_length
    return Work(forwards=forwards * batches * repeats, rows=min(len(prompts), max_batch) * positions)


def linear_weights(model: Denoiser) -> int:
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear))


def seconds_saved(model: Denoiser, work: Work) -> float:
    """What compiling would save on `work`, before paying for the compile."""
    flops = 2 * linear_weights(model) * work.rows * work.forwards
    eager_rate = EAGER_FLOP_RATE if onednn.available(model) else EAGER_BLAS_FLOP_RATE
    return flops * (1 / eager_rate - 1 / COMPILED_FLOP_RATE)


def auto_mode(model: Denoiser, work: Work) -> str:
    return "compile" if seconds_saved(model, work) > WARM_COMPILE_SECONDS else "eager"
