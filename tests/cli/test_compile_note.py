"""The note `dlmrt generate` shows on a terminal while the executor compiles or captures a step."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from rich.progress import Progress

from dlmrt.cli.commands import main
from dlmrt.cli.progress import CompileNotes
from dlmrt.models import checkpoint
from helpers import LLADA, random_model

TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # rich's console then draws its live display


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoint.save(random_model(LLADA), tmp_path_factory.mktemp("note") / "model")


@pytest.fixture
def shown(monkeypatch):
    """Every description the progress display is given, in order."""
    descriptions = []
    update = Progress.update

    def recording(self, task, **fields):
        if fields.get("description") is not None:
            descriptions.append(fields["description"])
        return update(self, task, **fields)
    monkeypatch.setattr(Progress, "update", recording)
    return descriptions


def generate(model_dir, mode):
    return CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--prompt-ids", "5,6", "--gen-length",
                                     "4", "--block-length", "4", "--steps-per-sync", "1", "--mode", mode],
                              env=TERMINAL)


def test_compile_mode_shows_what_it_compiles(model_dir, shown):
    result = generate(model_dir, "compile")
    assert result.exit_code == 0, result.output
    notes = [text for text in shown if text.startswith("compile: ")]
    assert notes and notes[0].startswith("compile: 1 step(s) for ")
    assert notes[0].endswith("(once per shape per process)")
    assert "compile: 1 step(s) for " in result.stderr  # drawn on the terminal, not only handed to the display
    assert shown.index(notes[0]) > 0  # after the display opened on its step count
    assert result.stdout.strip()  # the completion is still printed on stdout


def test_eager_mode_shows_no_compile_note(model_dir, shown):
    result = generate(model_dir, "eager")
    assert result.exit_code == 0, result.output
    assert shown and all(text.startswith("denoising: step") for text in shown)


def test_notes_reach_the_display_only_while_it_is_open():
    seen, notes = [], CompileNotes()
    notes("before")
    with notes.shown_by(seen.append):
        notes("while")
    notes("after")
    assert seen == ["while"]
