"""Where dlmrt keeps what it builds (exports, engines): `$DLMRT_HOME`, else the user's cache directory.
Never inside the source tree."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    if os.environ.get("DLMRT_HOME"):
        return Path(os.environ["DLMRT_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "dlmrt"


def keep_compiled_steps() -> None:
    """Point torch.compile's caches at $DLMRT_HOME/inductor, unless TORCHINDUCTOR_CACHE_DIR says otherwise.
    It takes only before inductor first asks for its directory, so the command calls it before torch loads."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home() / "inductor"))
