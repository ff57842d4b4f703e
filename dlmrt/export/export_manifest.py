"""The export manifest, `dlmrt.json`: the one place that reads, checks and writes it.

An export directory holds the step graphs and everything a runtime needs to run them without the
torch model: the model's description (`dlmrt.models.description`: sizes, dtype, block grid, whether
it is ORL), its special token ids, the batch and length limits the graphs were exported for, each
graph's file and I/O contract (the name, dtype and shape of every input and output, with the dynamic
axes named), the sha256 of every file, and for a quantized copy how it was quantized.

`ExportManifest.read` parses and checks the manifest; `load` also checks every file against its
recorded hash. A malformed file gets one error that names the field; nothing else in dlmrt opens
`dlmrt.json`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dlmrt.core import atomic, json_files
from dlmrt.core.errors import CheckpointError
from dlmrt.models import FAMILIES
from dlmrt.models.description import NOISE_KINDS, ModelDescription, SpecialTokens
from dlmrt.models.step_graph import EDITING_INPUTS, GRAPHS, GUIDED_GRAPHS, LOGITS_OUTPUT
from dlmrt.core.hashing import sha256_of

MANIFEST_FILE = "dlmrt.json"
FORMAT_VERSION = 1
# A uniform-noise model's graphs (dlmrt/export/uniform_export.py), in place of the step graphs.
CANVAS_GRAPHS = ("encode", "decode", "soft_tokens")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REEXPORT = "re-export the model with `dlmrt export MODEL_DIR -o DIR`"


class ExportManifestError(CheckpointError):
    """An export directory's manifest is missing, malformed, of another format, or its files differ."""


@dataclass(frozen=True)
class TensorContract:
    name: str
    dtype: str  # numpy's name: "float32", "int64", "bool", ...
    shape: tuple[int | str, ...]  # a fixed size, or a named dynamic axis ("batch", "2*batch", ...)

    @classmethod
    def of_values(cls, values) -> tuple[TensorContract, ...]:
        """The contract of an ONNX graph's inputs or outputs (`graph.input`, `graph.output`)."""
        from onnx.helper import tensor_dtype_to_np_dtype

        found = []
        for value in values:
            tensor = value.type.tensor_type
            found.append(cls(name=value.name, dtype=tensor_dtype_to_np_dtype(tensor.elem_type).name,
                             shape=tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)))
        return tuple(found)


@dataclass(frozen=True)
class GraphEntry:
    file: str
    inputs: tuple[TensorContract, ...]
    outputs: tuple[TensorContract, ...]


@dataclass(frozen=True)
class ExportLimits:
    max_batch: int
    max_length: int


