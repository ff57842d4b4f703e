"""sha256 of files, streamed, for the manifests of exports and engines."""

from __future__ import annotations

import hashlib
import os


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
