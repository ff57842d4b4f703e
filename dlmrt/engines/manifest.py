"""`manifest.json` of an engine: what it was built from, for which GPU and TensorRT, and how.

It records the sha256 of the export's ONNX files (and of the quantized graphs built from them), of
every engine and of the timing cache, so `dlmrt inspect` can check an entry and the runtime can
refuse an engine that no longer matches its export, its GPU, its TensorRT or its plugins.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from dlmrt.core.version import __version__
from dlmrt.core import json_files
from dlmrt.engines.store import MANIFEST, TIMING_CACHE, engine_file
from dlmrt.core.errors import DlmrtError
from dlmrt.core.hashing import sha256_of

if TYPE_CHECKING:
    from dlmrt.engines.plan import BuildPlan

FORMAT_VERSION = 1
# What the readers (selection, inspect, TrtBackend) take from a manifest, with its JSON type; a
# manifest without one of them, or with another type, is refused as a whole.
REQUIRED = {"model": str, "target": str, "compute_capability": str, "precision": str, "tensorrt_version": str,
            "ranges": dict, "plugins": list, "graphs": dict}
REQUIRED_PER_GRAPH = {"onnx": str, "onnx_sha256": str, "engine": str, "engine_sha256": str}
REQUIRED_PER_PLUGIN = {"namespace": str, "name": str, "version": str}


class ManifestError(DlmrtError):
    """A manifest that is missing, unreadable, or does not match the files beside it."""


def make(plan: BuildPlan, entry: Path, *, tensorrt_version: str, device: str, build_s: float,
         built_graphs: dict[str, str]) -> dict:
    """The manifest of a finished build in `entry`; `built_graphs` maps each graph to the sha256 of the
    ONNX the engine was built from (the quantized graph for fp8 / nvfp4)."""
    plan_dict = plan.to_dict()
    return {
        "format_version": FORMAT_VERSION,
        "dlmrt_version": __version__,
        "model": plan.model,
        "target": plan.target,
        "compute_capability": ".".join(map(str, plan.compute_capability)),
        "device": device,
        "precision": plan.precision,
        "tensorrt_version": tensorrt_version,
        "typing": plan.typing,
        "builder_flags": plan.builder_flags,
        "export_dir": plan.export_dir,
        "quantization": plan.quantization,
        "ranges": plan.ranges,
        "plugins": plan.plugins,
        "options": plan_dict["options"],
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_s": round(build_s, 2),
        "graphs": {graph.name: {"onnx": graph.onnx, "onnx_sha256": graph.sha256,
                                "built_from_sha256": built_graphs[graph.name], "profile": graph.shapes,
                                "engine": engine_file(graph.name),
                                "engine_sha256": sha256_of(entry / engine_file(graph.name))}
                   for graph in plan.graphs},
        "timing_cache_sha256": sha256_of(entry / TIMING_CACHE) if (entry / TIMING_CACHE).is_file() else None,
    }


def to_json(record: dict) -> str:
    return json.dumps(record, indent=2) + "\n"


def read(entry: Path) -> dict:
    path = Path(entry) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{entry} holds no {MANIFEST}: it is not an engine built by `dlmrt build`")
    manifest = json_files.read(path, ManifestError, "rebuild the engine")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path} has format version {str(manifest.get('format_version'))[:20]!r}, this dlmrt "
                            f"reads {FORMAT_VERSION}: rebuild the engine with this dlmrt")
    _check_fields(manifest, REQUIRED, path, "")
    for name, graph in manifest["graphs"].items():
        _check_fields(graph, REQUIRED_PER_GRAPH, path, f"graphs.{name}.")
        engine = PurePosixPath(graph["engine"])
        if engine.is_absolute() or ".." in engine.parts or "\\" in graph["engine"]:
            raise ManifestError(f"{path}: graphs.{name}.engine must be a path inside the entry, got "
                                f"{graph['engine'][:80]!r}: rebuild the engine")
    for index, plugin in enumerate(manifest["plugins"]):
        _check_fields(plugin, REQUIRED_PER_PLUGIN, path, f"plugins[{index}].")
    if not all(isinstance(value, str) for value in manifest["ranges"].values()):
        raise ManifestError(f"{path}: every value of ranges must be a string like '1:4:8': rebuild the engine")
    return manifest


def _check_fields(record: object, required: dict[str, type], path: Path, prefix: str) -> None:
    if not isinstance(record, dict):
        raise ManifestError(f"{path}: {prefix.rstrip('.') or 'the manifest'} must be an object: rebuild the engine")
    for key, kind in required.items():
        if not isinstance(record.get(key), kind):
            found = "missing" if key not in record else f"{type(record[key]).__name__}, not {kind.__name__}"
            raise ManifestError(f"{path}: {prefix}{key} is {found}: rebuild the engine")


def problems(entry: Path, manifest: dict) -> list[str]:
    """Every file the manifest names that is missing or whose sha256 differs; empty when all match."""
    found = []
    files = [(info["engine"], info["engine_sha256"]) for info in manifest["graphs"].values()]
    if manifest.get("timing_cache_sha256"):
        files.append((TIMING_CACHE, manifest["timing_cache_sha256"]))
    for name, expected in files:
        path = Path(entry) / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif sha256_of(path) != expected:
            found.append(f"{name} has sha256 {sha256_of(path)[:16]}…, the manifest says {expected[:16]}…")
    return found
