"""The TensorRT plugins dlmrt registers, as the engine side sees them: which custom ONNX nodes they
serve, the fields such a node must carry, and their versions (recorded in plans and manifests)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from dlmrt.ops.entropy_bound import onnx_function as entropy_bound
from dlmrt.ops.parallel_unmask import onnx_function as parallel_unmask
from dlmrt.ops.residual_context import onnx_function as residual_context


@dataclass(frozen=True)
class PluginSpec:
    name: str  # the node's op type
    namespace: str  # the node's plugin_namespace (its domain)
    version: str  # the op's interface version, which plans and manifests record
    registry_version: str  # the node's plugin_version: the version TensorRT's plugin registry knows it by
    fields: dict[str, int]  # attribute name -> onnx.AttributeProto type, beside namespace and version
    inputs: int
    outputs: int

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def record(self) -> dict:
        """How plans and manifests name the plugin."""
        return {"name": self.name, "namespace": self.namespace, "version": self.version}


def _spec(module, fields: dict[str, int]) -> PluginSpec:
    return PluginSpec(module.OP_TYPE, module.DOMAIN, module.PLUGIN_VERSION, module.TENSORRT_PLUGIN_VERSION, fields,
                      len(module.INPUTS), len(module.OUTPUTS))


KNOWN: dict[tuple[str, str], PluginSpec] = {spec.key: spec for spec in (
    _spec(parallel_unmask, {"mask_id": onnx.AttributeProto.INT}),
    _spec(residual_context, {}),
    _spec(entropy_bound, {}),
)}


def used_by(models: Iterable[onnx.ModelProto]) -> list[dict]:
    """The plugin records of the known plugins whose nodes the models hold, in a stable order."""
    keys = {(node.domain, node.op_type) for model in models for node in model.graph.node}
    return [spec.record() for key, spec in sorted(KNOWN.items()) if key in keys]


def outdated(records: list[dict]) -> list[str]:
    """The recorded plugins whose version differs from this dlmrt's (or that it no longer has)."""
    found = []
    for record in records:
        spec = KNOWN.get((record["namespace"], record["name"]))
        have = f"{record['namespace']}::{record['name']} v{record['version']}"
        if spec is None:
            found.append(f"{have}, which this dlmrt does not have")
        elif spec.version != record["version"]:
            found.append(f"{have}, this dlmrt has v{spec.version}")
    return found