@dataclass(frozen=True)
class ExportManifest:
    model: ModelDescription
    tokens: SpecialTokens
    limits: ExportLimits
    graphs: dict[str, GraphEntry]
    files: dict[str, str]  # file name -> sha256, every file of the directory but the manifest
    opset: int
    dlmrt_version: str
    torch_version: str
    onnx_version: str
    exported_s: float
    quantization: dict[str, Any] | None = None  # how a quantized copy was made (dlmrt/quant)
    format_version: int = FORMAT_VERSION

    @staticmethod
    def present(export_dir: str | Path) -> bool:
        """Whether `export_dir` looks like an export (holds a manifest); nothing is checked."""
        return (Path(export_dir) / MANIFEST_FILE).is_file()

    @classmethod
    def read(cls, export_dir: str | Path) -> ExportManifest:
        """The checked manifest of `export_dir` (its other files unchecked)."""
        export_dir = Path(export_dir)
        path = export_dir / MANIFEST_FILE
        if not path.is_file():
            raise ExportManifestError(f"{export_dir} is not a dlmrt export (no {MANIFEST_FILE}): create one with "
                                      f"`dlmrt export MODEL_DIR -o {export_dir}`")
        data = json_files.read(path, ExportManifestError, _REEXPORT, require_object=False)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def load(cls, export_dir: str | Path) -> ExportManifest:
        """`read`, then every file checked against its recorded sha256."""
        manifest = cls.read(export_dir)
        manifest.check_files(export_dir)
        return manifest

    def check_files(self, export_dir: str | Path, names: tuple[str, ...] | None = None) -> None:
        """Every file (or those of `names` the manifest records) against its recorded sha256."""
        export_dir = Path(export_dir)
        for name, expected in self.files.items():
            if names is not None and name not in names:
                continue
            file = export_dir / name
            if not file.is_file():
                raise ExportManifestError(f"{file} is missing from the export: {_REEXPORT}")
            found = sha256_of(file)
            if found != expected:
                raise ExportManifestError(f"{file} was changed after export (sha256 {found[:12]}..., the manifest "
                                          f"records {expected[:12]}...): {_REEXPORT}")

    def save(self, export_dir: str | Path) -> Path:
        path = Path(export_dir) / MANIFEST_FILE
        atomic.write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data = {"format_version": data.pop("format_version"), **data}
        data["tokens"] = {**self.tokens._asdict(), "eos_ids": list(self.tokens.eos_ids)}
        for graph in data["graphs"].values():
            for role in ("inputs", "outputs"):
                graph[role] = [{**tensor, "shape": list(tensor["shape"])} for tensor in graph[role]]
        if self.quantization is None:
            del data["quantization"]
        del data["model"]["logits_shift"]  # the family's: read back from model_type
        # Fields added after format version 1 was first written: absent in older manifests (their
        # defaults), and left out of a manifest that keeps them at the defaults.
        for name, default in (("noise", "mask"), ("canvas_length", None)):
            if data["model"][name] == default:
                del data["model"][name]
        return data

    def graph_problems(self, graph: str, model) -> list[str]:
        """How the ONNX `model` (a ModelProto) disagrees with what this manifest records of `graph`:
        its inputs and outputs (names, element types, shapes), the K/V layout the model facts give,
        and the mask id its unmasking node was built with. A graph from another model, given this
        manifest's hashes, is caught here before any runtime or builder reads it."""
        entry, problems = self.graphs[graph], []
        for role, recorded, found in (("input", entry.inputs, TensorContract.of_values(model.graph.input)),
                                      ("output", entry.outputs, TensorContract.of_values(model.graph.output))):
            by_name = {c.name: c for c in found}
            for expected in recorded:
                actual = by_name.pop(expected.name, None)
                if actual is None:
                    problems.append(f"{role} {expected.name} is missing")
                elif actual != expected:
                    problems.append(f"{role} {expected.name} is {actual.dtype} {list(actual.shape)}, the manifest "
                                    f"records {expected.dtype} {list(expected.shape)}")
            problems += [f"{role} {name} is not in the manifest" for name in by_name]
        layout = (self.model.num_layers, 2, None, self.model.num_kv_heads, None, self.model.head_dim)
        for contract in (*entry.inputs, *entry.outputs):
            if contract.name in ("past_kv", "kv") and (len(contract.shape) != len(layout) or any(
                    want is not None and have != want for have, want in zip(contract.shape, layout))):
                problems.append(f"{contract.name} has shape {list(contract.shape)}, but the model facts give "
                                f"[layers {self.model.num_layers}, 2, rows, kv heads {self.model.num_kv_heads}, "
                                f"positions, head size {self.model.head_dim}]")
        for node in model.graph.node:
            if node.op_type == "ParallelUnmask":
                mask = next((a.i for a in node.attribute if a.name == "mask_id"), None)
                if mask != self.tokens.mask_id:
                    problems.append(f"node {node.name} unmasks with mask id {mask}, the manifest's is "
                                    f"{self.tokens.mask_id}")
        return problems

    def check_graph(self, graph: str, model, source: str | Path) -> None:
        """Raise ExportManifestError listing `graph_problems`, if any."""
        problems = self.graph_problems(graph, model)
        if problems:
            raise ExportManifestError(f"{source} does not match {MANIFEST_FILE}: " + "; ".join(problems[:6])
                                      + f": {_REEXPORT}")

    def graph_sha256(self, graph: str) -> str:
        return self.files[self.graphs[graph].file]

    @property
    def supports_guidance(self) -> bool:
        return all(graph in self.graphs for graph in GUIDED_GRAPHS)

    @property
    def supports_editing(self) -> bool:
        """Whether the graphs take token editing's inputs (ParallelUnmask v2): exports made before
        it run every other policy as they are."""
        return all({c.name for c in entry.inputs} >= set(EDITING_INPUTS) for entry in self.graphs.values())

    @property
    def supports_logprobs(self) -> bool:
        """Whether the step graphs return the block's logits (`LOGITS_OUTPUT`), from which the runtime takes
        each committed token's log-probability: exports made before it decode as they are, without logprobs."""
        return all(LOGITS_OUTPUT in {c.name for c in entry.outputs} for entry in self.graphs.values())

    def with_files(self, export_dir: str | Path, **changes) -> ExportManifest:
        """A copy with `changes`, its file hashes taken afresh from `export_dir`."""
        export_dir = Path(export_dir)
        return replace(self, files={name: sha256_of(export_dir / name) for name in self.files}, **changes)

    @classmethod
    def from_dict(cls, data: Any, source: str = MANIFEST_FILE) -> ExportManifest:
        fields = _Fields(data, source, "")
        version = fields.integer("format_version")
        if version != FORMAT_VERSION:
            raise ExportManifestError(f"{source} has format version {version}, this dlmrt reads {FORMAT_VERSION}: "
                                      f"{_REEXPORT}")
        model = fields.section("model")
        model_type = model.text("model_type")
        if model_type not in FAMILIES:
            model.fail("model_type", f"must be a family dlmrt knows ({', '.join(FAMILIES)}), got {_shown(model_type)}")
        facts = ModelDescription(
            name=model.text("name"), model_type=model_type, dtype=model.text("dtype"),
            vocab_size=model.positive("vocab_size"), hidden_size=model.positive("hidden_size"),
            num_layers=model.positive("num_layers"), num_kv_heads=model.positive("num_kv_heads"),
            head_dim=model.positive("head_dim"), max_positions=model.positive("max_positions"),
            block_causal=model.boolean("block_causal"),
            block_grid=model.positive("block_grid") if model.value("block_grid") is not None else None,
            residual=model.boolean("residual"),
            noise="mask" if model.value("noise") is None else model.value("noise"),
            canvas_length=model.positive("canvas_length") if model.value("canvas_length") is not None else None,
            logits_shift=FAMILIES[model_type].model_class.logits_shift)
        if not _is_float_dtype(facts.dtype):
            model.fail("dtype", f"must be the name of a torch floating-point dtype (float32, bfloat16, ...), got "
                                f"{_shown(facts.dtype)}")
        if facts.noise not in NOISE_KINDS:
            model.fail("noise", f"must be one of {', '.join(NOISE_KINDS)} (absent: mask), got {_shown(facts.noise)}")
        model.done()
        tokens = fields.section("tokens")
        uniform = facts.noise == "uniform"  # no mask token
        token_ids = SpecialTokens(mask_id=None if uniform and tokens.value("mask_id", required=True) is None
                                  else tokens.token("mask_id", facts.vocab_size),
                                  eos_ids=tokens.token_list("eos_ids", facts.vocab_size),
                                  pad_id=tokens.token("pad_id", facts.vocab_size))
        tokens.done()
        limits = fields.section("limits")
        export_limits = ExportLimits(max_batch=limits.positive("max_batch"),
                                     max_length=limits.positive("max_length"))
        if export_limits.max_length > facts.max_positions:
            limits.fail("max_length", f"exceeds model.max_positions ({facts.max_positions})")
        limits.done()
        files = fields.section("files")
        hashes = {name: files.sha256(name) for name in files.keys()}
        graphs = fields.section("graphs")
        entries = {name: _graph_entry(graphs.section(name), hashes) for name in graphs.keys()}
        known, required = (CANVAS_GRAPHS, CANVAS_GRAPHS) if uniform else (GRAPHS + GUIDED_GRAPHS, GRAPHS)
        for name in entries:
            if name not in known:
                kind = "uniform-noise model's graph" if uniform else "step graph"
                graphs.fail(name, f"is not a {kind} dlmrt knows ({', '.join(known)})")
        for name in required:
            if name not in entries:
                graphs.fail(name, "is missing")
        quantization = fields.value("quantization")
        if quantization is not None and not isinstance(quantization, dict):
            fields.fail("quantization", f"must be an object, got {quantization!r}")
        manifest = cls(model=facts, tokens=token_ids, limits=export_limits, graphs=entries, files=hashes,
                       opset=fields.positive("opset"), dlmrt_version=fields.text("dlmrt_version"),
                       torch_version=fields.text("torch_version"), onnx_version=fields.text("onnx_version"),
                       exported_s=fields.number("exported_s"), quantization=quantization, format_version=version)
        fields.done()
        return manifest


