"""`dlmrt serve --replicas N`: N copies of the server on Ray Serve, behind one HTTP ingress.

    plan = ReplicaPlan(replicas=2, threads=1, limits=ServerLimits(), max_batch=64)
    serve_replicas(build_app, plan, host="127.0.0.1", port=8000)  # blocks until SIGINT or SIGTERM

Each replica is a Ray actor that builds the whole app (`build_app()`: the backend and the model, then
`dlmrt.serve.app.create_app`, so there is one definition of the API) with its own scheduler and
running batch, on one GPU (`ray_actor_options={"num_gpus": 1}`) or, on a CPU, `threads` torch threads.
A model split over ranks (`--tp`/`--ep`) is one replica spanning them: the replica's process is rank 0
and starts its other ranks itself (`dlmrt.parallel.lockstep`), with a GPU for each (`num_gpus: ranks`),
or its threads shared among them.
Ray Serve's proxy is the one HTTP ingress: it routes each request to a replica (power of two choices
over the requests each holds) and streams the answer back, server-sent events included.

- **Health**: Ray Serve calls each replica's `check_health` (every 10 s, failing after 30 s): it asks
  the scheduler's worker to run a no-op before its next block (`scheduler_health`), so a dead or
  stuck worker, not only a dead process, makes Ray replace the replica.
- **Autoscaling**: `autoscale=(MIN, MAX)` hands Ray Serve's autoscaler the replica count, from
  `replicas` at start, aiming at `max_batch` requests in flight a replica.
- **Admission**: each replica's scheduler keeps its own batch and queue, and answers 429 past them, as
  the single-process server does. Ray's cap on a replica's requests (`max_ongoing_requests`) is twice
  that, so that Ray's router rarely queues a request where no deadline runs.
- **Metrics**: each replica copies its dlmrt metrics into Ray's (`RayMetrics`), which Ray's Prometheus
  endpoint serves with the replica's tag; `/metrics` through the proxy is whichever replica answered.
- **Shutdown**: SIGINT or SIGTERM deletes the application (the replicas drain) and stops Ray.

Ray is imported here only: without `--replicas`, `dlmrt serve` never imports it. This module imports
nothing of the command line; the CLI hands it `build_app`, which Ray pickles by reference.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import click

from dlmrt.core.errors import DlmrtError
from dlmrt.serve.app import ServerLimits

APP_NAME = "dlmrt"
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# The scheduler's worker reaches a block boundary within this, or the replica is unhealthy. Below Ray's
# own timeout, so that the replica's log says why.
SCHEDULER_PROBE_S = 25.0
# uvicorn's level names, as `dlmrt serve --log-level` takes them, for Python's logging
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "debug": logging.DEBUG, "trace": logging.DEBUG}


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int  # at start; fixed unless `autoscale`
    threads: int  # torch threads in each replica
    limits: ServerLimits
    max_batch: int  # the rows of a replica's running batch
    gpus: bool = False  # a GPU for each of a replica's ranks
    ranks: int = 1  # processes a replica spans: a model split over ranks (--tp/--ep) is one replica
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    log_level: str = "info"

    @property
    def most_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas

    @property
    def max_ongoing_requests(self) -> int:
        """Ray's cap on the requests a replica holds at once: twice its running batch and its queue, so that
        the replica's own scheduler refuses a flood (429, in OpenAI's shape) before Ray's router would queue
        requests out of the replica's sight (and deadline)."""
        return 2 * (self.max_batch + self.limits.max_queue)


def deployment_options(plan: ReplicaPlan) -> dict:
    """`@serve.deployment`'s options for `plan`."""
    actor = {"num_cpus": plan.threads}
    if plan.gpus:
        actor["num_gpus"] = plan.ranks
    options = dict(name=APP_NAME, ray_actor_options=actor, max_ongoing_requests=plan.max_ongoing_requests,
                   graceful_shutdown_timeout_s=plan.limits.shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.5,
                   health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)
    if plan.autoscale is None:
        options["num_replicas"] = plan.replicas
    else:
        low, high = plan.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high, "initial_replicas": plan.replicas,
                                         "target_ongoing_requests": plan.max_batch}
    return options


