"""Starting the ranks of a parallel run, or joining the ones torchrun started, and ending them together.

    results = run_ranks(job, world=2, args=(...,))    # job(ranks, *args) in each of 2 processes
    if launched_by_torchrun(): result = run_as_launched_rank(job, args)
    ranks, followers = lead(job, world=2, args=(...,), on_failure=report)  # this process is rank 0

Each rank is a process (torch.multiprocessing, spawned) that joins one process group: gloo on a CPU,
NCCL on CUDA. `run_ranks` returns every rank's result in rank order. A rank that raises, dies or
stops answering ends the run on every rank: the others are terminated, and one `RankFailure` names
the first rank that failed and why. A collective that waits past `timeout` fails on its rank the
same way. The ranks get a share of the CPU's threads each, so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import re
import signal
import socket
import threading
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


@contextlib.contextmanager
def _local_rendezvous():
    """MASTER_ADDR and MASTER_PORT of a new group on this machine (a free port), for the processes started and
    the group joined meanwhile; the environment as it was afterwards."""
    previous = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for name, value in previous.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_rank(rank: int, world: int, device: str, timeout: timedelta, threads: int | None = None):
    """Join the process group as `rank` (its address is in the environment) and return its Ranks. On a CPU
    the rank takes `threads` torch threads (default: its share of the machine's cores)."""
    import torch
    import torch.distributed as dist

    from dlmrt.parallel.ranks import Ranks

    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's rank on this node
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(_backend_for(device), rank=rank, world_size=world, timeout=timeout)
    return Ranks(rank, world)


def _rank_main(rank: int, job: Callable, args: tuple, world: int, device: str, timeout: timedelta,
               results, threads: int | None = None) -> None:
    import torch.distributed as dist

    try:
        ranks = init_rank(rank, world, device, timeout, threads)
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
    with _local_rendezvous():
        processes = mp.start_processes(_rank_main, args=(job, args, world, device, timeout, results),
                                       nprocs=world, join=False, start_method="spawn")
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


class Followers:
    """Ranks 1, 2, ... of a group led by this process, each running its job in a process of its own.

    A follower that fails (raises, or dies) before `join` is called fails the whole group: the other
    followers are killed, and `on_failure` gets one line naming it, on a watcher thread. A job that
    returns is a follower's normal end."""

    def __init__(self, processes, reports, world: int, timeout: timedelta, on_failure: Callable[[str], None]):
        self._processes, self._reports, self._world = processes, reports, world
        self._timeout, self._on_failure = timeout, on_failure
        self._joining = threading.Event()
        self._reaped: set[int] = set()
        self._watcher = threading.Thread(target=self._watch, name="dlmrt-followers", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """The one thread that reaps the followers (two would race for their exit codes)."""
        sentinels = {process.sentinel: process for process in self._processes}
        while sentinels:
            for ended in multiprocessing.connection.wait(list(sentinels)):
                process = sentinels.pop(ended)
                process.join()
                self._reaped.add(process.pid)
                if process.exitcode != 0 and not self._joining.is_set():
                    self.kill()
                    self._on_failure(self._why(self._processes.index(process) + 1, process.exitcode))
                    return

    def _why(self, rank: int, exit_code: int) -> str:
        try:
            _, kind, value = self._reports[rank - 1].recv()
        except EOFError:  # it died without a word
            kind = value = None
        cause = f"failed: {value}" if kind == "error" else _how_it_ended(exit_code)
        return f"rank {rank} {cause}; every rank of {self._world} was stopped"

    def join(self) -> None:
        """Wait for the followers to end (after the leader has told them to); kill any left after the timeout."""
        self._joining.set()
        self._watcher.join(self._timeout.total_seconds())
        self.kill()

    def kill(self) -> None:
        """SIGKILL to every follower still running (a follower may ignore SIGTERM and SIGINT, waiting for its
        leader's word). The watcher alone reaps them."""
        for process in self._processes:
            if process.pid not in self._reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)


class _Report:
    """A follower's end of its own pipe to the leader, as `_rank_main` reports: a pipe rather than a queue,
    which holds semaphores that a leader ending with os._exit would leave behind (and be warned about)."""

    def __init__(self, connection):
        self.connection = connection

    def put(self, item) -> None:
        self.connection.send(item)


def _follower_main(index: int, job: Callable, args: tuple, world: int, device: str, timeout: timedelta,
                   reports: list, threads: int | None) -> None:
    _rank_main(index + 1, job, args, world, device, timeout, _Report(reports[index]), threads)


def lead(job: Callable, world: int, args: tuple = (), *, device: str = "cpu", timeout: timedelta = DEFAULT_TIMEOUT,
         threads: int | None = None, on_failure: Callable[[str], None]):
    """Make this process rank 0 of a new group of `world`, whose ranks 1, 2, ... run `job(ranks, *args)` in
    new processes: (this process's Ranks, their Followers). On a CPU each rank takes `threads` torch threads
    (default: its share of the machine's cores). `on_failure(line)` is called if a follower ends before
    `Followers.join`: by then every other follower has been killed."""
    import torch.multiprocessing as mp

    pipes = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(world - 1)]
    with _local_rendezvous():
        processes = mp.start_processes(_follower_main, args=(job, args, world, device, timeout,
                                                             [sending for _, sending in pipes], threads),
                                       nprocs=world - 1, join=False, start_method="spawn").processes
        for _, sending in pipes:  # the followers' own now: a follower that dies closes its pipe
            sending.close()
        followers = Followers(processes, [receiving for receiving, _ in pipes], world, timeout, on_failure)
        try:
            return init_rank(0, world, device, timeout, threads), followers
        except BaseException:
            followers.kill()
            raise
