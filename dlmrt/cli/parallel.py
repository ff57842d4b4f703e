"""--tp and --ep, shared by `dlmrt generate` and `dlmrt serve`, and what is checked before any rank starts
(docs/parallelism.md)."""

from __future__ import annotations

import click


def parallel_options(command):
    command = click.option(
        "--ep", type=click.IntRange(min=1), default=1, show_default=True,
        help="Expert parallelism (MoE families): split the experts over this many ranks; with --tp above 1, "
             "equal to it.")(command)
    return click.option(
        "--tp", type=click.IntRange(min=1), default=1, show_default=True,
        help="Tensor parallelism: split every layer, and the vocabulary, over this many ranks (processes: gloo "
             "on a CPU, NCCL on GPUs). dlmrt starts them, or joins torchrun's (docs/parallelism.md).")(command)


def checked_plan(tp: int, ep: int, backend: str, model_dir, dtype: str, device: str):
    """(the ParallelPlan, the device its ranks run on), every check passed that can be made before a rank
    starts: the backend, torchrun's world, and the split of the model's module tree (read on the meta device)."""
    from dlmrt import TINY_MODEL_DIR
    from dlmrt.cli.backends import resolve_device
    from dlmrt.models.checkpoint import structure
    from dlmrt.parallel import launch
    from dlmrt.parallel.plan import ParallelPlan

    plan = ParallelPlan(tp, ep)
    plan.check_backend(backend)
    if launch.launched_by_torchrun():
        launch.require_torchrun_world(plan.world, "--tp/--ep")
    plan.check(structure(model_dir or TINY_MODEL_DIR, dtype=dtype))
    return plan, resolve_device(backend, device)
