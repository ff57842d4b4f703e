"""Where the test suite's time goes: the README's two pytest commands (the part of its test command after
the install), run from this checkout with `--durations=0`, beside `--busy` processes that each keep one
core busy, as CI's machine may be kept by other work. Prints each command's wall time and the files that
took longest, by the seconds their tests' setup, call and teardown took (on a loaded machine, a test's
seconds are its wall time, not CPU time).

    python scripts/suite_times.py --busy 1            # the CI goal: <= 15 minutes with one core busy
    python scripts/suite_times.py --busy 0 --top 30
    python scripts/suite_times.py --busy 1 -- tests/cli   # what pytest runs, in place of the whole suite

The commands run with this interpreter, so the install the README's command does first is not timed.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- ci: test command -->"  # what .ci/run reads the test command after
DURATION = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def pytest_commands(readme: Path) -> list[list[str]]:
    """The README's test command's pytest runs, as argument lists for `python -m pytest`."""
    lines = readme.read_text().splitlines()
    command = lines[lines.index(MARKER) + 2]
    runs = [part.strip() for part in command.split("&&") if " -m pytest " in part]
    if not runs:
        raise SystemExit(f"{readme}: no pytest command after the {MARKER!r} marker")
    return [shlex.split(run.split(" -m pytest ", 1)[1]) for run in runs]


def busy_loop() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=1, help="processes that each keep a core busy [default: 1]")
    parser.add_argument("--top", type=int, default=20, help="files to list [default: 20]")
    parser.add_argument("paths", nargs="*", help="pytest's paths, in place of the configured test paths")
    args = parser.parse_args(argv)

    console = Console()
    busy = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    seconds_per_file: collections.Counter[str] = collections.Counter()
    walls = []
    try:
        for pytest_args in pytest_commands(ROOT / "README.md"):
            command = [sys.executable, "-m", "pytest", *pytest_args, "--durations=0", "-p", "no:cacheprovider",
                       *args.paths]
            console.print(f"[bold]+ python {shlex.join(command[1:])}[/] beside {args.busy} busy core(s)")
            started = time.perf_counter()
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            walls.append((shlex.join(pytest_args), time.perf_counter() - started, result.returncode))
            summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
            console.print(f"  {summary[0]}")
            for line in result.stdout.splitlines():
                if match := DURATION.match(line):
                    seconds_per_file[match.group(2)] += float(match.group(1))
    finally:
        for process in busy:
            process.terminate()

    table = Table(title=f"the slowest {args.top} files (seconds of their tests, {args.busy} core(s) busy)")
    table.add_column("file")
    table.add_column("s", justify="right")
    table.add_column("share", justify="right")
    total = sum(seconds_per_file.values()) or 1.0
    for name, seconds in seconds_per_file.most_common(args.top):
        table.add_row(name, f"{seconds:.0f}", f"{seconds / total:.0%}")
    console.print(table)
    for command, wall, code in walls:
        console.print(f"{wall:7.0f} s  exit {code}  pytest {command}")
    console.print(f"{sum(wall for _, wall, _ in walls):7.0f} s  in all")
    no_tests = 5  # pytest's exit status when the paths hold no test of a command's marker
    return max(0 if code == no_tests else code for _, _, code in walls)


if __name__ == "__main__":
    sys.exit(main())
