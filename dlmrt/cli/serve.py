"""`dlmrt serve`: the OpenAI-compatible server (`dlmrt.serve.app`) on uvicorn, logging through uvicorn's
loggers at --log-level (at info: the model served, the address, a line a request), under the transport's
limits (`dlmrt.serve.transport`). SIGTERM drains the server and exits with status 0.

With --replicas N, the same app in N replicas on Ray Serve behind its proxy (`dlmrt.serve.replicas`,
the `ray` extra); without it, Ray is never imported."""

from __future__ import annotations

import copy
import functools
import os
import signal

import click

from dlmrt.cli.backends import BACKENDS
from dlmrt.cli.errors import UserError, reports_errors, require_ray_extra, require_serve_extra
from dlmrt.cli.model_param import model_param
from dlmrt.cli.parallel import checked_plan, parallel_options

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


class ReplicaRange(click.ParamType):
    """MIN:MAX replicas for autoscaling: 1 <= MIN <= MAX."""

    name = "MIN:MAX"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        low, colon, high = str(value).partition(":")
        if not (colon and low.strip().isdigit() and high.strip().isdigit()):
            self.fail(f"{value!r} is not MIN:MAX (two whole numbers, as 1:4)", param, ctx)
        low, high = int(low), int(high)
        if not 1 <= low <= high:
            self.fail(f"{value!r}: give 1 <= MIN <= MAX", param, ctx)
        return low, high


@click.command("serve")
@model_param(help="A model directory, or an export for --backend ort/trt [default: the tiny model].")
@click.option("--backend", type=click.Choice(BACKENDS), default="torch", show_default=True)
@click.option("--mode", type=click.Choice(("auto", "eager", "compile", "cudagraph")), default="auto",
              show_default=True, help="torch backend: how the steps run. auto: CUDA graphs on a GPU, eager on a CPU "
                                      "(compile would stall the running batch while each new batch shape "
                                      "compiles).")
@click.option("--device", type=click.Choice(("auto", "cpu", "cuda")), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(("auto", "float32", "bfloat16", "float16")), default="float32",
              show_default=True)
@click.option("--max-batch", type=click.IntRange(1), default=64, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-queue", type=click.IntRange(1), default=64, show_default=True,
              help="Requests that may wait; one more gets 429.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds from a request's arrival to its last token; past it, 504.")
@click.option("--max-body-bytes", type=click.IntRange(1), default=1 << 20, show_default=True,
              help="The largest request body, counted as it arrives (chunked too); one byte more gets 413.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds for a request's headers, from the connection's start or the request's first byte; "
                   "past it, 408 and the connection closes.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds for a request's body, from the end of its headers; past it, 408.")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an idle connection stays open between requests.")
@click.option("--max-connections", type=click.IntRange(1), default=512, show_default=True,
              help="Open connections; a connection over it gets 503 and is closed.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=25.0, show_default=True,
              help="Seconds the running requests get to finish after SIGTERM; then they are cancelled.")
@click.option("--served-model-name", default=None, help="The name clients use [default: the model's].")
@click.option("--allowed-origins", default=None, metavar="ORIGIN,... | *",
              help="Web origins (scheme://host[:port], comma-separated) whose pages may call the API from a "
                   "browser (CORS), or * for any [default: none; programs other than browsers are not "
                   "affected].")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True,
              help="uvicorn's and dlmrt's: info logs the model, the address it listens on, and a line a request.")
@click.option("--replicas", type=click.IntRange(1), default=None,
              help="Serve N replicas of the model on Ray Serve (the ray extra), each with its own batch, behind "
                   "one address; one GPU each on CUDA [default: one process, no Ray].")
@click.option("--threads-per-replica", type=click.IntRange(1), default=None,
              help="With --replicas: torch threads in each replica [default: the CPUs divided among the "
                   "replicas (the most, with --autoscale), at least 1].")
@click.option("--autoscale", type=ReplicaRange(), default=None, metavar="MIN:MAX",
              help="With --replicas N: let Ray Serve scale between MIN and MAX replicas, from N, aiming at "
                   "--max-batch requests a replica.")
