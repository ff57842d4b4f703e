"""Pick the engine for the running GPU from the store, and refuse one that does not match.

An engine runs only on the compute capability and TensorRT version it was built with, with the
plugins it was built against, and is only right for the export it was built from. Each check that
fails names what it found and the `dlmrt build` command that makes what is missing.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from dlmrt.engines import manifest as manifests
from dlmrt.engines import targets
from dlmrt.engines.plugin_specs import outdated
from dlmrt.engines.store import EngineStore
from dlmrt.core.errors import DlmrtError
from dlmrt.export.export_manifest import ExportManifest


class EngineMismatch(DlmrtError):
    """No engine in the store fits this export, GPU and TensorRT."""


@dataclass(frozen=True)
class Selected:
    entry: Path
    manifest: dict

    def engine(self, graph: str) -> Path:
        return self.entry / self.manifest["graphs"][graph]["engine"]


def build_command(export_dir: Path, target: str, precision: str, store: EngineStore) -> str:
    return (f"dlmrt build {shlex.quote(str(export_dir))} --target {target} --precision {precision} "
            f"--output {shlex.quote(str(store.root))}")


def select(store: EngineStore, export_dir: str | Path, *, capability: tuple[int, int], tensorrt_version: str,
           precision: str | None = None, graphs: tuple[str, ...] = ("full", "cached")) -> Selected:
    """The store's engine for the export in `export_dir` on a GPU of `capability` under TensorRT
    `tensorrt_version`; `precision` None takes the target's default precision."""
    export_dir = Path(export_dir)
    export = ExportManifest.read(export_dir)
    model = export.model.name
    target = targets.target_for_capability(capability)
    precision = precision or target.default_precision
    targets.check_precision(target, precision)
    command = build_command(export_dir, target.name, precision, store)
    entry = store.entry(model, f"{target.name}-{precision}")
    if not entry.is_dir():
        present = [path.name for path in store.entries() if path.parent.name == model]
        found = f"it holds {', '.join(present)}" if present else "it holds no engine of this model"
        raise EngineMismatch(f"no {target.name} {precision} engine of {model} in {store.root} ({found}): "
                             f"build it with `{command}`")
    record = manifests.read(entry)
    mismatches = _mismatches(record, export, capability, tensorrt_version, graphs)
    mismatches += manifests.problems(entry, record)
    if mismatches:
        raise EngineMismatch(f"the engine in {entry} does not fit: {'; '.join(mismatches)}. Rebuild it with "
                             f"`{command}`")
    return Selected(entry, record)


def _mismatches(record: dict, export: ExportManifest, capability: tuple[int, int], tensorrt_version: str,
                graphs: tuple[str, ...]) -> list[str]:
    found = []
    wanted_capability = ".".join(map(str, capability))
    if record["compute_capability"] != wanted_capability:
        found.append(f"it was built for compute capability {record['compute_capability']}, this GPU is "
                     f"{wanted_capability}")
    if record["tensorrt_version"] != tensorrt_version:
        found.append(f"it was built with TensorRT {record['tensorrt_version']}, this is TensorRT {tensorrt_version}")
    found += [f"it holds plugin {plugin}" for plugin in outdated(record["plugins"])]
    for graph in graphs:
        info = record["graphs"].get(graph)
        if info is None:
            found.append(f"it has no {graph} engine")
        elif graph not in export.graphs:
            found.append(f"the export has no {graph} graph")
        elif info["onnx_sha256"] != export.graph_sha256(graph):
            found.append(f"its {graph} engine was built from another export of this model (sha256 "
                         f"{info['onnx_sha256'][:16]}…, the export's is {export.graph_sha256(graph)[:16]}…)")
    return found
