"""Serving a tensor-parallel model: rank 0 runs the scheduler, and every other rank replays its batches.

    channel = Channel(ranks)                                 # on every rank, in the same order
    leader = Leader(channel)                                 # rank 0
    scheduler = Scheduler(backend, open_batch=leader.open_batch)
    ...; scheduler.stop(); leader.stop()                     # the followers return
    follow(backend, channel)                                 # ranks 1, 2, ...: until rank 0 stops

Every forward of a split model is a collective, so every rank must run the same forwards on the same
batch, in the same order. The decode loop is deterministic given what goes into it, and every rank
finishes each step from the same gathered numbers (dlmrt.parallel.vocab), so rank 0 sends only what
comes from outside the loop: the batches it opens and closes, the rows it adds (prompt, settings,
seed), when it runs a block, and which rows are cancelled at each K-step boundary (a client gone, a
deadline passed). What a block needs travels in one message before it runs; the cancel flags in one
per K steps.

The messages go over a gloo group of their own (beside NCCL on CUDA) whose wait is practically
unbounded: a follower waits for the next request as long as the server stays idle. A follower that
stops answering shows on rank 0 as the model's own collective timing out; a rank 0 that is gone
closes the channel, and the follower fails out of its wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dlmrt.parallel.ranks import Ranks
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.running_batch import BlockProgress, RunningBatch
from dlmrt.runtime.settings import GenerationSettings

# How long a follower waits for rank 0's next message: an idle server sends none.
IDLE_WAIT = timedelta(days=365)


class Channel:
    """Rank 0's messages to the other ranks of `ranks`' group."""

    def __init__(self, ranks: Ranks, timeout: timedelta = IDLE_WAIT):
        self.rank = ranks.rank
        self._group = dist.new_group(backend="gloo", timeout=timeout)

    def share(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (the others' `value` is ignored)."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


class Leader:
    """Rank 0's side: the batches it opens are replayed on every follower."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self._pending: list[tuple] = []  # sent with the next block (or stop)
        self.stopped = False

    def open_batch(self, backend: Backend, on_progress: Callable[[list[BlockProgress]], None] | None = None):
        self.queue("open")
        return _LeaderBatch(self, open_batch(backend, on_progress=on_progress, agree=self.channel.share))

    def queue(self, *message) -> None:
        """`message` goes with the next one sent."""
        self._pending.append(message)

    def send(self, *message) -> None:
        """`message`, after those queued, to every follower now."""
        self.queue(*message)
        messages, self._pending = self._pending, []
        self.channel.share(messages)

    def stop(self) -> None:
        """End the followers (after the scheduler has stopped); once."""
        if not self.stopped:
            self.stopped = True
            self.send("stop")


class _LeaderBatch:
    """A running batch on rank 0 whose rows in, blocks and close reach the followers."""

    def __init__(self, leader: Leader, batch: RunningBatch):
        self._leader, self._batch = leader, batch

    def __getattr__(self, name: str):
        return getattr(self._batch, name)

    def add(self, tag: object, prompt: Sequence[int], settings: GenerationSettings, *, seed: int, **options) -> None:
        self._batch.add(tag, prompt, settings, seed=seed, **options)  # a row that cannot join raises here, unsent
        self._leader.queue("add", tag, list(prompt), settings, seed)

    def run_block(self):
        self._leader.send("run_block")
        return self._batch.run_block()

    def close(self) -> None:
        self._leader.queue("close")
        self._batch.close()


def follow(backend: Backend, channel: Channel) -> None:
    """Replay rank 0's batches on this rank's part of the model, until rank 0 stops."""
    batch = None
    while True:
        for operation, *arguments in channel.share(None):
            if operation == "open":
                batch = open_batch(backend, agree=channel.share)
            elif operation == "add":
                tag, prompt, settings, seed = arguments
                batch.add(tag, prompt, settings, seed=seed)
            elif operation == "run_block":
                batch.run_block()
                batch.finished.clear()
            elif operation == "close":
                batch.close()
                batch = None
            else:  # "stop"
                if batch is not None:
                    batch.close()
                return
