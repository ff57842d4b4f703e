"""The exports the test session shares: each is made once, by whichever xdist worker asks first, and
read by every test and worker that names it. An export takes 10 to 40 seconds on two cores, so a
test file that exported its own copy of a graph another file had made cost CI minutes.

A test that changes an export works on a copy (`shutil.copytree`); the shared directory is only read.
The models are deterministic (fixed seeds, checkpoints in the repository), so every worker's torch
model is the one the shared export was made from.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from dlmrt.export.export_manifest import MANIFEST_FILE

DATA = Path(__file__).parent / "data"
ASSETS = Path(__file__).parents[1] / "dlmrt" / "assets"


def _load(directory: Path):
    import dlmrt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DiffusionGemma's image tower is not loaded, and says so
        return dlmrt.load(directory)


def _random(name: str):
    from helpers import LLADA, LLADA2, ORL, config, random_model

    return {"llada": lambda: random_model(LLADA),
            "orl": lambda: random_model(config(LLADA, residual_context=ORL), seed=3),
            "llada2": lambda: random_model(LLADA2),
            "other": lambda: random_model(config(LLADA, n_layers=3, n_heads=2, n_kv_heads=2), seed=4)}[name]()


@dataclass(frozen=True)
class SharedExport:
    model: Callable[[], object]  # the torch model the export is made from
    options: dict = field(default_factory=dict)  # onnx_export.export's keyword arguments


GUIDED = {"max_batch": 8, "max_length": 48, "block_length": 4, "guidance": True}

SHARED_EXPORTS: dict[str, SharedExport] = {
    "tiny": SharedExport(lambda: _load(ASSETS / "tiny-llada"), {"max_batch": 8, "max_length": 64}),
    "tiny_orl": SharedExport(lambda: _load(ASSETS / "tiny-llada-orl"), {"max_batch": 8, "max_length": 64}),
    "tiny_diffusion_gemma": SharedExport(lambda: _load(ASSETS / "tiny-diffusion-gemma"),
                                         {"max_batch": 16, "max_length": 48}),
    # random models of the masked families, with the guidance graphs
    "llada": SharedExport(lambda: _random("llada"), GUIDED),
    "orl": SharedExport(lambda: _random("orl"), GUIDED),
    "llada2": SharedExport(lambda: _random("llada2"), GUIDED),
    "other": SharedExport(lambda: _random("other"), {"max_batch": 8, "max_length": 64}),  # more layers, other heads
    # the checkpoints the public code wrote, whose generates are recorded
    "llada21": SharedExport(lambda: _load(DATA / "llada21"), {"max_batch": 4, "max_length": 64, "block_length": 4}),
    "dream": SharedExport(lambda: _load(DATA / "dream"), {"max_batch": 4, "max_length": 64}),
    "sdar": SharedExport(lambda: _load(DATA / "sdar"), {"max_batch": 4, "max_length": 64, "block_length": 4}),
    "diffusion_gemma": SharedExport(lambda: _load(DATA / "diffusion_gemma"), {"max_batch": 4, "max_length": 48}),
}


class SharedExports:
    """`exports[name]` is the directory of SHARED_EXPORTS[name], exported on first use."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> Path:
        from dlmrt.export import onnx_export

        spec, target = SHARED_EXPORTS[name], self.root / name
        with FileLock(self.root / f"{name}.lock"):
            if not (target / MANIFEST_FILE).exists():  # the export writes its manifest last, atomically
                onnx_export.export(spec.model(), target, **spec.options)
        return target
