"""`dlmrt serve --replicas N` (Ray Serve): its options and their errors, without Ray installed too; the
replica's health probe and its metrics copied into Ray's; and two replicas on loopback answering as the
single-process server does, streams included, then stopping cleanly on SIGTERM with a request in flight."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

import httpx  # noqa: E402

from dlmrt.cli.commands import main  # noqa: E402
from dlmrt.serve.app import ServerLimits  # noqa: E402
from dlmrt.core.errors import DlmrtError  # noqa: E402
from dlmrt.serve.replicas import (RayMetrics, ReplicaPlan, deployment_options, scheduler_health,  # noqa: E402
                                  start_failure)
from live_server import dlmrt_serve, dlmrt_serve_replicas  # noqa: E402

PROMPTS = ["add:762+139=", "rev:abcdefghij=", "sort:3142=", "rev:abc=", "add:5+17=", "sort:987123="]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# -- the command line, without starting Ray ------------------------------------------------------------------

def test_replicas_without_ray_is_one_line_before_anything_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # neither found nor importable, as without the ray extra

    def never(*args, **kwargs):
        raise AssertionError("the model was opened before the missing extra was reported")

    monkeypatch.setattr("dlmrt.cli.backends.open_backend", never)
    result = run("serve", "--replicas", "2")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["Error: dlmrt serve --replicas needs ray: pip install 'dlmrt[ray]'"]


@pytest.mark.parametrize("count", ["0", "-1"])
def test_replicas_below_one_is_a_usage_error(count):
    result = run("serve", "--replicas", count)
    assert result.exit_code == 2 and "Invalid value for '--replicas'" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["--threads-per-replica", "2"], "--threads-per-replica and --autoscale apply with --replicas N"),
    (["--autoscale", "1:2"], "--threads-per-replica and --autoscale apply with --replicas N"),
    (["--replicas", "1", "--threads-per-replica", "0"], "Invalid value for '--threads-per-replica'"),
    (["--replicas", "1", "--autoscale", "2:1"], "'2:1': give 1 <= MIN <= MAX"),
    (["--replicas", "1", "--autoscale", "0:2"], "'0:2': give 1 <= MIN <= MAX"),
    (["--replicas", "1", "--autoscale", "4"], "'4' is not MIN:MAX"),
    (["--replicas", "3", "--autoscale", "1:2"], "--replicas 3 is the count at start: it lies within --autoscale 1:2"),
])
def test_replica_options_that_do_not_fit_are_usage_errors(monkeypatch, args, message):
    """Before anything else: Ray need not be installed."""
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setattr("dlmrt.serve.replicas.serve_replicas", lambda *a, **k: pytest.fail("Ray was started"))
    result = run("serve", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_without_replicas_ray_is_never_imported(monkeypatch):
    """The single-process server as it was: `import ray` anywhere on its way would raise here."""
    import uvicorn

    monkeypatch.setitem(sys.modules, "ray", None)
    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server: served.append(server.config.app))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the test's own SIGTERM handler stays
    result = run("serve", "--mode", "eager")
    assert result.exit_code == 0, result.output
    assert len(served) == 1 and sys.modules["ray"] is None


@pytest.mark.parametrize("args, threads, most", [([], None, 2), (["--threads-per-replica", "3"], 3, 2),
                                                 (["--autoscale", "1:4"], None, 4)])
def test_the_plan_divides_the_cpus_among_the_replicas(monkeypatch, args, threads, most):
    monkeypatch.setattr("dlmrt.cli.serve.require_ray_extra", lambda: None)  # Ray itself never starts here
    plans = []
    monkeypatch.setattr("dlmrt.serve.replicas.serve_replicas", lambda build, plan, **where: plans.append(plan))
    result = run("serve", "--replicas", "2", "--device", "cpu", "--max-batch", "8", "--max-queue", "5", *args)
    assert result.exit_code == 0, result.output
    plan = plans[0]
    assert plan.replicas == 2 and plan.most_replicas == most and not plan.gpus
    assert plan.threads == (threads or max(1, (os.cpu_count() or 1) // most))
    assert plan.max_batch == 8 and plan.limits.max_queue == 5


def test_a_replica_of_a_split_model_spans_its_ranks(monkeypatch):
    """--replicas with --tp: each replica leads its own ranks (build_split_app), a GPU for each rank, or the
    replica's threads shared among them."""
    from dlmrt.parallel.serving import build_split_app

    monkeypatch.setattr("dlmrt.cli.serve.require_ray_extra", lambda: None)
    started = []
    monkeypatch.setattr("dlmrt.serve.replicas.serve_replicas",
                        lambda build, plan, **where: started.append((build, plan)))
    result = run("serve", "--replicas", "2", "--tp", "2", "--device", "cpu", "--threads-per-replica", "3")
    assert result.exit_code == 0, result.output
    build, plan = started[0]
    assert plan.ranks == 2 and plan.threads == 3
    assert build.func is build_split_app and build.args[0].tp == 2 and build.args[1:3] == ("cpu", 1)
    gpus = deployment_options(ReplicaPlan(replicas=2, threads=1, limits=ServerLimits(), max_batch=8, gpus=True,
                                          ranks=2))
    assert gpus["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 2}
    refused = run("serve", "--replicas", "2", "--tp", "3", "--device", "cpu")
    assert refused.exit_code == 2 and "--tp 3 does not fit tiny-llada" in refused.output and len(started) == 1


def test_deployment_options_fixed_and_autoscaled():
    limits = ServerLimits(max_queue=5, shutdown_timeout_s=7.0)
    fixed = deployment_options(ReplicaPlan(replicas=3, threads=2, limits=limits, max_batch=8))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 2 * (8 + 5)  # the replica's own 429 comes first
    assert fixed["graceful_shutdown_timeout_s"] == 7.0
    scaled = deployment_options(ReplicaPlan(replicas=2, threads=1, limits=limits, max_batch=8, gpus=True,
                                            autoscale=(1, 4)))
    assert "num_replicas" not in scaled and scaled["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                            "target_ongoing_requests": 8}


@pytest.mark.parametrize("last_line, said", [
    ("dlmrt.core.errors.CheckpointError: /x has no config.json", "/x has no config.json"),
    ("click.exceptions.UsageError: --mode applies to --backend torch", "--mode applies to --backend torch"),
    ("KeyError: 'deep inside'", "a replica failed to start: KeyError: 'deep inside'"),
    ("os.FakeError: not a class of dlmrt's", "a replica failed to start: os.FakeError: not a class of dlmrt's"),
])
def test_a_replica_that_cannot_start_says_why(monkeypatch, last_line, said):
    """Ray says only that the deployment failed; its status holds the replica's traceback, whose last line is
    the reason: one of dlmrt's (or a usage error) is the user's, one line; anything else stays internal."""
    from types import SimpleNamespace

    serve = SimpleNamespace(status=None)  # Ray Serve's status, and nothing else of Ray
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(serve=serve))
    monkeypatch.setitem(sys.modules, "ray.serve", serve)

    deployment = SimpleNamespace(message=f"The deployment failed to start 3 times in a row.\nTraceback (most recent "
                                         f"call last):\n  ...\n{last_line}")
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"dlmrt": SimpleNamespace(
        deployments={"dlmrt": deployment})}))
    failure = start_failure(RuntimeError("Deploying application dlmrt failed"))
    assert str(failure) == said
    assert isinstance(failure, DlmrtError) == said.startswith(("/x", "--mode"))
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    original = RuntimeError("Deploying application dlmrt failed")
    assert start_failure(original) is original


