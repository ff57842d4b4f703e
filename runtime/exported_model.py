"""What the CLI and `dlmrt.runtime.text` need of a model, read from an export directory alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmrt.export.export_manifest import ExportManifest
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

    @classmethod
    def load(cls, export_dir: str | Path) -> ExportedModel:
        from tokenizers import Tokenizer

        export_dir = Path(export_dir)
        manifest = ExportManifest.read(export_dir)
        tokenizer_path = export_dir / "tokenizer.json"
        generation_path = export_dir / "generation_config.json"
        return cls(name=manifest.model.name, tokens=manifest.tokens, block_causal=manifest.model.block_causal,
                   default_block_length=manifest.model.block_grid,
                   tokenizer=Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None,
                   generation_config=json.loads(generation_path.read_text()) if generation_path.is_file() else {})
