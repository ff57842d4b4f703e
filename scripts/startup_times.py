"""Start-up with warm caches: process start to the first committed text of `dlmrt generate --stream`
(its first bytes on stdout), and the whole command, for the tiny model and for llada-512x6.

    python scripts/startup_times.py --runs 3

Every command runs once first, in a fresh `$DLMRT_HOME`, so that the timed runs find inductor's
kernels cached; the timed runs then take turns. llada-512x6 is the bench's random LLaDA (hidden 512,
6 layers), written as a checkpoint; it decodes llama.cpp's comparison work (docs/cpu.md): a 32-token
prompt, 128 tokens in blocks of 32, fixed 128 steps, no cache. Prints medians with their range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

DLMRT = Path(sys.executable).with_name("dlmrt")


def commands(llada: Path) -> dict[str, list[str]]:
    prompt = ",".join(str(5 + 7 * i % 1900) for i in range(32))
    same_work = ["--model", str(llada), "--prompt-ids", prompt, "--gen-length", "128", "--block-length", "32",
                 "--policy", "fixed", "--steps", "128", "--cache", "none", "--stream"]
    return {
        'the tiny model: generate --prompt "add:762+139=" --stream': ["--prompt", "add:762+139=", "--stream"],
        "llada-512x6, fixed 128 steps, no cache (auto)": same_work,
        "the same, --mode eager": [*same_work, "--mode", "eager"],
        "the same, --mode compile": [*same_work, "--mode", "compile"],
    }


def timed(args: list[str], env: dict) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to exit)."""
    started = time.perf_counter()
    process = subprocess.Popen([str(DLMRT), "generate", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=env)
    process.stdout.read(1)
    first = time.perf_counter() - started
    process.stdout.read()
    stderr = process.stderr.read()
    if process.wait() != 0:
        raise SystemExit(f"dlmrt generate {' '.join(args)} failed:\n{stderr.decode()}")
    return first, time.perf_counter() - started


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if not DLMRT.exists():
        raise SystemExit(f"no dlmrt command beside {sys.executable}: run this script with the Python of the "
                         f"environment dlmrt is installed in (e.g. .venv/bin/python)")
    from dlmrt.bench.models import random_model
    from dlmrt.models import checkpoint

    with tempfile.TemporaryDirectory() as scratch:
        llada = checkpoint.save(random_model("llada-512x6"), Path(scratch) / "llada-512x6")
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        env["DLMRT_HOME"] = str(Path(scratch) / "home")
        cases = commands(llada)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        with Progress(console=Console(stderr=True)) as progress:
            task = progress.add_task("dlmrt generate", total=len(cases) * (args.runs + 1))
            for command in cases.values():  # the warm-up: fills $DLMRT_HOME's caches
                timed(command, env)
                progress.advance(task)
            for _ in range(args.runs):
                for name, command in cases.items():
                    times[name].append(timed(command, env))
                    progress.advance(task)
    table = Table(title=f"start-up with warm caches, median of {args.runs} runs (range)")
    for column in ("command", "first text", "whole command"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, runs in times.items():
        table.add_row(name, spread([first for first, _ in runs]), spread([whole for _, whole in runs]))
    Console(width=None if sys.stdout.isatty() else 120).print(table)


if __name__ == "__main__":
    main()