# -- the replica's health and metrics, in this process -------------------------------------------------------

@pytest.fixture
def scheduler(model):
    from dlmrt.runtime.scheduler import Scheduler
    from dlmrt.runtime.torch_backend import TorchBackend

    scheduler = Scheduler(TorchBackend(model, mode="eager"))
    yield scheduler
    scheduler.stop(10)


def test_health_is_the_scheduler_reaching_a_block_boundary(scheduler):
    asyncio.run(scheduler_health(scheduler, timeout_s=10))  # idle: healthy
    release = threading.Event()
    scheduler.run_between_blocks(release.wait)  # the worker is stuck inside work it was given
    try:
        with pytest.raises(RuntimeError, match="reached no block boundary within 0.2 s"):
            asyncio.run(scheduler_health(scheduler, timeout_s=0.2))
    finally:
        release.set()
    asyncio.run(scheduler_health(scheduler, timeout_s=10))
    scheduler.stop(10)
    with pytest.raises(RuntimeError, match="shutting down"):
        asyncio.run(scheduler_health(scheduler, timeout_s=10))


class _RayMetric:
    def __init__(self, kind, name, description="", tag_keys=(), boundaries=None):
        self.kind, self.name, self.tag_keys, self.boundaries, self.calls = kind, name, tag_keys, boundaries, []

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def inc(self, value, tags=None):
        assert value > 0  # as Ray's counters insist
        self.calls.append(("inc", value, tags))

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))


