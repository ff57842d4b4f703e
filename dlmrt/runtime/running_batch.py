"""A running batch: rows decoded block by block in one bucket's state, which rows join and leave at
block boundaries (continuous batching). One loop for every family; the noise kind's batch says where
rows sit in the bucket and what ends a block.

    batch = open_batch(backend, on_progress=show) # dlmrt.runtime.batches: a MaskBatch or a UniformBatch
    batch.add(tag, prompt, settings, seed=0)      # joins at the next block boundary
    batch.add(tag, prompt, settings, seed=0, provisional=True)  # show(progress) at every K-step boundary
    while batch.active:
        updates = batch.run_block()               # BlockUpdates; finished rows land in batch.finished

Design notes: docs/runtime-modules.md#running_batch.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batch_resources import resources
from dlmrt.runtime.metrics import GenerationMetrics
from dlmrt.runtime.settings import GenerationSettings
from dlmrt.runtime.text import completion


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


class TokenLogprob(NamedTuple):
    """A committed token's log-probability at the step that committed it, and the most likely tokens there
    (as many as its request asked for, the mask token aside), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability)


@dataclass(frozen=True)
class BlockUpdate:
    """Tokens of one row that became final when a block finished (cut at end-of-sequence)."""

    row: object  # the row's tag: its index in a generate call's prompts, or a server's request
    block: int  # the row's block, or -1 when it was cancelled
    token_ids: list[int]
    finish_reason: str | None  # "eos", "length" or "cancelled" once the row is done
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the row's settings ask


@dataclass(frozen=True)
class BlockProgress:
    """A row's current block as its steps have decided it so far, read at a K-step boundary: provisional,
    the block's BlockUpdate is what counts. Its tokens from the block's first output position up to
    the first end-of-sequence decided, None where a position is still undecided (a mask model's mask,
    a uniform-noise model's position before the block's first step); none once the row's completion
    has ended (a row with ignore_eos decodes on). Once the block's steps are over, the tokens equal
    its BlockUpdate's."""

    row: object
    block: int
    token_ids: list[int | None]


@dataclass(frozen=True)
class FinishedRow:
    tokens: list[int]  # gen_length ids: past a stop, the batch's fill (EOS, the mask id, or pad)
    finish_reason: str
    metrics: GenerationMetrics


def batch_key(settings: GenerationSettings) -> GenerationSettings:
    """What rows must agree on to share a batch. A row's temperature is its own: the sampling step
    draws for the rows whose temperature is above 0 and takes the argmax for the others; so are its
    logprobs: a block's steps record them while some row asks."""
    return replace(settings, gen_length=settings.block_length, seed=0, ignore_eos=False, temperature=0.0,
                   policy=settings.policy.shared(), logprobs=None)


@dataclass(kw_only=True)
class Row:
    """A row of the batch; each noise kind's batch adds where the row sits in its bucket."""

    tag: object
    settings: GenerationSettings
    params: dict[str, Any]  # its own policy parameters, by buffer name
    cancel: CancelToken | None
    prompt_length: int
    joined: float  # when it was added
    compile_at_join: float
    backend_at_join: float
    provisional: bool = False  # its progress is read at every K-step boundary (on_progress)
    block: int = 0  # its current block
    slot: int = -1
    emitted: int = 0
    ended: bool = False  # its completion reached a stop id (a row with ignore_eos decodes on past it)
    forwards: int = 0

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class BlockOutcome(NamedTuple):
    """What a block left of a row: its output so far, and how it ends (None: it goes on)."""

    settled: list[int]
    reason: str | None
    fill: int  # what the row's tokens hold past its output, once it has finished
    edits: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per settled token the row's steps committed, where it asks


