"""scripts/load_test.py against a real `dlmrt serve` on loopback, and its refusal of other hosts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "load_test.py"


def load_script():
    spec = importlib.util.spec_from_file_location("load_test", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)
    return script


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def server_url():
    """`dlmrt serve` (tiny model, eager) on 127.0.0.1 at a free port, once /health answers; a stalled body
    gets its 408 after 1 s."""
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
    from live_server import dlmrt_serve

    with dlmrt_serve("--max-batch", "8", "--body-timeout", "1") as (_, port):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_a_mixed_load_is_fully_accounted_for(server_url, tmp_path):
    report_path = tmp_path / "out.json"
    done = run_script("--url", server_url, "--requests", "24", "--concurrency", "4", "--sequential", "4",
                      "--cancel-fraction", "0.1", "--seed", "3", "--time-limit", "60", "--json", str(report_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answered + cancelled + refused + lost" in done.stdout
    report = json.loads(report_path.read_text())
    concurrent, sequential = report["concurrent"], report["sequential"]
    assert concurrent["lost"] == 0 and sequential["lost"] == 0
    assert concurrent["answered"] + concurrent["cancelled"] + concurrent["refused"] == 24
    assert sequential["answered"] + sequential["cancelled"] + sequential["refused"] == 4
    assert concurrent["cancelled"] == 2  # round(24 * 0.1) streams are closed after their first event
    assert sum(concurrent["refused_by_reason"].values()) == concurrent["refused"]
    for phase in (concurrent, sequential):
        assert phase["latency_s"]["p50"] <= phase["latency_s"]["p99"]
        assert phase["completion_tokens_per_s"] > 0 and phase["requests_per_s"] > 0
    assert concurrent["first_block_s"]["p50"] <= concurrent["first_block_s"]["p99"]
    assert report["throughput_ratio"]["completion_tokens_per_s"] > 0 and report["model"] == "tiny-llada"


@pytest.mark.slow
def test_hostile_clients_are_cut_off_and_counted_apart(server_url, tmp_path):
    report_path = tmp_path / "out.json"
    done = run_script("--url", server_url, "--requests", "30", "--concurrency", "6", "--hostile-fraction", "0.2",
                      "--cancel-fraction", "0", "--seed", "5", "--time-limit", "60", "--json", str(report_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    normal, hostile = report["concurrent"], report["hostile"]
    assert normal["requests"] == 24 and normal["answered"] == 24 and normal["lost"] == 0
    assert hostile["requests"] == 6 and hostile["unexpected"] == 0 and hostile["unanswered"] == 0
    assert hostile["by_kind"]["stalled"] == {"408": 2}  # the server's --body-timeout cut them off
    for kind in ("oversized", "chunked"):  # refused at the limit; a client still sending may see a reset
        assert sum(hostile["by_kind"][kind].get(what, 0) for what in ("413", "reset")) == 2


def test_hostile_requests_are_an_exact_share_of_those_that_do_not_stream():
    plan = load_script().plan_requests(40, stream_fraction=0.5, cancel_fraction=0.1, seed=7, hostile_fraction=0.15)
    hostile = [r.hostile for r in plan if r.hostile]
    assert sorted(hostile) == ["chunked"] * 2 + ["oversized"] * 2 + ["stalled"] * 2
    assert not any(r.stream for r in plan if r.hostile) and sum(r.stream for r in plan) == 20
    unplanned = load_script().plan_requests(40, stream_fraction=0.5, cancel_fraction=0.1, seed=7)
    assert [(r.prompt, r.stream, r.cancel) for r in plan] == [(r.prompt, r.stream, r.cancel) for r in unplanned]


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_a_host_that_is_not_loopback_is_refused(url):
    done = run_script("--url", url, "--requests", "1", timeout=60)
    assert done.returncode != 0 and "is not loopback" in done.stderr and "--url" in done.stderr


def test_the_plan_has_exact_shares_and_cancels_only_streams():
    script = load_script()
    plan = script.plan_requests(40, stream_fraction=0.5, cancel_fraction=0.1, seed=7)
    assert sum(r.stream for r in plan) == 20 and sum(r.cancel for r in plan) == 4
    assert all(r.stream for r in plan if r.cancel) and all(r.prompt.endswith("=") for r in plan)
    assert plan == script.plan_requests(40, stream_fraction=0.5, cancel_fraction=0.1, seed=7)
