"""A quantized copy of an export: what every quantizer of dlmrt.quant writes the same way.

    quantized_copy(export_dir, out_dir, quantize_graph, describe, on_graph)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from dlmrt.core import atomic


def quantized_copy(export_dir: Path, out_dir: str | Path, quantize_graph: Callable[[str, Path, Path], None],
                   describe: Callable[[], dict], on_graph: Callable[[str], None] | None = None) -> Path:
    """A copy of the export `export_dir` in `out_dir`, written atomically: each graph written by
    `quantize_graph(graph, source, target)`, every other file as it is, and the manifest with its files'
    hashes and the changes `describe()` gives once every graph is written (its `quantization`, and any
    other manifest field). `on_graph(graph)` follows each graph."""
    from dlmrt.export.export_manifest import ExportManifest

    manifest = ExportManifest.load(export_dir)
    graph_files = {entry.file for entry in manifest.graphs.values()}
    with atomic.directory(out_dir, replaces=ExportManifest.present, what="a dlmrt export") as staging:
        for graph, entry in manifest.graphs.items():
            quantize_graph(graph, export_dir / entry.file, staging / entry.file)
            if on_graph is not None:
                on_graph(graph)
        for name in manifest.files:
            if name not in graph_files:
                shutil.copy2(export_dir / name, staging / name)
        manifest.with_files(staging, **describe()).save(staging)
    return Path(out_dir)
