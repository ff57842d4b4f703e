"""ONNX Runtime's saved optimized models (the CLI keeps them in $DLMRT_HOME/ort), sealed.

ONNX Runtime can save the graph a session optimized (`optimized_model_filepath`), and a later session
that loads it with optimizations off starts seconds sooner. That file is a whole model, weights
included: one that was changed (its LM head negated, say) would run as it is. So each saved model is
sealed with an HMAC-SHA256 of its bytes, under a key that only this user can read (`.key` in the
cache directory, mode 0600, made on first use). `load` returns a model's bytes only when its seal
matches, and the bytes it checked are the bytes the session is given; a model with a missing or
wrong seal is deleted, and the export (whose files the manifest's sha256 checked) is optimized again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import stat
from pathlib import Path

from dlmrt.core import atomic

KEY_FILE, KEY_BYTES, SEAL_SUFFIX = ".key", 32, ".hmac"


class OptimizedModelCache:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, graph: str, graph_sha256: str, optimization: str, device: str) -> Path:
        """Where the optimized model of one graph is kept: keyed by the graph's sha256, the level and the
        provider (an optimized model holds its provider's own fused nodes), so a changed export never
        picks up a stale one."""
        return self.directory / f"{graph}-{graph_sha256[:16]}-{optimization}-{device}.onnx"

    def load(self, path: Path) -> bytes | None:
        """The sealed model at `path`, or None (after removing it) when it is absent or not sealed."""
        if not path.is_file():
            return None
        data = path.read_bytes()
        seal = path.with_name(path.name + SEAL_SUFFIX)
        if seal.is_file() and hmac.compare_digest(seal.read_text().strip(), self._seal(data)):
            return data
        for stale in (path, seal):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        return None

    def writing_path(self, path: Path) -> Path:
        """Where ONNX Runtime writes the optimized model before `keep` seals it and moves it into place."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def keep(self, written: Path, path: Path) -> None:
        atomic.write_text(path.with_name(path.name + SEAL_SUFFIX), self._seal(written.read_bytes()))
        os.replace(written, path)

    def _seal(self, data: bytes) -> str:
        return hmac.new(self._key(), data, hashlib.sha256).hexdigest()

    def _key(self) -> bytes:
        path = self.directory / KEY_FILE
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            mode = path.stat().st_mode
            key = path.read_bytes()
            if len(key) == KEY_BYTES and not mode & (stat.S_IRWXG | stat.S_IRWXO):
                return key
            path.unlink()  # readable by others, or cut short: every seal made with it is void
        except FileNotFoundError:
            pass
        key = os.urandom(KEY_BYTES)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            return self._key()
        with os.fdopen(descriptor, "wb") as file:
            file.write(key)
            file.flush()
            os.fsync(file.fileno())
        return key
