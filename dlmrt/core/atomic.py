"""Atomic writes: a reader sees the old file or directory, or the new one, never half of one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dlmrt.core.errors import ArgumentError


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


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 RENAME_EXCHANGE); False where the system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an old kernel, or a file system without it
        return False
    raise OSError(code, os.strerror(code), str(first))


def _leftovers(path: Path) -> list[Path]:
    """Staging siblings of `path` whose writing process is gone (their names carry its pid)."""
    found = []
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        pid = sibling.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            found.append(sibling)
        except PermissionError:  # alive, another user's
            pass
    return found


@contextlib.contextmanager
def directory(path: str | os.PathLike, *, replaces: Callable[[Path], bool], what: str) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place on success.

    `path` may be new, an empty directory, or a directory `replaces` recognizes as `what` (one dlmrt
    wrote); anything else is refused before any work, so nothing a user made is lost. If the body
    raises (or the process dies), `path` keeps whatever it held before: the new directory takes its
    place in one exchange where the system has one (else two renames, the old directory removed only
    once the new one is in place). A leftover `.<name>.<pid>.*.partial` sibling is never read by
    dlmrt, and is removed by the next write of `path` once its process is gone.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{path} is a file, and {what} is a directory: choose another path")
    if path.is_dir() and any(path.iterdir()) and not replaces(path):
        raise ArgumentError(f"{path} exists and is not {what}: dlmrt replaces only what it wrote; choose a new "
                            f"directory, or empty this one")
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in _leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".partial", dir=path.parent))
    os.chmod(staging, _default_mode(0o777))
    try:
        yield staging
        for child in staging.iterdir():
            if child.is_file():
                os.chmod(child, _default_mode(0o666))  # some writers (safetensors) create 0600 files
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
        if not path.exists():
            os.replace(staging, path)
        elif exchange(staging, path):
            shutil.rmtree(staging)  # now the old directory
        else:
            retired = staging.with_suffix(".retired")
            os.replace(path, retired)
            os.replace(staging, path)
            shutil.rmtree(retired)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
