"""What every running batch over one backend shares: the bucket states it lends, and the executor that
runs step programs on them.

    held = resources(backend)                       # made on first use, kept while the backend lives
    state = held.pool.prepare(bucket, owner=batch)
    compile_s = held.executor.prepare(state, program, steps)
    held.executor.run(state, program, steps)

Design notes: docs/runtime-modules.md#batch_resources.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlmrt.runtime.executor import Executor
from dlmrt.runtime.state_pool import StatePool

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend


@dataclass
class Resources:
    pool: StatePool
    executor: Executor


_HELD: weakref.WeakKeyDictionary[Backend, Resources] = weakref.WeakKeyDictionary()


def resources(backend: Backend) -> Resources:
    """The backend's shared resources: one set per backend, so that every generate call, server and
    rank over it runs in the same bucket states (one bucket runs one batch at a time) and reuses what
    the executor bound, compiled and captured for them."""
    held = _HELD.get(backend)
    if held is None:
        held = _HELD[backend] = Resources(StatePool(backend.spec, backend.cache_groups),
                                          Executor(backend, backend.mode, backend.on_failure, backend.on_compile))
    return held
