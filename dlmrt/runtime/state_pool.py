"""A backend's bucket states: each allocated once, lent to one running batch at a time.

    pool = StatePool(backend.spec, backend.cache_groups)
    state = pool.prepare(bucket, owner=batch)    # a DeviceState, or a UniformState for uniform noise
    pool.release(state)

Design notes: docs/runtime-modules.md#state_pool.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.device_state import DeviceState
from dlmrt.runtime.uniform_state import CacheGroup, UniformState

if TYPE_CHECKING:
    from dlmrt.runtime.model_spec import ModelSpec
    from dlmrt.runtime.buckets import Bucket


class StatePool:
    def __init__(self, spec: ModelSpec, cache_groups: Callable[[], tuple[CacheGroup, CacheGroup]]):
        """`cache_groups` gives a uniform-noise model's cache shapes (asked on its first bucket)."""
        self.spec, self.cache_groups = spec, cache_groups
        self.states: dict[Bucket, DeviceState | UniformState] = {}
        self._owners: dict[Bucket, weakref.ref] = {}

    def prepare(self, bucket: Bucket, owner: object) -> DeviceState | UniformState:
        """The static state of `bucket` (allocated on first use) for `owner`, a running batch: a
        DeviceState for a mask model's bucket, a UniformState for a uniform-noise model's.
        A bucket runs one batch at a time; it is free again once `release` was called or its owner
        is gone."""
        holder = self._owners.get(bucket)
        if holder is not None and holder() is not None and holder() is not owner:
            raise ArgumentError("this backend is already decoding a batch of the same shape: finish or close the "
                                "other generate stream first, or give each concurrent stream its own backend")
        if bucket not in self.states:
            self.states[bucket] = self._allocate(bucket)
        self._owners[bucket] = weakref.ref(owner)
        return self.states[bucket]

    def _allocate(self, bucket: Bucket) -> DeviceState | UniformState:
        if bucket.noise == "uniform":
            return UniformState.allocate(self.spec, bucket, self.cache_groups())
        return DeviceState.allocate(self.spec, bucket)

    def release(self, state: DeviceState | UniformState) -> None:
        self._owners.pop(state.bucket, None)
