"""dlmrt: a compiled-graph inference runtime for diffusion language models.

    import dlmrt
    model = dlmrt.load("path/to/LLaDA-8B-Instruct", dtype="bfloat16")
    logits = model(ids)  # [B, T] -> [B, T, V]

Heavy imports (torch) happen on first use, so `import dlmrt` and `dlmrt --help` stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlmrt.core.version import __version__ as __version__

# The tiny LLaDA-family model trained by scripts/train_tiny.py and shipped with the package.
TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-llada"
# Its ORL fine-tune (scripts/train_orl.py): the same model with the residual pathway, trained on-policy.
TINY_ORL_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-llada-orl"

if TYPE_CHECKING:
    from dlmrt.models import Denoiser


def load(path: str | Path = TINY_MODEL_DIR, *, dtype: Any = "float32", device: str = "cpu",
         mask_id: int | None = None, eos_id: int | list[int] | None = None,
         pad_id: int | None = None) -> Denoiser:
    """Load a denoiser from a Hugging Face model directory (default: the tiny model).

    dtype: "float32", "bfloat16", "float16", a torch dtype, or "auto" (config.json's).
    mask_id, eos_id, pad_id override the ids found in config.json / generation_config.json.
    """
    from dlmrt.models.checkpoint import load as load_checkpoint

    return load_checkpoint(path, dtype=dtype, device=device, mask_id=mask_id, eos_id=eos_id,
                           pad_id=pad_id)
