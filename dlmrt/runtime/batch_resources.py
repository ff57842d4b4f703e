"""What every running batch over one backend shares: the bucket states it lends.

    held = resources(backend)                       # made on first use, kept while the backend lives
    state = held.pool.prepare(bucket, owner=batch)

Design notes: docs/runtime-modules.md#batch_resources.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlmrt.runtime.state_pool import StatePool

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend


@dataclass
class Resources:
    pool: StatePool


_HELD: weakref.WeakKeyDictionary[Backend, Resources] = weakref.WeakKeyDictionary()


def resources(backend: Backend) -> Resources:
    """The backend's shared resources: one set per backend, so that every generate call, server and
    rank over it runs in the same bucket states (and one bucket runs one batch at a time)."""
    held = _HELD.get(backend)
    if held is None:
        held = _HELD[backend] = Resources(StatePool(backend.spec, backend.cache_groups))
    return held
