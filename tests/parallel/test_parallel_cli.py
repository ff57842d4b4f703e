"""`dlmrt generate --tp/--ep`: ranks it starts itself or torchrun's, rank 0 alone prints; what does not fit is
refused in one line before any rank starts (by `dlmrt serve` too); a rank killed mid-run ends the command with
one error."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlmrt.cli.commands import main
from dlmrt.models import checkpoint
from helpers import LLADA, config, random_model

PROMPT = ["--prompt", "add:762+139=", "--prompt", "rev:hello=", "--policy", "threshold", "--cache", "dual"]


def dlmrt(*args: str, launcher: tuple[str, ...] = (sys.executable, "-m", "dlmrt.cli")) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "--tp 3 does not fit tiny-llada: 4 query heads do not split over 3 ranks; the MLP width 512 "
                    "does not split over 3 ranks (--tp values that fit: 1, 2, 4)"),
    (["--tp", "2", "--backend", "ort"], "--backend ort has no tensor- or expert-parallel path"),
    (["--tp", "2", "--backend", "trt"], "--backend trt has no tensor- or expert-parallel path"),
    (["--ep", "2"], "--ep 2: this LLaDA model has no MoE layers to split; the allowed --ep value is 1"),
    (["--tp", "2", "--ep", "4"], "with both above 1 they must be equal"),
    (["--tp", "0"], "Invalid value for '--tp'"),
])
@pytest.mark.parametrize("command", [["generate", "--prompt", "add:1+2="], ["serve"]], ids=["generate", "serve"])
def test_a_split_that_cannot_run_is_refused_in_one_line_before_any_rank_starts(command, args, message, monkeypatch):
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("dlmrt.parallel.launch.run_ranks", no_ranks)
    monkeypatch.setattr("dlmrt.parallel.launch.lead", no_ranks)
    result = CliRunner().invoke(main, [*command, *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_two_ranks_started_by_dlmrt_print_once_what_one_process_prints():
    alone, split = dlmrt("generate", *PROMPT), dlmrt("generate", "--tp", "2", *PROMPT)
    assert alone.returncode == split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout == "0901\nolleh\n"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside this Python")
def test_under_torchrun_the_same_command_runs_as_its_ranks():
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    result = dlmrt("generate", "--tp", "2", *PROMPT,
                   launcher=(torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dlmrt.cli"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "0901\nolleh\n"
    wrong = dlmrt("generate", "--tp", "4", *PROMPT,
                  launcher=(torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dlmrt.cli"))
    assert wrong.returncode != 0
    assert "torchrun started 2 ranks, but --tp/--ep ask for 4" in wrong.stderr


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc (Linux)")
def test_killing_a_rank_mid_generate_ends_the_command_with_one_error_within_30_s(tmp_path):
    # A model large enough that its 32 blocks take seconds, streamed: the first block printed says decoding runs.
    model = random_model(config(LLADA, d_model=256, n_heads=8, n_kv_heads=4, n_layers=6, mlp_hidden_size=1024,
                                max_sequence_length=256))
    model_dir = checkpoint.save(model, tmp_path / "model")
    prompts = [f"--prompt-ids={n},{n + 1},{n + 2}" for n in range(5, 13)]
    command = subprocess.Popen([sys.executable, "-m", "dlmrt.cli", "generate", str(model_dir), "--tp", "2",
                                "--stream", "--ignore-eos", "--gen-length", "128", "--block-length", "4", "--policy",
                                "fixed", "--steps", "128", *prompts],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert command.stdout.readline(), "nothing was streamed"
    ranks = [pid for pid in children(command.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = command.communicate(timeout=60)
    assert time.monotonic() - killed < 30
    assert command.returncode == 2
    assert len(stdout.splitlines()) < 8 * 32 - 1, "the run finished before the kill"
    assert stderr.strip().splitlines()[-1] == "Error: rank 1 was killed by SIGKILL; every rank of 2 was stopped"
    assert "Traceback" not in stderr
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
               for pid in ranks)
