"""What the CLI and `dlmrt.runtime.text` need of a model, read from an export directory alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmrt.models import generation_config
from dlmrt.models.checkpoint import load_tokenizer
from dlmrt.export.export_manifest import ExportManifest, ExportManifestError
from dlmrt.models.denoiser import SpecialTokens


@dataclass
class ExportedModel:
    """The export's name, token ids, block grid, tokenizer and generation config."""

    name: str
    tokens: SpecialTokens
    block_causal: bool
    default_block_length: int | None
    tokenizer: Any = None
    generation_config: dict = field(default_factory=dict)
    noise: str = "mask"  # "uniform": an export of a uniform-noise model (DiffusionGemma)

    @classmethod
    def load(cls, export_dir: str | Path) -> ExportedModel:
        """The export's text-side facts; its tokenizer and generation config are checked against their
        sha256 before either is read."""
        export_dir = Path(export_dir)
        manifest = ExportManifest.read(export_dir)
        manifest.check_files(export_dir, names=("tokenizer.json", generation_config.FILE))
        facts = manifest.model
        return cls(name=facts.name, tokens=manifest.tokens, block_causal=facts.block_causal,
                   default_block_length=facts.canvas_length if facts.noise == "uniform" else facts.block_grid,
                   tokenizer=load_tokenizer(export_dir),
                   generation_config=generation_config.read(export_dir, ExportManifestError), noise=facts.noise)
