"""Atomic writes: a reader sees the old file or directory, or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _default_mode(mode: int) -> int:
    """`mode` filtered by the process umask (temporary files and dirs are created private)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _default_mode(0o666))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place on success.

    If the body raises (or the process dies), `path` keeps whatever it held
    before; a leftover `.<name>.*.partial` sibling is never read by dlmrt.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    os.chmod(staging, _default_mode(0o777))
    try:
        yield staging
        for child in staging.iterdir():
            if child.is_file():
                os.chmod(child, _default_mode(0o666))  # some writers (safetensors) create 0600 files
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            # Two renames: the old directory is only removed once the new one is in place.
            retired = staging.with_suffix(".retired")
            os.replace(path, retired)
            os.replace(staging, path)
            shutil.rmtree(retired)
        else:
            os.replace(staging, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
