"""The executor: K steps of a step program on a bucket's static buffers, written once for every backend.

    executor.prepare(state, program, steps)   # bind, compile or capture on first use; seconds spent
    executor.run(state, program, steps)       # enqueue the K steps, reading nothing back

Design notes: docs/runtime-modules.md#executor.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.core.home import keep_compiled_steps
from dlmrt.runtime import cuda_graphs

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend
    from dlmrt.runtime.static_buffers import StaticBuffers

MODES = ("eager", "compile", "cudagraph")
FAILURES = ("fall back", "explain", "raise")
# Graphs dynamo may hold for a compiled step function: one per bucket and program.
_RECOMPILE_LIMIT = 1024
_DO = {"compile": "compile", "cudagraph": "capture"}


class StepProgram(Protocol):
    """One kind of step: a pure, in-place function of a bucket's state, with no host read. Programs are
    hashable values (frozen dataclasses): equal programs share runners."""

    @property
    def binding_key(self) -> Hashable:
        """What the bound graphs of a state depend on (a backend that specializes its graphs further,
        `Backend.specializes`, keys on the whole program)."""

    def bind(self, backend: Backend, state: StaticBuffers) -> object:
        """The program's graphs bound to `state`'s buffers on `backend`."""

    def step(self, state: StaticBuffers, graphs: object) -> None:
        """One step on `state`, in place, through the bound `graphs`."""

    def describe(self, state: StaticBuffers) -> str:
        """The state's shape, for progress and error messages."""


class Executor:
    def __init__(self, backend: Backend, mode: str, on_failure: str,
                 on_compile: Callable[[str], None] | None = None):
        if mode not in MODES or on_failure not in FAILURES:
            raise ValueError(f"mode {mode!r} / on_failure {on_failure!r}: expected one of {MODES} / {FAILURES}")
        self.backend, self.mode, self.on_failure = backend, mode, on_failure
        self.on_compile = on_compile  # told what is compiled or captured, before it is
        self.bound: dict[tuple, object] = {}  # (state id, binding key) -> the program's bound graphs
        self._runners: dict[tuple, Callable[[], None]] = {}  # (state id, program, K) -> the K-step runner
        self._compiled: dict[Callable, Callable] = {}  # a program class's step -> its compiled function
        self._pool = None
        self._fallback_warned = False

    def prepare(self, state: StaticBuffers, program: StepProgram, steps: int) -> float:
        """Make `steps` back-to-back steps of `program` runnable on `state`: bind, compile or capture
        them on first use. Returns the seconds this call spent doing so."""
        key = (id(state), program, steps)
        if key in self._runners:
            return 0.0
        started = time.perf_counter()
        graphs = self.graphs(state, program)
        if self.mode != "eager" and self.on_compile is not None:
            self.on_compile(f"{_DO[self.mode]}: {steps} step(s) for {program.describe(state)} "
                            f"(once per shape per process)")
        try:
            runner = self._build(state, program, graphs, steps)
        except Exception as error:  # noqa: BLE001  (any compile or capture failure)
            runner = self._after_failure(error, state, program, graphs, steps)
        self._runners[key] = runner
        return time.perf_counter() - started

    @torch.no_grad()
    def run(self, state: StaticBuffers, program: StepProgram, steps: int) -> None:
        """Enqueue `steps` steps of `program` on `state`, in place, without reading anything back."""
        self.prepare(state, program, steps)
        self._runners[(id(state), program, steps)]()

    def graphs(self, state: StaticBuffers, program: StepProgram) -> object:
        """The program's graphs bound to `state` (bound on first use, kept with the state). A backend that
        specializes its graphs binds one set per program."""
        key = (id(state), program if self.backend.specializes else program.binding_key)
        if key not in self.bound:
            self.bound[key] = program.bind(self.backend, state)
        return self.bound[key]

    # -- building a runner per mode ---------------------------------------------------------------------
    @torch.no_grad()
    def _build(self, state, program: StepProgram, graphs, steps: int) -> Callable[[], None]:
        if self.mode == "compile":
            return self._compile(state, program, graphs, steps)
        run = self._eager(state, program, graphs, steps)
        if self.mode == "cudagraph":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            return cuda_graphs.capture(run, state, self.backend.spec.device, self._pool)
        return run

    def _eager(self, state, program: StepProgram, graphs, steps: int) -> Callable[[], None]:
        def run():
            for _ in range(steps):
                program.step(state, graphs)
        return self.backend.around_steps(run)

    def _compile(self, state, program: StepProgram, graphs, steps: int) -> Callable[[], None]:
        step = type(program).step
        if step not in self._compiled:
            keep_compiled_steps()
            self._compiled[step] = torch.compile(step, fullgraph=True, dynamic=False)
        compiled = self._compiled[step]
        saved = state.snapshot()
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=_RECOMPILE_LIMIT):
                # compiles, then runs: undone below
                self.backend.around_steps(lambda: compiled(program, state, graphs))()
        finally:
            state.restore(saved)

        def run():
            for _ in range(steps):
                compiled(program, state, graphs)
        return self.backend.around_steps(run)

    def _after_failure(self, error: Exception, state, program: StepProgram, graphs, steps: int):
        if self.mode == "eager" or self.on_failure == "raise":
            raise error
        shape = program.describe(state)
        if self.on_failure == "explain":
            raise ArgumentError(f"mode {self.mode!r} failed to {_DO[self.mode]} the step for {shape}: "
                                f"{type(error).__name__}: {_first_line(error)}; use --mode eager") from error
        if not self._fallback_warned:
            warnings.warn(f"dlmrt: the {self.mode} mode failed to {_DO[self.mode]} a step "
                          f"({type(error).__name__}: {_first_line(error)}); running eagerly instead",
                          RuntimeWarning, stacklevel=4)
            self._fallback_warned = True
        return self._eager(state, program, graphs, steps)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "no message"

