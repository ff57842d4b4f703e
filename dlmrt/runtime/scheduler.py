"""Continuous batching for a server: requests join the running batch at block boundaries.

    scheduler = Scheduler(backend, max_waiting=64)
    ticket = scheduler.submit(prompt, settings, deliver)   # deliver(event) is called on the worker thread
    scheduler.submit(prompt, settings, deliver, provisional=True)  # BlockProgress events too, every K steps
    ticket.cancel()                                         # the row leaves at its next K-step boundary
    scheduler.run_between_blocks(work)                      # a concurrent Future of work() run on the worker
    scheduler.stop()                                        # after the requests admitted have finished
    Scheduler(backend, open_batch=leader.open_batch)        # a tensor-parallel model's rank 0 (dlmrt.parallel.lockstep)

Design notes: docs/runtime-modules.md#scheduler.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dlmrt.core.errors import DlmrtError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.running_batch import BlockProgress, BlockUpdate, FinishedRow, RunningBatch
from dlmrt.runtime.settings import GenerationSettings

TOKENS_PER_SECOND_WINDOW_S = 10.0


class QueueFull(DlmrtError):
    """The scheduler holds as many waiting requests as it may."""


class ShuttingDown(DlmrtError):
    """The scheduler is draining: it admits no new request."""


@dataclass(frozen=True)
class Finished:
    row: FinishedRow


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = BlockProgress | BlockUpdate | Finished | Failed


@dataclass
class Ticket:
    """A submitted request: `cancel()` makes its row leave the batch at its next K-step boundary (or
    before it joins)."""

    prompt: Sequence[int]
    settings: GenerationSettings
    deliver: Callable[[Event], None]
    provisional: bool = False  # BlockProgress events at every K-step boundary
    submitted: float = field(default_factory=time.monotonic)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancel.set()

    def is_set(self) -> bool:  # the row's cancel token
        return self._cancel.is_set()


@dataclass
class SchedulerStats:
    """Totals since start, for /metrics."""

    generated_tokens: int = 0  # tokens committed into completions (what the requests streamed)
    sequence_forwards: int = 0  # forwards summed over the rows that took part
    forwards: int = 0  # forwards of the batch
    finished: int = 0
    cancelled: int = 0  # rows that left the batch cancelled (their client went away, or timed out)
    failed: int = 0


class Scheduler:
    def __init__(self, backend: Backend, max_waiting: int = 64,
                 open_batch: Callable[..., RunningBatch] = open_batch):
        self.backend, self.max_waiting, self._open_batch = backend, max_waiting, open_batch
        self.stats = SchedulerStats()
        self._queue: collections.deque[Ticket] = collections.deque()
        self._batch: RunningBatch | None = None
        self._tickets: dict[int, Ticket] = {}  # running or joining, by tag
        self._tags = itertools.count()
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._between_blocks: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._lock = threading.Condition()
        self._draining = self._stopped = False
        self._worker = threading.Thread(target=self._work, name="dlmrt-scheduler", daemon=True)
        self._worker.start()

    # -- the caller's side --------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], settings: GenerationSettings, deliver: Callable[[Event], None],
               provisional: bool = False) -> Ticket:
        """Queue a checked request (`check_request`); raises QueueFull or ShuttingDown. With `provisional`,
        `deliver` also gets the row's BlockProgress after every K steps (`RunningBatch.add`)."""
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down: it takes no new request")
            if self.waiting >= self.max_waiting:
                raise QueueFull(f"the queue is full ({self.max_waiting} requests wait): retry later")
            ticket = Ticket(list(prompt), settings, deliver, provisional)
            self._queue.append(ticket)
            self._lock.notify()
        return ticket

    def run_between_blocks(self, work: Callable[[], object]) -> concurrent.futures.Future:
        """Run `work` on the worker, which owns the backend, before the next block (scoring a text, say);
        its Future holds what it returns or raises. Raises ShuttingDown."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down: it takes no new request")
            self._between_blocks.append((work, future))
            self._lock.notify()
        return future

    @property
    def waiting(self) -> int:
        """Requests not decoding yet: queued, or joining at the next block boundary."""
        batch = self._batch  # the worker may replace it meanwhile
        return len(self._queue) + (len(batch.waiting) if batch is not None else 0)

    @property
    def running_rows(self) -> int:
        batch = self._batch
        return len(batch.rows) if batch is not None else 0

    def tokens_per_second(self) -> float:
        """Committed tokens per second over the last few seconds."""
        with self._lock:
            self._forget_old_tokens()
            return sum(count for _, count in self._recent_tokens) / TOKENS_PER_SECOND_WINDOW_S

    def _forget_old_tokens(self) -> None:
        now = time.monotonic()
        while self._recent_tokens and self._recent_tokens[0][0] < now - TOKENS_PER_SECOND_WINDOW_S:
            self._recent_tokens.popleft()

    def stop(self, timeout: float | None = None) -> None:
        """Admit nothing more, let the requests already submitted finish, then end the worker."""
        with self._lock:
            self._draining = True
            self._lock.notify()
        self._worker.join(timeout)

    # -- the worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._between_blocks and not self._busy() and not self._draining:
                    self._lock.wait()
                if not self._queue and not self._between_blocks and not self._busy():
                    return  # draining, and nothing is left
                work, self._between_blocks = self._between_blocks, []
                self._admit()
            for run, future in work:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(run())
                    except Exception as error:  # the caller's to answer
                        future.set_exception(error)
            if self._busy():
                self._run_block()

    def _busy(self) -> bool:
        return self._batch is not None and self._batch.active

    def _admit(self) -> None:
        """Move queued requests into the batch (under the lock), in order, while they fit its settings."""
        if self._batch is not None and not self._batch.active:
            self._batch.close()
            self._batch = None
        while self._queue:
            ticket = self._queue[0]
            if self._batch is None:
                self._batch = self._open_batch(self.backend, on_progress=self._progressed)
            if not self._batch.accepts(ticket.settings):
                return
            self._queue.popleft()
            if ticket.is_set():  # cancelled while it waited: its caller has gone
                continue
            tag = next(self._tags)
            try:
                self._batch.add(tag, ticket.prompt, ticket.settings, seed=ticket.settings.seed, cancel=ticket,
                                provisional=ticket.provisional)
            except Exception as error:  # a row that cannot join fails alone
                self._fail(ticket, error)
                continue
            self._tickets[tag] = ticket

    def _run_block(self) -> None:
        batch = self._batch
        worked = batch.worked
        try:
            updates = batch.run_block()
        except Exception as error:
            for tag in [row.tag for row in (*batch.rows, *batch.waiting)]:
                self._fail(self._tickets.pop(tag), error)
            with self._lock:
                batch.close()
                self._batch = None
            return
        rows_ran = len(batch.rows) + sum(1 for update in updates if update.finish_reason is not None)
        self._count(updates, batch.worked - worked, (batch.worked - worked) * rows_ran)
        for update in updates:
            _deliver(self._tickets[update.row], update)
        for tag in [tag for tag in batch.finished if tag in self._tickets]:
            row = batch.finished.pop(tag)
            _deliver(self._tickets.pop(tag), Finished(row))
            self.stats.finished += 1
            self.stats.cancelled += row.finish_reason == "cancelled"

    def _progressed(self, progress: list[BlockProgress]) -> None:
        for row in progress:
            _deliver(self._tickets[row.row], row)

    def _count(self, updates: list[BlockUpdate], forwards: int, sequence_forwards: int) -> None:
        tokens = sum(len(update.token_ids) for update in updates)
        with self._lock:
            self.stats.generated_tokens += tokens
            self.stats.forwards += forwards
            self.stats.sequence_forwards += sequence_forwards
            self._recent_tokens.append((time.monotonic(), tokens))
            self._forget_old_tokens()

    def _fail(self, ticket: Ticket, error: BaseException) -> None:
        self.stats.failed += 1
        _deliver(ticket, Failed(error))


def _deliver(ticket: Ticket, event: Event) -> None:
    """Hand `event` to the request; a request whose listener has gone (its event loop closed) is cancelled."""
    try:
        ticket.deliver(event)
    except Exception:
        ticket.cancel()
