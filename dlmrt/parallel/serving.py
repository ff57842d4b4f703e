"""Serving a model split over ranks: one process, its rank 0, serves, and the other ranks follow its batches
(`dlmrt.parallel.lockstep`); ranks dlmrt starts, torchrun's, or those each Ray Serve replica leads.
Design: docs/parallelism.md, "Serving a split model".

`open_part(parallel)` opens a rank's part of the model, `(model, backend)` for a rank's `(ParallelPlan, Ranks)`;
it and everything else handed to the ranks is pickled into them (module-level functions, partials of them).
"""

from __future__ import annotations

import os
import signal
import sys


def serve_on_ranks(plan, device: str, open_part, run_server) -> None:
    """This process serves as rank 0 (`run_server(parallel, leader)`), and the other ranks follow its batches:
    ranks dlmrt starts (which end with it, and end it if one fails), or torchrun's."""
    from dlmrt.parallel import launch

    if launch.launched_by_torchrun():
        launch.run_as_launched_rank(_serve_or_follow, (plan, open_part, run_server), device=device)
        return
    ranks, followers = launch.lead(_follow, plan.world, (plan, open_part), device=device, on_failure=_abort)
    try:
        _lead(ranks, plan, run_server)
    finally:
        followers.join()


def build_split_app(plan, device: str, threads: int, open_part, build):
    """A replica of a model split over ranks, in its Ray actor: this process leads the ranks (each taking
    `threads` torch threads on a CPU), then builds the app (`build(parallel=, leader=)`) as their rank 0. A
    follower that fails ends the replica, which Ray replaces."""
    from dlmrt.parallel import launch
    from dlmrt.parallel.lockstep import Channel, Leader

    ranks, _ = launch.lead(_follow, plan.world, (plan, open_part), device=device, threads=threads, on_failure=_abort)
    return build(parallel=(plan, ranks), leader=Leader(Channel(ranks)))


def _lead(ranks, plan, run_server) -> None:
    """Rank 0: serve, and whichever way the server ends, stop the followers (the lifespan's stop, if it ran,
    has done it already)."""
    from dlmrt.parallel.lockstep import Channel, Leader

    leader = Leader(Channel(ranks))
    try:
        run_server((plan, ranks), leader)
    finally:
        leader.stop()


def _serve_or_follow(ranks, plan, open_part, run_server) -> None:
    """A torchrun rank: rank 0 serves, the others follow."""
    if ranks.rank == 0:
        _lead(ranks, plan, run_server)
    else:
        _follow(ranks, plan, open_part)


def _follow(ranks, plan, open_part) -> None:
    """A rank other than 0: its part of the model replays rank 0's batches until rank 0 stops."""
    from dlmrt.parallel.lockstep import Channel, follow

    # Ctrl-C, or a supervisor's SIGTERM to the whole process group, reaches every rank: rank 0 drains, then stops
    # this one (which fails out of its wait if rank 0 dies instead)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    channel = Channel(ranks)  # before the model loads: rank 0 stops this rank even if its own load fails
    _, backend = open_part((plan, ranks))
    follow(backend, channel)


def _abort(line: str) -> None:
    """A follower failed: the model is incomplete, so the server ends at once, with one line."""
    print(f"Error: {line}", file=sys.stderr, flush=True)
    os._exit(2)
