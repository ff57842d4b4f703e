"""The first hour as a test: the README's Set-up and tour examples, run as a user runs them.

Every code block of the README's Set-up and tour carries a marker that says what it prints and how
long it may take (`<!-- example: prints "0901" within 120 s -->`), or why it is not run here. Each run
block must exit 0, print every text its marker names, say nothing of a bug in dlmrt, and finish
within its bound. So an example that drifts from the code fails CI.

- The demo's set-up command runs as written, in a copy of the repository with no environment: it
  makes its own `.venv` and installs into it.
- The tour's blocks run in order, in one workspace, as bash with `set -euo pipefail`. Its `.venv` is
  this test run's environment, which holds every extra: a block's `pip install -e '.[EXTRA]'` line is
  checked (the extra's requirements are installed) instead of run. `dlmrt` is on the PATH only through
  the tour's own `source .venv/bin/activate`. The server's port 8000 becomes a free port.
- The CI test command and the CI gate are not run here: `.ci/run` runs both.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!-- (example|ci): (.*?) -->\n$")
EXPECTATION = re.compile(r'prints (?P<texts>"[^"]*"(?:, "[^"]*")*) within (?P<seconds>\d+) s')
EXTRA_LINE = re.compile(r"^pip install -e '\.\[(\w+)\]'$", re.M)
SETUP_MARKER = "the shell's set-up for the blocks below"
NOT_RUN = "not run here: "
PORT = "8000"


@dataclass(frozen=True)
class Example:
    line: int
    language: str
    code: str
    marker: str  # the marker's text after "example: " ("ci: ..." for the CI command)
    section: str

    @property
    def expected(self) -> list[str]:
        return re.findall(r'"([^"]*)"', EXPECTATION.fullmatch(self.marker)["texts"])

    @property
    def within_s(self) -> float:
        return float(EXPECTATION.fullmatch(self.marker)["seconds"])

    @property
    def runs(self) -> bool:
        return EXPECTATION.fullmatch(self.marker) is not None

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def readme_examples() -> list[Example]:
    """Every code block from `## Set-up` to `## Layout`, with the marker on the line above it."""
    text = README.read_text()
    start, end = text.index("## Set-up"), text.index("## Layout")
    examples = []
    for fence in FENCE.finditer(text, start, end):
        before = text[:fence.start()]
        marker = MARKER.search(before[before.rfind("\n", 0, len(before) - 1) + 1:])
        section = re.findall(r"^## (.*)$", before, re.M)[-1]
        examples.append(Example(line=before.count("\n") + 1, language=fence[1], code=fence[2],
                                marker="" if marker is None else
                                marker[2] if marker[1] == "example" else f"ci: {marker[2]}", section=section))
    return examples


EXAMPLES = readme_examples()
SETUP = [e for e in EXAMPLES if e.section == "Set-up" and e.runs]
TOUR = [e for e in EXAMPLES if e.section != "Set-up" and (e.runs or e.marker == SETUP_MARKER)]


def test_every_example_says_what_it_prints_or_why_it_is_not_run():
    assert len(EXAMPLES) >= 10
    for example in EXAMPLES:
        known = example.runs or example.marker == SETUP_MARKER or example.marker.startswith((NOT_RUN, "ci: "))
        assert known, (f"{example}: mark the block above its fence with '<!-- example: prints \"TEXT\" within N "
                       f"s -->', or '<!-- example: {NOT_RUN}WHY -->'; found {example.marker!r}")
        assert example.language in ("bash", "python"), f"{example}: a {example.language!r} block cannot be run"
    assert len(SETUP) == 1 and "pip install" in SETUP[0].code
    assert [e.marker for e in EXAMPLES].count(SETUP_MARKER) == 1


def extra_is_installed(extra: str) -> bool:
    requirements = [Requirement(text) for text in importlib.metadata.requires("dlmrt") or ()]
    needed = [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})]
    assert needed, f"dlmrt has no extra {extra!r}"
    return all(_installed(r.name) for r in needed if r.name != "dlmrt")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def user_environment(home: Path) -> dict[str, str]:
    """A shell as a user opens it: no virtual environment on the PATH, no test-only settings."""
    ours = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "TORCHINDUCTOR_CACHE_DIR", "PYTHONPATH") and not k.startswith("PYTEST")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    env["DLMRT_HOME"] = str(home)
    return env


def run_as_user(command: list[str], cwd: Path, env: dict[str, str], example: Example) -> str:
    """Run `command` in its own process group, whose every process ends with it; its output."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=example.within_s)
    except subprocess.TimeoutExpired:
        end_process_group(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"{example} did not finish within its {example.within_s:.0f} s:\n{output[-3000:]}")
    finally:
        end_process_group(process.pid)  # a server the block left behind
    elapsed = time.monotonic() - started
    assert process.returncode == 0, f"{example} exited {process.returncode}:\n{output[-3000:]}"
    for text in example.expected:
        assert text in output, f"{example} should print {text!r}; it printed:\n{output[-3000:]}"
    assert "bug in dlmrt" not in output and "Traceback" not in output, output[-3000:]
    print(f"{example}: {elapsed:.1f} s")
    return output


def end_process_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_setup_command_installs_dlmrt_and_runs_the_demo(tmp_path):
    clone = tmp_path / "dlmrt"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "build", "dist"))
    run_as_user(["bash", "-euo", "pipefail", "-c", SETUP[0].code], clone, user_environment(tmp_path / "home"),
                SETUP[0])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The clone's directory as the tour finds it: its `.venv` holds dlmrt with every extra."""
    root = tmp_path_factory.mktemp("first-hour")
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return root


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.mark.parametrize("example", [e for e in TOUR if e.runs], ids=str)
def test_a_tour_example_prints_what_the_readme_says(example, workspace):
    env = user_environment(workspace / "home")
    if example.language == "python":
        run_as_user([str(workspace / ".venv" / "bin" / "python"), "-c", example.code], workspace, env, example)
        return
    for extra in EXTRA_LINE.findall(example.code):
        assert extra_is_installed(extra), f"{example}: the test environment lacks the {extra!r} extra it installs"
    script = EXTRA_LINE.sub("", example.code).replace(PORT, free_port())
    shell_setup = next(e.code for e in TOUR if e.marker == SETUP_MARKER)
    run_as_user(["bash", "-euo", "pipefail", "-c", shell_setup + script], workspace, env, example)