@parallel_options
@reports_errors
def serve_command(model_dir, backend, mode, device, dtype, max_batch, host, port, max_queue, request_timeout,
                  max_body_bytes, header_timeout, body_timeout, keep_alive_timeout, max_connections, shutdown_timeout,
                  served_model_name, allowed_origins, log_level, replicas, threads_per_replica, autoscale, tp, ep):
    """Serve the model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics), with continuous batching at block boundaries."""
    require_serve_extra()
    if replicas is None and (threads_per_replica is not None or autoscale is not None):
        raise click.UsageError("--threads-per-replica and --autoscale apply with --replicas N")
    if autoscale is not None and not autoscale[0] <= replicas <= autoscale[1]:
        raise click.UsageError(f"--replicas {replicas} is the count at start: it lies within --autoscale "
                               f"{autoscale[0]}:{autoscale[1]}")
    if replicas is not None:
        require_ray_extra()
    import uvicorn

    from dlmrt.serve.app import ServerLimits, build_app
    from dlmrt.serve.cors import parse_origins
    from dlmrt.serve.transport import server_config

    limits = ServerLimits(max_queue=max_queue, request_timeout_s=request_timeout, max_body_bytes=max_body_bytes,
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                          keep_alive_s=keep_alive_timeout, max_connections=max_connections,
                          shutdown_timeout_s=shutdown_timeout)
    opening = {"backend": backend, "model_dir": model_dir, "mode": mode, "device": device, "dtype": dtype,
               "max_batch": max_batch}
    open_model = functools.partial(open_served, opening)
    build = functools.partial(build_app, open_model, model_dir, limits=limits, served_model_name=served_model_name,
                              allowed_origins=parse_origins(allowed_origins))
    checked = checked_plan(tp, ep, backend, model_dir, dtype, device) if max(tp, ep) > 1 else None
    if replicas is not None:
        return _serve_replicas(opening, open_model, build, checked, limits, host, port, log_level, replicas,
                               threads_per_replica, autoscale)

    def run_server(parallel=None, leader=None) -> None:
        app = build(parallel=parallel, leader=leader)
        server = uvicorn.Server(server_config(app, limits, host=host, port=port, log_level=log_level,
                                              log_config=_logging(log_level)))
        # uvicorn drains on SIGTERM, then raises the signal again with the handler it found: this one makes
        # that an exit with status 0 (a supervisor reads -15 as a crash) rather than death by the signal
        signal.signal(signal.SIGTERM, _exit_cleanly)
        server.run()

    if checked is None:
        return run_server()
    from dlmrt.parallel.serving import serve_on_ranks

    serve_on_ranks(*checked, open_model, run_server)


def open_served(opening: dict, parallel):
    """(model, backend) of the server's options `opening` (open_backend's); `parallel`: a rank's (ParallelPlan,
    Ranks). Pickled by reference into the ranks and replicas that open the model themselves."""
    from rich.console import Console

    from dlmrt.cli.backends import open_backend

    return open_backend(**opening, engines=None, precision=None, console=Console(stderr=True), parallel=parallel)


def _serve_replicas(opening: dict, open_model, build, checked, limits, host, port, log_level, replicas, threads,
                    autoscale):
    """--replicas: check what can be checked here, then `dlmrt.serve.replicas` until SIGINT or SIGTERM.
    `checked`: the (ParallelPlan, device) of a model split over ranks, each replica spanning them; or None."""
    import torch

    from dlmrt.cli.backends import ensure_exported, resolve_device
    from dlmrt.serve.replicas import ReplicaPlan, serve_replicas

    backend, model_dir, dtype = opening["backend"], opening["model_dir"], opening["dtype"]
    if model_dir is not None and not model_dir.exists():  # before Ray starts, not in each replica
        raise UserError(f"model directory {model_dir} does not exist")
    most = autoscale[1] if autoscale else replicas
    ranks = 1 if checked is None else checked[0].world
    gpus = resolve_device(backend, opening["device"]) == "cuda"
    if gpus and most * ranks > torch.cuda.device_count():
        raise click.UsageError(f"--replicas on CUDA takes a GPU for each rank of a replica: {most} x {ranks} asked "
                               f"for, {torch.cuda.device_count()} here")
    if backend == "ort":  # export once here (if needed), rather than in each replica at once
        from rich.console import Console

        from dlmrt import TINY_MODEL_DIR

        ensure_exported(model_dir or TINY_MODEL_DIR, dtype, Console(stderr=True))
    threads = threads or max(1, (os.cpu_count() or 1) // most)
    if checked is not None:
        from dlmrt.parallel.serving import build_split_app

        build = functools.partial(build_split_app, *checked, max(1, threads // ranks), open_model, build)
    plan = ReplicaPlan(replicas=replicas, threads=threads, limits=limits, max_batch=opening["max_batch"],
                       gpus=gpus, ranks=ranks, autoscale=autoscale, log_level=log_level)
    serve_replicas(build, plan, host=host, port=port, announce=lambda line: click.echo(line, err=True))


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def _logging(level: str) -> dict:
    """uvicorn's logging (its ready line on stderr, its access log on stdout), and dlmrt's loggers on its
    handler at the same level."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["dlmrt"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config
