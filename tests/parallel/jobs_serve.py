"""What the serving tests run on each rank (module-level, so that spawned ranks can unpickle it): a scheduler's
requests on rank 0, which the other ranks follow (dlmrt.parallel.lockstep), or on one process."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dlmrt.runtime.batch_resources import resources
from dlmrt.parallel.lockstep import Channel, Leader, follow
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.runtime import GenerationSettings, text
from dlmrt.runtime.scheduler import Finished, Scheduler
from dlmrt.runtime.torch_backend import TorchBackend


@dataclass(frozen=True)
class Request:
    prompt: str
    settings: GenerationSettings
    cancel_after_first_block: bool = False


def scheduled(ranks, make_model, plan: ParallelPlan | None, requests: list[Request]) -> dict:
    """Each request submitted when the one before gets its first event (so that it joins a running batch at
    a block boundary, or waits for a batch of its settings), on a scheduler over the model split by `plan`
    (`ranks` None: one process). Rank 0 and one process give every request's events (its updates, then its
    finished row) and the logprobs of its tokens, where it asks; every rank gives the step calls its backend
    ran."""
    model = make_model()
    if ranks is not None:
        plan.apply(model, ranks)
    backend = TorchBackend(model, mode="eager", max_batch=4)
    runs = []
    run = resources(backend).executor.run
    resources(backend).executor.run = lambda state, kind, count: (runs.append(count), run(state, kind, count))[1]
    if ranks is not None and ranks.rank > 0:
        follow(backend, Channel(ranks))
        return {"runs": runs}
    leader = Leader(Channel(ranks)) if ranks is not None else None
    scheduler = Scheduler(backend) if leader is None else Scheduler(backend, open_batch=leader.open_batch)
    events, logprobs, tickets = [[] for _ in requests], [[] for _ in requests], {}
    finished, submitting = threading.Event(), threading.Lock()

    def submit(index: int) -> None:
        request = requests[index]
        with submitting:
            tickets[index] = scheduler.submit(text.encode(model, request.prompt), request.settings,
                                              lambda event: deliver(index, event))

    def deliver(index: int, event) -> None:
        events[index].append(_plain(event))
        logprobs[index] += [(entry.logprob, entry.top) for entry in getattr(event, "logprobs", None) or []]
        if len(events[index]) == 1:
            if requests[index].cancel_after_first_block:
                with submitting:
                    tickets[index].cancel()
            if index + 1 < len(requests):
                submit(index + 1)
        if all(row and row[-1][0] == "finished" for row in events):
            finished.set()

    submit(0)
    assert finished.wait(120), events
    scheduler.stop()
    if leader is not None:
        leader.stop()
    return {"events": events, "logprobs": logprobs, "runs": runs}


def _plain(event) -> tuple:
    if isinstance(event, Finished):
        return "finished", event.row.tokens, event.row.finish_reason
    return "update", event.block, event.token_ids, event.finish_reason
