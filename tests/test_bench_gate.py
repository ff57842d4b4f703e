"""The benchmark gate catches each regression it was blind to: injected into the running code in this
process, after a baseline of the unchanged code, each makes `dlmrt bench --suite --check` fail, and
names what changed. Counted work catches what adds work whatever the machine's load; paired timing
catches a pure delay (here 30% of a step; how small a delay it catches is measured by
scripts/gate_sensitivity.py, not here)."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from dlmrt.cli.bench import bench_command
from dlmrt.models.layers import RMSNorm
from dlmrt.runtime import device_step, ort_backend
from dlmrt.runtime.executor import Executor
from dlmrt.runtime.mask_batch import MaskBatch

SUITE = """
format_version = 1
name = "gate-test"

[defaults]
batch_size = 2
input_len = 8
output_len = 16
block_length = 8
policy = "threshold"
cache = "dual"
num_iters = 2  # the counted figures are exact in any round
num_iters_warmup = 1

[scenarios.torch]
backends = ["reference", "torch:eager", "torch:compile"]

[scenarios.ort]
backends = ["reference", "torch:eager", "ort"]
"""
# The timing test's: the ort scenario timed as dlmrt's own suite times its modes, 9 rounds and a 5% margin,
# so that a 30% delay fails even on a loaded machine.
TIMED_SUITE = SUITE.replace("[scenarios.ort]\n", "[scenarios.ort]\nnum_iters = 9\nmargin = 0.05\n")


def bench(*args):
    return CliRunner().invoke(bench_command, [str(a) for a in args])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The suite and its baseline of the unchanged code."""
    root = tmp_path_factory.mktemp("gate")
    suite, baseline = root / "suite.toml", root / "baseline.json"
    suite.write_text(SUITE)
    result = bench("--suite", suite, "--baseline", baseline, "--update-baseline")
    assert result.exit_code == 0, result.output
    return suite, baseline


def gate_fails(recorded, scenario: str) -> str:
    suite, baseline = recorded
    result = bench("--suite", suite, "--scenario", scenario, "--baseline", baseline, "--check")
    assert result.exit_code == 1, result.output
    assert "the benchmark gate failed in" in result.output
    return result.output


def test_a_wasted_forward_per_block(recorded, monkeypatch):
    start_block = MaskBatch._start_block

    def wasting(self):
        self.backend.model(self.state.canvas)
        return start_block(self)
    monkeypatch.setattr(MaskBatch, "_start_block", wasting)
    assert "torch:eager: flops_per_token is" in gate_fails(recorded, "torch")


@pytest.mark.timing
def test_every_step_30_percent_slower_by_a_pure_delay(monkeypatch, tmp_path):
    """No work is added, so no count changes: the paired timing must see it. (The scenario without
    compile: a step that sleeps cannot compile.) Its baseline is recorded right before the check: the
    module's, recorded minutes earlier while the other test worker ran other tests, can sit under another
    load than the check (one CI run let this delay pass against it)."""
    suite, baseline = tmp_path / "suite.toml", tmp_path / "baseline.json"
    suite.write_text(TIMED_SUITE)
    result = bench("--suite", suite, "--scenario", "ort", "--baseline", baseline, "--update-baseline")
    assert result.exit_code == 0, result.output
    step = device_step.step

    def slower(*args, **kwargs):  # 30% of the step's own time: 30% slower however loaded the machine is
        started = time.perf_counter()
        step(*args, **kwargs)
        time.sleep(0.3 * (time.perf_counter() - started))
    monkeypatch.setattr(device_step, "step", slower)
    output = gate_fails((suite, baseline), "ort")
    assert "torch:eager: speed vs reference is" in output and "it must not change" not in output


def test_every_step_10_percent_slower_by_more_work(recorded, monkeypatch):
    """Every norm computed twice: some 15% more ops a step, and not one more FLOP."""
    norm = RMSNorm.forward

    def twice(self, x):
        norm(self, x)
        return norm(self, x)
    monkeypatch.setattr(RMSNorm, "forward", twice)
    assert "torch:eager: aten_ops_per_step is" in gate_fails(recorded, "torch")


def test_compile_silently_running_eager(recorded, monkeypatch):
    monkeypatch.setattr(Executor, "_compile", Executor._eager)
    output = gate_fails(recorded, "torch")
    assert "torch:compile: compiled_graphs is 0" in output


def test_onnx_runtime_forced_to_one_thread(recorded, monkeypatch):
    options = ort_backend.session_options
    monkeypatch.setattr(ort_backend, "session_options",
                        lambda optimization, threads, **kwargs: options(optimization, 1, **kwargs))
    assert "ort: ort_threads is 1, the baseline holds 0" in gate_fails(recorded, "ort")


def test_an_extra_host_read_per_step(recorded, monkeypatch):
    step = device_step.step

    def reading(state, step_kind, run_graph):
        step(state, step_kind, run_graph)
        state.status[-1].item()
    monkeypatch.setattr(device_step, "step", reading)
    output = gate_fails(recorded, "ort")  # a step that reads the host cannot compile
    assert "torch:eager: host_reads is" in output and "ort: host_reads is" in output