async def scheduler_health(scheduler, timeout_s: float = SCHEDULER_PROBE_S) -> None:
    """Raise unless the scheduler's worker runs a no-op before its next block within `timeout_s`: its
    thread is alive, not stuck inside a step, and the scheduler takes work (it is not draining)."""
    from dlmrt.runtime.scheduler import ShuttingDown

    try:
        probe = scheduler.run_between_blocks(lambda: None)
    except ShuttingDown as error:
        raise RuntimeError(f"the scheduler is shutting down: {error}") from None
    try:
        await asyncio.wait_for(asyncio.wrap_future(probe), timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the scheduler's worker reached no block boundary within {timeout_s:g} s: it is stuck "
                           f"or has died") from None


def application(build_app: Callable[[], object], plan: ReplicaPlan):
    """The Ray Serve application: `plan.replicas` replicas, each serving `build_app()`."""
    from ray import serve

    threads, level = plan.threads, LOG_LEVELS[plan.log_level]

    def build():  # in the replica, after its constructor: the model, its backend and scheduler, the app
        app = build_app()
        RayMetrics(app.state.metrics).start()
        return app

    @serve.deployment(**deployment_options(plan))
    @serve.ingress(build)
    class Replica:
        def __init__(self):
            import torch

            torch.set_num_threads(threads)
            dlmrt_logger = logging.getLogger("dlmrt")
            if not dlmrt_logger.handlers:  # the replica's stderr, which Ray shows on the driver's
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
                dlmrt_logger.addHandler(handler)
            dlmrt_logger.setLevel(level)
            dlmrt_logger.propagate = False

        async def check_health(self):
            await scheduler_health(self.app.state.scheduler)

    return Replica.bind()


