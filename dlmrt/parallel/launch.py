"""Starting the ranks of a parallel run, or joining the ones torchrun started, and ending them together.

    results = run_ranks(job, world=2, args=(...,))    # job(ranks, *args) in each of 2 processes
    if launched_by_torchrun(): result = run_as_launched_rank(job, args)

Each rank is a process (torch.multiprocessing, spawned) that joins one process group: gloo on a CPU,
NCCL on CUDA. `run_ranks` returns every rank's result in rank order. A rank that raises, dies or
stops answering ends the run on every rank: the others are terminated, and one `RankFailure` names
the first rank that failed and why. A collective that waits past `timeout` fails on its rank the
same way. The ranks get a share of the CPU's threads each, so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dlmrt.core.errors import DlmrtError

# How long a collective waits for the other ranks: past it, its rank fails and the run ends. A rank's first
# collective waits out the others' model loads and compiles, hence minutes, as NCCL's own default.
DEFAULT_TIMEOUT = timedelta(minutes=5)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankFailure(DlmrtError):
    """A rank of a parallel run failed; every rank was stopped."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def require_torchrun_world(world: int, flags: str) -> None:
    """Under torchrun, its WORLD_SIZE must be the world the flags ask for."""
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world:
        raise DlmrtError(f"torchrun started {launched} ranks, but {flags} ask for {world}: run torchrun with "
                         f"--nproc-per-node {world}, or change the flags")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_rank(rank: int, world: int, device: str, timeout: timedelta):
    """Join the process group as `rank` (its address is in the environment) and return its Ranks."""
    import torch
    import torch.distributed as dist

    from dlmrt.parallel.ranks import Ranks

    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's rank on this node
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(_backend_for(device), rank=rank, world_size=world, timeout=timeout)
    return Ranks(rank, world)


def _rank_main(rank: int, job: Callable, args: tuple, world: int, device: str, timeout: timedelta,
               results) -> None:
    import torch.distributed as dist

    try:
        ranks = init_rank(rank, world, device, timeout)
        # pickled here, so that tensors travel by value rather than as shared memory of an exiting process
        results.put((rank, "result", pickle.dumps(job(ranks, *args))))
    except BaseException as error:  # reported to the launcher, which ends every rank
        results.put((rank, "error", describe(error, timeout)))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def describe(error: BaseException, timeout: timedelta) -> str:
    """One line for a rank's error: a user error as it is, a collective's timeout said plainly, anything
    else by its type and the last line of its message (gloo prefixes the C++ source location)."""
    if isinstance(error, DlmrtError):
        return str(error)
    if hasattr(error, "format_message"):  # a click usage error
        return error.format_message()
    lines = str(error).strip().splitlines() or [""]
    message = re.sub(r"^\[[^\]]*\] ", "", lines[-1])
    if "timed out" in message.lower() or "timeout" in message.lower():
        return (f"a collective waited longer than {timeout.total_seconds():g} s for the other ranks ({message}): "
                f"a rank stopped answering")
    return f"{type(error).__name__}: {message}"


def run_as_launched_rank(job: Callable, args: tuple = (), *, device: str = "cpu",
                         timeout: timedelta = DEFAULT_TIMEOUT) -> Any:
    """`job(ranks, *args)` in a process torchrun started; torchrun ends the others if this one fails."""
    import torch.distributed as dist

    ranks = init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, timeout)
    try:
        return job(ranks, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(job: Callable, world: int, args: tuple = (), *, device: str = "cpu",
              timeout: timedelta = DEFAULT_TIMEOUT) -> list[Any]:
    """`job(ranks, *args)` on `world` new processes; every rank's result, in rank order.

    `job` and `args` are pickled into the ranks (a module-level function, plain data)."""
    import torch.multiprocessing as mp

    # torch logs each rank it terminates; the one RankFailure below says what happened
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    previous = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        processes = mp.start_processes(_rank_main, args=(job, args, world, device, timeout, results),
                                       nprocs=world, join=False, start_method="spawn")
    finally:
        for name, value in previous.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    received: dict[int, Any] = {}
    reported: dict[int, str] = {}

    def drain() -> None:
        while not results.empty():
            rank, kind, value = results.get()
            if kind == "result":
                received[rank] = pickle.loads(value)
            else:
                reported[rank] = value

    try:
        while True:
            drain()
            try:
                if processes.join(timeout=0.2):
                    break
            except (mp.ProcessExitedException, mp.ProcessRaisedException):
                break  # join has already stopped the other ranks
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.terminate()
        for process in processes.processes:
            process.join()
    drain()
    cause = _first_failure(world, received, reported, [p.exitcode for p in processes.processes])
    if cause is not None:
        raise RankFailure(f"{cause}; every rank of {world} was stopped")
    return [received[rank] for rank in range(world)]


def _first_failure(world: int, received: dict[int, Any], reported: dict[int, str],
                   exit_codes: list[int | None]) -> str | None:
    """Why the run failed: a rank that died without a word is the cause (the others' errors, such as a
    closed connection, follow from it); else the lowest rank's own error."""
    for rank in range(world):
        code = exit_codes[rank]
        if rank not in received and rank not in reported and code not in (0, -signal.SIGTERM, None):
            return f"rank {rank} {_how_it_ended(code)}"
    if reported:
        rank = min(reported)
        return f"rank {rank} failed: {reported[rank]}"
    return None


def _how_it_ended(exit_code: int) -> str:
    if exit_code is not None and exit_code < 0:
        return f"was killed by {signal.Signals(-exit_code).name}"
    return f"exited with status {exit_code}"