class _FakeRayMetrics:
    def __init__(self):
        self.made = {}

    def __getattr__(self, kind):
        def make(name, *args, **kwargs):
            self.made[name] = _RayMetric(kind, name, *args, **kwargs)
            return self.made[name]
        return make


def test_the_replica_metrics_are_copied_into_rays(scheduler):
    from dlmrt.serve.metrics import LATENCY_BUCKETS, ServerMetrics

    metrics, ray = ServerMetrics(scheduler), _FakeRayMetrics()
    copier = RayMetrics(metrics, ray_metrics=ray)
    metrics.latency.observe(0.3)
    metrics.first_block.observe(0.1)
    metrics.rejected.labels("queue_full").inc()
    metrics.rejected.labels("queue_full").inc()
    scheduler.stats.generated_tokens = 40
    copier.copy()
    metrics.rejected.labels("queue_full").inc()
    scheduler.stats.generated_tokens = 48
    copier.copy()
    copier.copy()  # nothing new: nothing added
    made = ray.made
    assert made["dlmrt_request_latency_seconds"].calls == [("observe", 0.3, None)]
    assert made["dlmrt_request_latency_seconds"].boundaries == list(LATENCY_BUCKETS)
    assert made["dlmrt_time_to_first_block_seconds"].calls == [("observe", 0.1, None)]
    assert made["dlmrt_generated_tokens"].kind == "Counter"
    assert made["dlmrt_generated_tokens"].calls == [("inc", 40, {}), ("inc", 8, {})]
    assert made["dlmrt_rejected_requests"].tag_keys == ("reason",)
    assert made["dlmrt_rejected_requests"].calls == [("inc", 2, {"reason": "queue_full"}),
                                                     ("inc", 1, {"reason": "queue_full"})]
    assert made["dlmrt_queue_depth"].kind == "Gauge" and made["dlmrt_queue_depth"].calls[-1] == ("set", 0, {})
    assert "dlmrt_cancelled_rows" not in made or made["dlmrt_cancelled_rows"].calls == []  # never counted
    rendered = metrics.render()[0].decode()  # dlmrt's own registry keeps every observation too
    assert "dlmrt_request_latency_seconds_count 1.0" in rendered
    assert 'dlmrt_rejected_requests_total{reason="queue_full"} 3.0' in rendered


# -- two replicas on loopback --------------------------------------------------------------------------------

