"""What a command shows while it works, on a terminal only: a transient step count, and a note in its place
while something compiles."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager


class CompileNotes:
    """The executor's `on_compile` for a backend opened before the display that shows its notes: a note goes
    to the step display open at the time (`step_progress(..., notes=)`), and nowhere when none is."""

    def __init__(self):
        self._show: Callable[[str], None] | None = None

    def __call__(self, text: str) -> None:
        if self._show is not None:
            self._show(text)

    @contextmanager
    def shown_by(self, show: Callable[[str], None]):
        self._show = show
        try:
            yield
        finally:
            self._show = None


def step_progress(console, label: str = "denoising: step {task.completed}", notes: CompileNotes | None = None):
    """A transient "denoising step N" display on a terminal (a no-op elsewhere). It yields `advance()`;
    `advance.note(text)` shows `text` instead until the next advance (e.g. while compiling), and so do the
    `notes` of a backend, while the display is open."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    @contextmanager
    def progress():
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True,
                      console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("", total=None)

            def show_count():
                bar.update(task, description=label.format(task=bar.tasks[0]))

            def advance():
                bar.advance(task)
                show_count()

            advance.note = lambda text: bar.update(task, description=text)
            show_count()
            if notes is None:
                yield advance
            else:
                with notes.shown_by(advance.note):
                    yield advance
    return progress()
