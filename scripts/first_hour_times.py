"""Wall times of a new user's first commands, from a fresh clone: the README's demo set-up, then
`dlmrt generate` and `dlmrt eval --per-task 5`, each twice (the second finds what the first cached).

    python scripts/first_hour_times.py --runs 3

Each run clones this repository's HEAD into a temporary directory, with a fresh `$DLMRT_HOME`, and runs
the set-up command as the README writes it (pip's own download cache is kept, as on a user's machine
after a first install). Prints a table of medians with their range.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "first dlmrt generate": ["generate", "--prompt", "add:762+139="],
    "second dlmrt generate": ["generate", "--prompt", "add:762+139="],
    "first dlmrt eval --per-task 5": ["eval", "--per-task", "5"],
    "second dlmrt eval --per-task 5": ["eval", "--per-task", "5"],
}


def setup_command() -> str:
    """The README's first bash block under Set-up: the demo's install-and-run line."""
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):]
    return re.search(r"```bash\n(.*?)\n```", setup, re.S)[1]


def timed(command, cwd: Path, env: dict, shell: bool = False) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, shell=shell, check=True, capture_output=True,
                   executable="/bin/bash" if shell else None)
    return time.perf_counter() - started


def one_run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        clone = Path(scratch) / "dlmrt"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TORCHINDUCTOR_CACHE_DIR")}
        env["DLMRT_HOME"] = str(Path(scratch) / "home")
        times = {"set-up command (venv, torch, dlmrt, demo)": timed(setup_command(), clone, env, shell=True)}
        for name, args in COMMANDS.items():
            times[name] = timed([str(clone / ".venv" / "bin" / "dlmrt"), *args], clone, env)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = []
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("fresh clones", total=args.runs)
        for _ in range(args.runs):
            runs.append(one_run())
            progress.advance(task)
    table = Table(title=f"the first hour's commands, wall seconds over {args.runs} fresh clones")
    for column in ("command", "median", "range"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name in runs[0]:
        values = [run[name] for run in runs]
        table.add_row(name, f"{statistics.median(values):.1f}", f"{min(values):.1f}-{max(values):.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