def _answers(url: str) -> dict:
    """What the server answers to each prompt: whole, and streamed a block of 4 at a time."""
    answers = {}
    for prompt in PROMPTS:
        whole = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llada", "prompt": prompt}, timeout=60)
        assert whole.status_code == 200, whole.text
        asked = {"model": "tiny-llada", "prompt": prompt, "stream": True, "block_length": 4}
        with httpx.stream("POST", f"{url}/v1/completions", json=asked, timeout=60) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
        assert chunks[-1]["finish_reason"] is not None
        choice = whole.json()["choices"][0]
        answers[prompt] = (choice["text"], choice["token_ids"], [chunk["text"] for chunk in chunks])
    return answers


def _ray_metric(url: str, name: str) -> dict[str, float]:
    """A metric from Ray's Prometheus endpoint, by replica."""
    found = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            found[re.search(r'replica="([^"]*)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return found


@pytest.mark.slow
def test_two_replicas_answer_as_one_server_does_and_stop_cleanly():
    pytest.importorskip("ray.serve", reason="--replicas needs the 'ray' extra")
    with dlmrt_serve() as (_, port):
        alone = _answers(f"http://127.0.0.1:{port}")
    assert alone["add:762+139="][0] == "0901"
    assert any(len(streamed) > 1 for _, _, streamed in alone.values())  # streams come a block at a time
    started = time.monotonic()
    with dlmrt_serve_replicas("--replicas", "2", "--threads-per-replica", "1") as (server, port, lines):
        ready_s = time.monotonic() - started
        url = f"http://127.0.0.1:{port}"
        announced = next(line for line in lines if line.startswith("dlmrt serve:"))
        assert f"2 replicas on Ray Serve, 1 thread each, at {url};" in announced
        assert _answers(url) == alone
        missing = httpx.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        with ThreadPoolExecutor(8) as pool:  # at once, so that both replicas take some
            list(pool.map(lambda prompt: httpx.post(f"{url}/v1/completions", timeout=60,
                                                    json={"model": "tiny-llada", "prompt": prompt}), PROMPTS * 4))
        metrics_url = re.search(r"each replica's metrics at (\S+)", announced).group(1)
        deadline = time.monotonic() + 60
        while len(tokens := _ray_metric(metrics_url, "ray_dlmrt_generated_tokens_total")) < 2:
            assert time.monotonic() < deadline, f"Ray's metrics show dlmrt's for replicas {tokens} only"
            time.sleep(1)
        assert all(count > 0 for count in tokens.values())

        # a request in flight (its body half sent) when SIGTERM comes is answered before the server stops
        body = json.dumps({"model": "tiny-llada", "prompt": "add:762+139="}).encode()
        held = socket.create_connection(("127.0.0.1", port), timeout=60)
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body[:10])
        time.sleep(1)  # the proxy has handed it to a replica
        stopping = time.monotonic()
        server.send_signal(signal.SIGTERM)
        time.sleep(1)
        held.sendall(body[10:])
        answer = b""
        while b"0901" not in answer and (piece := held.recv(65536)):
            answer += piece
        assert answer.startswith(b"HTTP/1.1 200") and b'"text":"0901"' in answer, answer
        assert server.wait(60) == 0, "".join(lines)[-3000:]
        stopped_s = time.monotonic() - stopping
    output = "".join(lines)
    assert "Traceback" not in output and "Error" not in output, output[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
    print(f"ready after {ready_s:.1f} s, stopped {stopped_s:.1f} s after SIGTERM")


@pytest.mark.slow
def test_two_replicas_of_a_split_model_answer_as_one_server_does_and_stop_cleanly():
    pytest.importorskip("ray.serve", reason="--replicas needs the 'ray' extra")
    with dlmrt_serve() as (_, port):
        alone = _answers(f"http://127.0.0.1:{port}")
    with dlmrt_serve_replicas("--replicas", "2", "--tp", "2", "--threads-per-replica", "2") as (server, port, lines):
        assert _answers(f"http://127.0.0.1:{port}") == alone
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, "".join(lines)[-3000:]
    output = "".join(lines)
    assert "Traceback" not in output and "Error" not in output, output[-3000:]
