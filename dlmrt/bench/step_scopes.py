"""The rows of a roofline: which group each op of a step runs in, for the counter on meta tensors and
for the profiler on a device alike.

A group is the innermost module running, named by its path inside the step's denoiser with layer and
expert indices collapsed (`transformer.blocks.*.q_proj`); the denoiser's own ops (rotary tables, the
attention mask, the K/V stack) are `denoiser`, and the step graph's own ops (the logits' float32
copy and the parallel unmask) are `unmask`. An attention kernel is a row of its own inside its group
(`... (attention)`), so that it is not lost among the group's elementwise ops. Each group is also a
`record_function` scope named `SCOPE + group`, which is how the profiler's events find their row.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

SCOPE = "roofline:"
UNMASK, DENOISER = "unmask", "denoiser"
ATTENTION = "scaled_dot_product"  # in the name of every SDPA op and of its kernels' launching op


def group_name(path: str) -> str:
    """`model.transformer.blocks.3.q_proj` -> `transformer.blocks.*.q_proj`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path.removeprefix("model."))


def row_name(group: str, op: str) -> str:
    return f"{group} (attention)" if ATTENTION in op else group


class GroupScopes:
    """While entered, `current` is the group of the op running inside `step` (a StepGraph), and each
    group's ops run inside its record_function scope."""

    def __init__(self, step: nn.Module):
        self._names = {id(module): group_name(path) for path, module in step.model.named_modules() if path}
        self._names[id(step)] = UNMASK
        self._model = step.model
        self._stack: list[tuple[str, torch.profiler.record_function]] = []
        self._handles = []

    @property
    def current(self) -> str:
        return self._stack[-1][0] if self._stack else UNMASK

    def push(self, group: str) -> None:
        scope = torch.profiler.record_function(SCOPE + group)
        scope.__enter__()
        self._stack.append((group, scope))

    def pop(self) -> None:
        self._stack.pop()[1].__exit__(None, None, None)

    @contextlib.contextmanager
    def scope(self, group: str) -> Iterator[None]:
        """Ops inside run in `group` (a computation that stands for modules it does not call)."""
        self.push(group)
        try:
            yield
        finally:
            self.pop()

    def _entered(self, module: nn.Module, args) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self.push(name)

    def _left(self, module: nn.Module, args, output) -> None:
        if id(module) in self._names:
            self.pop()

    def _denoise(self, *args, **kwargs):
        with self.scope(DENOISER):
            return type(self._model).denoise(self._model, *args, **kwargs)

    def __enter__(self) -> GroupScopes:
        self._model.denoise = self._denoise  # the step graph calls it, not the module: no hook sees it
        self._handles = [module_hooks.register_module_forward_pre_hook(self._entered),
                         module_hooks.register_module_forward_hook(self._left, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        del self._model.denoise
        while self._stack:
            self.pop()