def _graph_entry(graph: _Fields, hashes: dict[str, str]) -> GraphEntry:
    file = graph.text("file")
    if file not in hashes:
        graph.fail("file", f"{file!r} has no hash under files")
    entry = GraphEntry(file=file, inputs=_contract(graph, "inputs"), outputs=_contract(graph, "outputs"))
    graph.done()
    return entry


def _contract(graph: _Fields, role: str) -> tuple[TensorContract, ...]:
    tensors = graph.value(role, required=True)
    if not isinstance(tensors, list) or not tensors:
        graph.fail(role, f"must be a non-empty list of tensors, got {tensors!r}")
    contract = []
    for index, tensor in enumerate(tensors):
        fields = _Fields(tensor, graph.source, f"{graph.prefix}{role}[{index}]")
        shape = fields.value("shape", required=True)
        if not isinstance(shape, list) or not all(
                (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0) or (isinstance(dim, str) and dim)
                for dim in shape):
            fields.fail("shape", f"must be a list of sizes and axis names, got {shape!r}")
        contract.append(TensorContract(name=fields.text("name"), dtype=fields.text("dtype"), shape=tuple(shape)))
        fields.done()
    return tuple(contract)


@dataclass
class _Fields:
    """One JSON object of the manifest, read field by field; errors name the field's path."""

    data: Any
    source: str
    path: str
    taken: set[str] = field(default_factory=set)

    def __post_init__(self):
        if not isinstance(self.data, dict):
            where = self.path or "the manifest"
            raise ExportManifestError(f"{self.source}: {where} must be an object, got {_shown(self.data)}: "
                                      f"{_REEXPORT}")

    @property
    def prefix(self) -> str:
        return f"{self.path}." if self.path else ""

    def fail(self, key: str, problem: str):
        raise ExportManifestError(f"{self.source}: {self.prefix}{key} {problem}: {_REEXPORT}")

    def keys(self) -> list[str]:
        self.taken.update(self.data)
        return list(self.data)

    def value(self, key: str, *, required: bool = False) -> Any:
        if required and key not in self.data:
            self.fail(key, "is missing")
        self.taken.add(key)
        return self.data.get(key)

    def section(self, key: str) -> _Fields:
        return _Fields(self.value(key, required=True), self.source, f"{self.prefix}{key}")

    def text(self, key: str) -> str:
        value = self.value(key, required=True)
        if not isinstance(value, str) or not value:
            self.fail(key, f"must be a non-empty string, got {_shown(value)}")
        return value

    def boolean(self, key: str) -> bool:
        value = self.value(key, required=True)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_shown(value)}")
        return value

    def integer(self, key: str) -> int:
        value = self.value(key, required=True)
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(key, f"must be an integer, got {_shown(value)}")
        return value

    def positive(self, key: str) -> int:
        value = self.integer(key)
        if value <= 0:
            self.fail(key, f"must be positive, got {value}")
        return value

    def number(self, key: str) -> float:
        value = self.value(key, required=True)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            self.fail(key, f"must be a non-negative number, got {_shown(value)}")
        return value

    def token(self, key: str, vocab_size: int) -> int:
        value = self.integer(key)
        if not 0 <= value < vocab_size:
            self.fail(key, f"must be a token id below model.vocab_size ({vocab_size}), got {value}")
        return value

    def token_list(self, key: str, vocab_size: int) -> tuple[int, ...]:
        values = self.value(key, required=True)
        if not isinstance(values, list) or not values or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values):
            self.fail(key, f"must be a non-empty list of token ids below model.vocab_size ({vocab_size}), "
                           f"got {_shown(values)}")
        return tuple(values)

    def sha256(self, name: str) -> str:
        if not name or Path(name).name != name or name == MANIFEST_FILE:
            self.fail(repr(name), "is not a file name of the export directory")
        value = self.value(name)
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            self.fail(name, f"must be a sha256 (64 hex digits), got {_shown(value)}")
        return value

    def done(self) -> None:
        unknown = [key for key in self.data if key not in self.taken]
        if unknown:
            self.fail(unknown[0], "is not a field of this format version (written by a newer dlmrt?)")


def _is_float_dtype(name: str) -> bool:
    dtype = getattr(torch, name, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and str(dtype) == f"torch.{name}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