@dataclass
class RunningBatch(ABC):
    backend: Backend
    on_step: Callable[[], None] | None = None
    on_progress: Callable[[list[BlockProgress]], None] | None = None
    rows: list[Row] = field(default_factory=list)  # in the batch
    waiting: list[Row] = field(default_factory=list)  # added, joining at the next block boundary
    finished: dict[object, FinishedRow] = field(default_factory=dict)
    # The ranks of a tensor-parallel model must take the same decisions: rank 0's cancel flags, on each
    agree: Callable[[list[bool]], list[bool]] | None = field(default=None, kw_only=True)
    key: GenerationSettings | None = None
    state: Any = None  # the bucket's static buffers
    executed: int = 0  # forwards run
    worked: int = 0  # forwards that did work (the status counter, as last read)
    backend_s: float = 0.0
    compile_s: float = 0.0

    def __post_init__(self):
        self.spec, self.resources = self.backend.spec, resources(self.backend)
        self.eos = set(self.spec.eos_ids)

    @property
    @abstractmethod
    def stop_ids(self) -> tuple[int, ...]:
        """Where a completion ends: at EOS, or where decoding stopped."""

    @abstractmethod
    def check_call(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings) -> None:
        """A generate call's clear errors, before any compute: its rows join at once, so one bucket
        must hold them all."""

    @property
    def active(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def capacity(self) -> int:
        return self.backend.ladder.batches()[-1]

    def accepts(self, settings: GenerationSettings) -> bool:
        return self.key is None or batch_key(settings) == self.key

    # -- rows in ------------------------------------------------------------------------------------
    def add(self, tag: object, prompt: Sequence[int], settings: GenerationSettings, *, seed: int,
            cancel: CancelToken | None = None, provisional: bool = False) -> None:
        """Queue a row (a checked request: `check_request`) to join at the next block boundary; with
        `provisional`, `on_progress` is told its block's progress at every K-step boundary."""
        if not self.accepts(settings):
            raise ArgumentError("a row's settings differ from the batch's in more than gen-length, seed, "
                                "ignore_eos, temperature and the policy's threshold or factor: run it in a "
                                "batch of its own")
        row = self._new_row(prompt, settings, seed, tag=tag, cancel=cancel, joined=time.perf_counter(),
                            compile_at_join=self.compile_s, backend_at_join=self.backend_s)
        row.provisional = provisional and self.on_progress is not None
        self.key = batch_key(settings)
        self.waiting.append(row)

    @abstractmethod
    def _new_row(self, prompt: Sequence[int], settings: GenerationSettings, seed: int, **common) -> Row:
        """The row of a request (its clear error, when no bucket holds it alone)."""

    @abstractmethod
    def _fits(self, rows: Sequence[Row]) -> bool:
        """Whether the largest bucket holds `rows` together."""

    @abstractmethod
    def _place(self, joining: Sequence[Row]) -> None:
        """Move the batch to a bucket that holds its rows and `joining`, and place `joining` in free slots."""

    def _enter(self, bucket: Any, reset: Callable[[Any], None],
               take_rows: Callable[[Any, Any, list[int]], None]) -> None:
        """Make `bucket`'s state the batch's: emptied (`reset(state)`) when no row runs, else holding the
        running rows, taken from the state they were in (`take_rows(state, old, slots)`) to slots 0, 1, ..."""
        old = self.state
        same = old is not None and old.bucket == bucket
        self.state = old if same else self.resources.pool.prepare(bucket, owner=self)
        if old is None or not self.rows:
            reset(self.state)
        else:
            take_rows(self.state, old, [row.slot for row in self.rows])
        if old is not None and old is not self.state:
            self.resources.pool.release(old)
        for slot, row in enumerate(self.rows):
            row.slot = slot

    def _place_waiting(self) -> None:
        """The waiting rows join, in order, while the batch and the largest bucket hold them."""
        joining = []
        for row in self.waiting[:self.capacity - len(self.rows)]:
            if not self._fits([*self.rows, *joining, row]):
                break
            joining.append(row)
        if joining:
            self.waiting = self.waiting[len(joining):]
            self._place(joining)
            self.rows = [*self.rows, *joining]

    # -- one block ----------------------------------------------------------------------------------
    def run_block(self) -> list[BlockUpdate]:
        """Admit waiting rows, run every row's current block, and retire the rows that finished. A row
        cancelled on the way leaves at the next K-step boundary (its update comes first)."""
        self._place_waiting()
        if not self.rows:
            return []
        left: list[BlockUpdate] = []
        cancelled = not self._run_steps(left)
        return [*left, *self._end_block(cancelled)]

    @abstractmethod
    def _start_block(self) -> tuple[int, int]:
        """Point the state at every row's current block; returns the block's step budget and the most
        positions a row has left to decode."""

    @abstractmethod
    def _calls(self, taken: int, steps: int) -> list[tuple[object, int]]:
        """The step programs that run the next `steps` steps, with their counts."""

    @abstractmethod
    def _read_progress(self, steps: int) -> tuple[int, int]:
        """The one host read per K steps: the most positions a row has left, and the forwards that did work."""

    @abstractmethod
    def _steps_per_sync(self, budget_left: int, remaining: int, taken: int) -> int:
        """K: the steps to run before the next host read."""

    def _steps_ended(self, taken: int, remaining: int, worked: int) -> None:
        """The block's steps are over: `taken` ran, `worked` of them did work."""

    def _count_forwards(self, rows: Sequence[Row], worked: int) -> None:
        """Add `worked` forwards of this block to `rows` (a batch that reads them from the device needs not)."""

    def _run_steps(self, left: list[BlockUpdate]) -> bool:
        """Run the block's steps until every row's block is done or the budget is spent. Rows cancelled
        on the way leave at the next K-step boundary, their updates added to `left`; False when every
        row was cancelled (they leave at the block's end, as the block ends there). Rows added with
        `provisional` have their progress read after every K steps."""
        budget, remaining = self._start_block()
        taken, worked_before = 0, self.worked
        watched = [row for row in self.rows if row.provisional]
        try:
            while taken < budget and remaining > 0:
                cancelled = self._cancelled(self.rows)
                if all(cancelled):
                    return False
                if any(cancelled):
                    remaining = self._leave_now(cancelled, self.worked - worked_before, left)
                    watched = [row for row in self.rows if row.provisional]
                    continue
                steps = self._steps_per_sync(budget - taken, remaining, taken)
                calls = [(kind, count) for kind, count in self._calls(taken, steps) if count]
                executor = self.resources.executor
                self.compile_s += sum(executor.prepare(self.state, kind, count) for kind, count in calls)
                tick = time.perf_counter()
                for kind, count in calls:
                    executor.run(self.state, kind, count)
                remaining, self.worked = self._read_progress(steps)
                self.backend_s += time.perf_counter() - tick
                taken += steps
                self.executed += steps
                if self.on_step is not None:
                    for _ in range(steps):
                        self.on_step()
                if watched:
                    self.on_progress(self._progress(watched))
            return True
        finally:
            self._steps_ended(taken, remaining, self.worked - worked_before)

    def _cancelled(self, rows: Sequence[Row]) -> list[bool]:
        """Which rows are cancelled, read once (another thread sets the flags), as every rank sees it."""
        flags = [row.cancelled for row in rows]
        return flags if self.agree is None else self.agree(flags)

    def _leave_now(self, cancelled: list[bool], worked: int, left: list[BlockUpdate]) -> int:
        """The `cancelled` rows leave in the middle of the block: their outcome is read (one host read),
        their slots become inert padding, and the others run on. Returns the most positions a row that
        stays has left."""
        gone = [row for row, out in zip(self.rows, cancelled) if out]
        self._count_forwards(gone, worked)
        for row, outcome in zip(gone, self._read_block(gone, [True] * len(gone))):
            left.append(self._update(row, -1, outcome))
            self._finish(row, outcome)
        self.rows = [row for row, out in zip(self.rows, cancelled) if not out]
        self.state.clear_rows([row.slot for row in gone])
        remaining, self.worked = self._read_progress(0)
        return remaining

    @abstractmethod
    def _read_drafts(self, rows: Sequence[Row]) -> list[list[int | None]]:
        """Each row's current block from its first output position as the steps left it, None where a
        position is undecided (one host read)."""

    def _progress(self, rows: Sequence[Row]) -> list[BlockProgress]:
        return [BlockProgress(row.tag, row.block, [] if row.ended else completion(draft, self.spec.eos_ids))
                for row, draft in zip(rows, self._read_drafts(rows))]

    # -- rows out -----------------------------------------------------------------------------------
    @abstractmethod
    def _read_block(self, rows: Sequence[Row], cancelled: list[bool]) -> list[BlockOutcome]:
        """Each of `rows`' outcome of the block (one host read); `cancelled` says which leave cancelled."""

    @abstractmethod
    def _advance(self, keep: list[Row], leaving: list[int]) -> None:
        """Move the rows in `keep` to their next block, and free the slots `leaving`."""

    @abstractmethod
    def _generated_tokens(self, settled: list[int], reason: str) -> int:
        """The tokens a finished row decoded."""

    def _end_block(self, every_row_cancelled: bool) -> list[BlockUpdate]:
        cancelled = [every_row_cancelled or out for out in self._cancelled(self.rows)]
        updates, keep, leaving = [], [], []
        for row, gone, outcome in zip(self.rows, cancelled, self._read_block(self.rows, cancelled)):
            update = self._update(row, -1 if gone else row.block, outcome)
            if update.token_ids or outcome.reason:
                updates.append(update)
            if outcome.reason is None:
                keep.append(row)
            else:
                self._finish(row, outcome)
                leaving.append(row.slot)
        self.rows = keep
        self._advance(keep, leaving)
        for row in keep:
            row.block += 1
        return updates

    def _update(self, row: Row, block: int, outcome: BlockOutcome) -> BlockUpdate:
        rest = outcome.settled[row.emitted:]
        new = completion(rest, self.stop_ids)
        logprobs = None if outcome.logprobs is None else outcome.logprobs[row.emitted:row.emitted + len(new)]
        row.emitted += len(new)
        row.ended = row.ended or len(new) < len(rest)
        return BlockUpdate(row.tag, block, new, outcome.reason, logprobs)

    def _finish(self, row: Row, outcome: BlockOutcome) -> None:
        """Record a finished row: its settled output, then the outcome's fill."""
        metrics = GenerationMetrics(
            nfe=row.forwards, sequence_forwards=row.forwards,
            generated_tokens=self._generated_tokens(outcome.settled, outcome.reason),
            prompt_tokens=row.prompt_length, batch_size=1, edits=outcome.edits,
            latency_s=time.perf_counter() - row.joined - (self.compile_s - row.compile_at_join),
            backend_s=self.backend_s - row.backend_at_join)
        tokens = outcome.settled + [outcome.fill] * (row.settings.gen_length - len(outcome.settled))
        self.finished[row.tag] = FinishedRow(tokens, outcome.reason, metrics)

    def close(self) -> None:
        """Give the bucket back (rows not finished are dropped)."""
        if self.state is not None:
            self.resources.pool.release(self.state)
            self.state = None
