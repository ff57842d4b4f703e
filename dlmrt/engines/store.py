"""The engine store: `<root>/<model>/<target>-<precision>/` with each graph's `engine.plan`,
`timing.cache` and `manifest.json` (by default `$DLMRT_HOME/engines`, never the source tree).

An entry is replaced as a whole and atomically. Each build writes a new version directory under
`<model>/.versions/`, and the entry is a symbolic link that one `rename` moves from the old version
to the new: a reader, or a build killed at any point, sees the old entry or the new one, never a
mix. A lock file serializes builds of the same entry; versions a killed build left half-written are
removed by the next build of that entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from dlmrt.core import atomic
from dlmrt.core.errors import DlmrtError
from dlmrt.core.home import home

MANIFEST = "manifest.json"
TIMING_CACHE = "timing.cache"
ENGINE = "engine.plan"
VERSIONS = ".versions"
_PARTIAL = ".partial"


class StoreError(DlmrtError):
    """The store holds something dlmrt did not write, or cannot be written."""


def default_root() -> Path:
    return home() / "engines"


def engine_file(graph: str) -> str:
    """Where a graph's engine lies inside an entry."""
    return f"{graph}/{ENGINE}"


class EngineStore:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def entry(self, model: str, key: str) -> Path:
        return self.root / model / key

    def entries(self) -> list[Path]:
        """Every entry in the store that can be read, as `<root>/<model>/<key>` paths."""
        broken = self.broken_entries()
        return [entry for entry in self._candidates() if entry not in broken]

    def broken_entries(self) -> dict[Path, str]:
        """The entries that cannot be read, and why: a link to nothing, one that leads out of the
        store, a file where an entry belongs, or an entry whose manifest is missing or not a file."""
        root, found = self.root.resolve(), {}
        for entry in self._candidates():
            if entry.is_symlink() and not entry.exists():
                found[entry] = f"is a link to nothing ({os.readlink(entry)})"
            elif not entry.resolve().is_relative_to(root):
                found[entry] = f"leads out of the store, to {entry.resolve()}"
            elif not entry.is_dir():
                found[entry] = "is not a directory"
            elif not (entry / MANIFEST).is_file():
                found[entry] = f"has no {MANIFEST} file"
        return found

    def _candidates(self) -> list[Path]:
        """What sits where entries do: under each model directory a build made (it holds VERSIONS)."""
        if not self.root.is_dir():
            return []
        return sorted(entry for model in self.root.iterdir() if (model / VERSIONS).is_dir()
                      for entry in model.iterdir() if not entry.name.startswith("."))

    def read_timing_cache(self, model: str, key: str) -> bytes | None:
        path = self.entry(model, key) / TIMING_CACHE
        return path.read_bytes() if path.is_file() else None

    @contextlib.contextmanager
    def writing(self, model: str, key: str) -> Iterator[Path]:
        """Yield an empty directory to fill; on success it becomes the entry, atomically.

        If the body raises or the process dies, the entry keeps its previous version.
        """
        entry = self.entry(model, key)
        versions = entry.parent / VERSIONS
        versions.mkdir(parents=True, exist_ok=True)
        if entry.exists() and not entry.is_symlink():
            raise StoreError(f"{entry} is a directory dlmrt did not write (entries are links into "
                             f"{VERSIONS}/): move it away and build again")
        with _locked(entry.parent / f".{key}.lock"):
            _remove_partial_versions(versions, key)
            staging = versions / f"{key}.{uuid.uuid4().hex[:12]}{_PARTIAL}"
            staging.mkdir()
            try:
                yield staging
                _fsync_tree(staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            version = staging.with_name(staging.name[:-len(_PARTIAL)])
            os.replace(staging, version)
            previous = entry.resolve() if entry.is_symlink() else None
            link = entry.with_name(f".{key}.link-{uuid.uuid4().hex[:8]}")
            os.symlink(Path(VERSIONS) / version.name, link)
            os.replace(link, entry)  # the one atomic step: the entry now names the new version
            atomic.fsync_dir(entry.parent)
            if previous is not None and previous != version.resolve():
                shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"another dlmrt build is writing {path.name[1:-5]} in {path.parent}: "
                             f"wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_partial_versions(versions: Path, key: str) -> None:
    for leftover in versions.glob(f"{key}.*{_PARTIAL}"):
        shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        else:
            atomic.fsync_dir(path)
    atomic.fsync_dir(root)
