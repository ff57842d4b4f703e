"""generation_config.json: its one reader, which checks the fields dlmrt uses.

Hugging Face's file holds many generation fields; dlmrt reads its own few and keeps the others as they
are, unchecked and unused, as transformers keeps fields it does not know:

- `gen_length`, `block_length`, `steps`: integers (not booleans) in [1, MAX_POSITIONS];
- `trained_gen_length`, dlmrt's own: the one generation length a model was trained for (the tiny
  models; LLaDA-style models trained on many lengths leave it out), in the same range. A run at
  another length is warned (`dlmrt.runtime.settings.lengths_with_defaults`);
- `eos_token_id`: a token id or a non-empty list of them; `pad_token_id`, `mask_token_id`,
  `bos_token_id`: a token id; ids are integers in [0, MAX_VOCAB) (the vocabulary check comes once
  the model is known);
- `threshold`: a number in (0, 1]; `temperature`: a finite number >= 0.

A model directory and an export both hold one; an export's is checked against its sha256 first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dlmrt.core import json_files, limits
from dlmrt.core.errors import CheckpointError

FILE = "generation_config.json"
LENGTHS = ("gen_length", "block_length", "steps", "trained_gen_length")
SINGLE_IDS = ("pad_token_id", "mask_token_id", "bos_token_id")


def read(directory: Path, error: type[CheckpointError] = CheckpointError) -> dict[str, Any]:
    """The checked generation config of `directory`, or {} where it has none."""
    path = Path(directory) / FILE
    if not path.exists():
        return {}
    return check(json_files.read(path, error), str(path), error)


def check(raw: dict[str, Any], source: str, error: type[CheckpointError] = CheckpointError) -> dict[str, Any]:
    def refuse(field: str, expected: str) -> None:
        shown = repr(raw[field])
        raise error(f"{source}: field '{field}' must be {expected}, got {shown[:60]}: fix or delete the field")

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_id(value: Any) -> bool:
        return is_int(value) and 0 <= value < limits.MAX_VOCAB

    for field in LENGTHS:
        if field in raw and not (is_int(raw[field]) and 1 <= raw[field] <= limits.MAX_POSITIONS):
            refuse(field, f"an integer in [1, {limits.MAX_POSITIONS}]")
    for field in SINGLE_IDS:
        if raw.get(field) is not None and not is_id(raw[field]):
            refuse(field, "a token id (an integer >= 0) or null")
    eos = raw.get("eos_token_id")
    if eos is not None and not (is_id(eos) or (isinstance(eos, list) and eos and all(is_id(e) for e in eos))):
        refuse("eos_token_id", "a token id or a non-empty list of token ids")
    number = (int, float)
    if "threshold" in raw and not (isinstance(raw["threshold"], number) and not isinstance(raw["threshold"], bool)
                                   and 0 < raw["threshold"] <= 1):
        refuse("threshold", "a number in (0, 1]")
    if "temperature" in raw and not (isinstance(raw["temperature"], number)
                                     and not isinstance(raw["temperature"], bool)
                                     and math.isfinite(raw["temperature"]) and raw["temperature"] >= 0):
        refuse("temperature", "a finite number >= 0")
    return raw