class RayMetrics:
    """One replica's dlmrt metrics (`dlmrt.serve.metrics`), copied into Ray's (`ray.serve.metrics`, which
    tags each with the deployment, the replica and the application), so that Ray's Prometheus endpoint shows
    every replica's `ray_dlmrt_*` series side by side. The histograms are fed as they are observed; the
    scheduler's gauges and counters (and the refusals by reason) are copied every `period_s`."""

    def __init__(self, metrics, period_s: float = 1.0, ray_metrics=None):
        from dlmrt.serve.metrics import LATENCY_BUCKETS

        if ray_metrics is None:
            from ray.serve import metrics as ray_metrics

        self.ray_metrics, self.source, self.period_s = ray_metrics, metrics, period_s
        self.copies: dict[str, object] = {}  # by name: Ray's gauge or counter
        self.counted: dict[tuple, float] = {}  # what each counter sample has added to Ray's counter so far
        for attribute in ("latency", "first_block"):
            histogram = getattr(metrics, attribute)
            family = histogram.describe()[0]
            setattr(metrics, attribute, _Both(histogram, ray_metrics.Histogram(family.name, family.documentation,
                                                                                boundaries=list(LATENCY_BUCKETS))))

    def start(self) -> None:
        threading.Thread(target=self._run, name="dlmrt-ray-metrics", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.copy()
            except Exception:  # a metric missed is no reason to stop the replica
                logging.getLogger(__name__).exception("copying dlmrt's metrics into Ray's failed")
            time.sleep(self.period_s)

    def copy(self) -> None:
        for family in self.source.registry.collect():
            if family.type not in ("gauge", "counter"):
                continue  # the histograms: `_Both`
            for sample in family.samples:
                if family.type == "counter" and not sample.name.endswith("_total"):
                    continue  # prometheus_client's `_created` timestamps
                labels = dict(sample.labels)
                copy = self._copy_of(family, tuple(sorted(labels)))
                if family.type == "gauge":
                    copy.set(sample.value, tags=labels)
                    continue
                key = (family.name, tuple(sorted(labels.items())))
                added = sample.value - self.counted.get(key, 0.0)
                if added > 0:
                    copy.inc(added, tags=labels)
                    self.counted[key] = sample.value

    def _copy_of(self, family, label_names: tuple[str, ...]):
        if family.name not in self.copies:
            kind = self.ray_metrics.Gauge if family.type == "gauge" else self.ray_metrics.Counter
            self.copies[family.name] = kind(family.name, family.documentation, tag_keys=label_names)
        return self.copies[family.name]


class _Both:
    """A histogram observed into dlmrt's registry and into Ray's at once."""

    def __init__(self, histogram, ray_histogram):
        self.histogram, self.ray_histogram = histogram, ray_histogram

    def observe(self, amount: float) -> None:
        self.histogram.observe(amount)
        self.ray_histogram.observe(amount)


def serve_replicas(build_app: Callable[[], object], plan: ReplicaPlan, *, host: str, port: int,
                   announce: Callable[[str], None] = print) -> None:
    """Start Ray locally, deploy `plan`, `announce` the address, and serve until SIGINT or SIGTERM; then
    shut Ray Serve down (the replicas finish what they hold, for at most the shutdown deadline) and return."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, no report home
    import ray
    from ray import serve

    level = LOG_LEVELS[plan.log_level]
    ray_level = logging.WARNING if level > logging.DEBUG else logging.DEBUG  # Ray's own processes: quiet
    cpus = max(os.cpu_count() or 1, plan.most_replicas * plan.threads)  # Ray's accounting: each replica its threads
    ray.init(address="local", include_dashboard=False, num_cpus=cpus, logging_level=ray_level,
             log_to_driver=level <= logging.INFO)
    logging.getLogger("ray.serve").setLevel(ray_level)
    # from here on, SIGINT and SIGTERM stop Ray Serve and return (Ray's own handler aborts the process)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    try:
        serve.start(http_options={"host": host, "port": port,
                                  "keep_alive_timeout_s": max(1, math.ceil(plan.limits.keep_alive_s))},
                    logging_config={"log_level": logging.getLevelName(ray_level)})
        try:
            serve.run(application(build_app, plan), name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": logging.getLevelName(level),  # the replicas': as asked
                                      "enable_access_log": level <= logging.INFO})
        except RuntimeError as error:  # Ray's "Deploying application dlmrt failed", without the reason
            raise start_failure(error) from None
        shown = f"[{host}]" if ":" in host else host
        scaling = f", autoscaling {plan.autoscale[0]} to {plan.autoscale[1]}" if plan.autoscale else ""
        announce(f"dlmrt serve: {plan.replicas} replica{'s' * (plan.replicas > 1)}{scaling} on Ray Serve, "
                 f"{plan.threads} thread{'s' * (plan.threads > 1)} each, at http://{shown}:{port}; each "
                 f"replica's metrics at {metrics_url()} (Ctrl-C or SIGTERM stops them)")
        while True:
            time.sleep(3600)
    except _Stopped:
        pass
    finally:
        # while Ray Serve shuts down: a second Ctrl-C interrupts it (Ray still stops), SIGTERM waits for it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Deleting the application first drains it: the replicas leave the proxy's routes, answer what they
        # hold (for at most the shutdown deadline), then stop. serve.shutdown() instead stops the proxy at
        # once, cutting every response in flight. Then Ray itself: the proxy, the controller, the cluster.
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()


class ReplicaStartError(DlmrtError):
    """A replica could not start, for a reason of the user's (a model directory that is not one, say)."""


def start_failure(error: RuntimeError) -> Exception:
    """Why the replicas failed to start, from the last line of the replica's exception in Ray Serve's
    status: one line for the user where that exception is one of dlmrt's own errors or a usage error
    (as the single-process server would have said), else the RuntimeError naming it."""
    from ray import serve

    try:
        last = serve.status().applications[APP_NAME].deployments[APP_NAME].message.strip().splitlines()[-1]
    except Exception:  # no status to read: Ray's own error is all there is
        return error
    name, _, message = last.partition(": ")
    kind = _error_class(name)
    if kind is not None and issubclass(kind, (DlmrtError, click.ClickException)):
        return ReplicaStartError(message)
    return RuntimeError(f"a replica failed to start: {last}")


def _error_class(name: str) -> type | None:
    """The exception class a traceback's last line names, where it is dlmrt's or click's."""
    module, _, attribute = name.rpartition(".")
    if not module.startswith(("dlmrt.", "click.")):
        return None
    try:
        kind = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return None
    return kind if isinstance(kind, type) and issubclass(kind, BaseException) else None


def metrics_url() -> str:
    """Ray's Prometheus endpoint on this node: Ray's own metrics and every replica's dlmrt ones."""
    import ray

    node = next(node for node in ray.nodes() if node["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


class _Stopped(Exception):
    """SIGINT or SIGTERM, in the main thread."""


def _stop(signum, frame):
    raise _Stopped
