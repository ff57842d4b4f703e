"""What the CLI and `dlmrt.runtime.text` need of a model, read from an export directory alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmrt.export import generation_config
from dlmrt.export.checkpoint import load_tokenizer
from dlmrt.export.export_manifest import ExportManifest, ExportManifestError
from dlmrt.export.models.denoiser import SpecialTokens


@dataclass
class ExportedModel:
    """The export's name, token ids, block grid, tokenizer and generation config."""

    name: str
    tokens: SpecialTokens
    block_causal: bool
    default_block_length: int | None
    tokenizer: Any = None
    generation_config: dict = field(default_factory=dict)
    noise: str = "mask"  # exports of uniform-noise models are not made yet

    @classmethod
    def load(cls, export_dir: str | Path) -> ExportedModel:
        """The export's text-side facts; its tokenizer and generation config are checked against their
        sha256 before either is read."""
        export_dir = Path(export_dir)
        manifest = ExportManifest.read(export_dir)
        manifest.check_files(export_dir, names=("tokenizer.json", generation_config.FILE))
        return cls(name=manifest.model.name, tokens=manifest.tokens, block_causal=manifest.model.block_causal,
                   default_block_length=manifest.model.block_grid, tokenizer=load_tokenizer(export_dir),
                   generation_config=generation_config.read(export_dir, ExportManifestError))
