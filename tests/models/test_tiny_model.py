"""The tiny model shipped in dlmrt/assets: it loads, it is small, and it answers held-out prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dlmrt
from dlmrt.core import tasks
from dlmrt.eval.evaluation import exact_match
from dlmrt.runtime import Fixed, GenerationSettings


@pytest.fixture(scope="module")
def tiny():
    return dlmrt.load()


def test_it_is_a_small_llada_checkpoint(tiny):
    assert tiny.model_type == "llada" and tiny.name == "tiny-llada"
    assert sum(p.numel() for p in tiny.parameters()) < 2_000_000
    assert sum(f.stat().st_size for f in dlmrt.TINY_MODEL_DIR.iterdir()) < 10 * 2**20
    assert tiny.tokens == (tasks.MASK_ID, (tasks.EOS_ID,), tasks.PAD_ID)
    assert tiny.generation_config["gen_length"] == 16


def test_exact_match_on_held_out_prompts(tiny):
    """One token per step, as the training report measures (on other held-out prompts)."""
    held_out = tasks.examples("test", per_task=40, seed=7)
    assert all(tasks.split_of(e.prompt) == "test" for e in held_out)
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Fixed(16))
    scores = exact_match(tiny, held_out, settings, mode="eager").per_task
    assert min(scores.values()) >= 0.9, scores


def test_training_report_meets_the_target():
    report = json.loads((dlmrt.TINY_MODEL_DIR / "training_report.json").read_text())
    assert report["train_seconds"] < 15 * 60
    assert all(scores["mean"] >= 0.8 for scores in report["exact_match"].values())


@pytest.mark.parametrize("prompt, answer", [("add:762+139=", "0901"), ("sort:5203=", "0235")])
def test_the_installed_command_prints_the_answer(prompt, answer):
    """What the README's demo command runs: the console script, the default (tiny) model."""
    command = Path(sys.executable).parent / "dlmrt"
    result = subprocess.run([str(command), "generate", "--prompt", prompt], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == answer
