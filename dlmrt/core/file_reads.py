"""The one way dlmrt reads a file it is given: a regular file, within the bound of its kind, or one error.

- A path that is not a regular file (a directory, a device such as /dev/zero, a FIFO, a socket) is
  refused by its `stat`, before it is opened: opening a FIFO waits for a writer, and a device's data
  never ends. The file is then opened without waiting (O_NONBLOCK) and its descriptor checked again,
  in case the path changed in between.
- A file over its bound (`dlmrt.core.limits`' MAX_..._BYTES, looked up at each call) is refused by its
  size before a byte is read, and a read takes at most the bound and one byte more, so a file that
  grows meanwhile, or a /proc file that reports 0 bytes, is bounded too.

`read_bytes` and `read_text` read a file whole. `check_regular` is for a file that its library opens
itself (a safetensors file, which is mapped): its type and size are checked, then the library opens it.

Every refusal is one error of the caller's class that names the file, what it is (or its size against
the bound) and what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dlmrt.core.errors import DlmrtError
from dlmrt.core.limits import size

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))
TOO_LARGE = "check that it is the right file"
_CHUNK = 1 << 20  # what is read at a time past the size a file reports (a /proc file reports 0)


def check_regular(path: str | os.PathLike, error: type[DlmrtError], *, most: int, what: str,
                  too_large: str = TOO_LARGE, hint: str = "") -> int:
    """The size of the regular file at `path`; `error` when it is no regular file or holds more than `most`
    bytes. `what` names the file's role ("eval data", "a tokenizer"); `too_large` says what to do with a
    file over the bound, and `hint` what to do with one that cannot be read."""
    path = Path(path)
    try:
        found = os.stat(path)
    except OSError as problem:
        raise error(_unreadable(path, problem, hint)) from None
    _check(path, found, error, most, what, too_large)
    return found.st_size


def read_bytes(path: str | os.PathLike, error: type[DlmrtError], *, most: int, what: str,
               too_large: str = TOO_LARGE, hint: str = "") -> bytes:
    """The bytes of the regular file at `path`, at most `most` of them (see `check_regular`)."""
    path = Path(path)
    check_regular(path, error, most=most, what=what, too_large=too_large, hint=hint)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as problem:
        raise error(_unreadable(path, problem, hint)) from None
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        try:
            found = os.fstat(descriptor)
            _check(path, found, error, most, what, too_large)
            chunks, total, want = [], 0, found.st_size + 1  # the size it says, then more as long as it gives more
            while total <= most and (chunk := file.read(min(want, most + 1 - total))):
                chunks.append(chunk)
                total, want = total + len(chunk), _CHUNK
        except OSError as problem:
            raise error(_unreadable(path, problem, hint)) from None
    if total > most:
        raise error(_too_large(path, None, most, what, too_large))
    return b"".join(chunks)


def read_text(path: str | os.PathLike, error: type[DlmrtError], *, most: int, what: str,
              too_large: str = TOO_LARGE, hint: str = "") -> str:
    """The UTF-8 text of the regular file at `path` (see `read_bytes`)."""
    data = read_bytes(path, error, most=most, what=what, too_large=too_large, hint=hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise error(f"{path} is not UTF-8 text (byte {problem.start}){': ' + hint if hint else ''}") from None


def _check(path: Path, found: os.stat_result, error: type[DlmrtError], most: int, what: str, too_large: str) -> None:
    if not stat.S_ISREG(found.st_mode):
        kind = next((name for test, name in _KINDS if test(found.st_mode)), "not a regular file")
        raise error(f"{path} is {kind}: dlmrt reads {what} only from a regular file (save it to one, and give that)")
    if found.st_size > most:
        raise error(_too_large(path, found.st_size, most, what, too_large))


def _too_large(path: Path, found: int | None, most: int, what: str, to_do: str) -> str:
    held = f"is {size(found)}, more than" if found is not None else "holds more than"
    return f"{path} {held} dlmrt reads as {what} (at most {size(most)}): {to_do or TOO_LARGE}"


def _unreadable(path: Path, problem: OSError, hint: str) -> str:
    return f"{path} cannot be read ({problem.strerror or problem}){': ' + hint if hint else ''}"
