"""ExportManifest: the one reader and writer of an export's dlmrt.json."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from dlmrt.export.export_manifest import MANIFEST_FILE, ExportManifest, ExportManifestError, TensorContract

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


def manifest_dict() -> dict:
    """A well-formed manifest, written out by hand."""
    tensor = {"name": "ids", "dtype": "int64", "shape": ["batch", "window"]}
    return {
        "format_version": 1, "dlmrt_version": "0.1.0", "torch_version": "2.13.0", "onnx_version": "1.23.2",
        "opset": 18, "exported_s": 1.5,
        "model": {"name": "m", "model_type": "llada", "dtype": "float32", "vocab_size": 100, "hidden_size": 64,
                  "num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "max_positions": 128,
                  "block_causal": False, "block_grid": None, "residual": False},
        "tokens": {"mask_id": 99, "eos_ids": [98, 97], "pad_id": 98},
        "limits": {"max_batch": 8, "max_length": 64},
        "graphs": {"full": {"file": "step_full.onnx", "inputs": [tensor], "outputs": [tensor]},
                   "cached": {"file": "step_cached.onnx", "inputs": [tensor], "outputs": [tensor]}},
        "files": {"step_full.onnx": SHA, "step_cached.onnx": "cd" * 32},
    }


def write(directory: Path, data) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST_FILE).write_text(json.dumps(data))
    return directory


def test_reads_the_fields_typed_and_round_trips(tmp_path):
    data = manifest_dict()
    manifest = ExportManifest.read(write(tmp_path, data))
    assert manifest.model.vocab_size == 100 and manifest.model.block_grid is None
    assert manifest.tokens.eos_ids == (98, 97) and manifest.limits.max_length == 64
    assert manifest.graphs["full"].inputs == (TensorContract("ids", "int64", ("batch", "window")),)
    assert manifest.graph_sha256("full") == SHA and not manifest.supports_guidance
    assert manifest.to_dict() == data
    manifest.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / MANIFEST_FILE).read_text()) == data


@pytest.mark.parametrize("model_type, shift", [("llada", 0), ("Dream", 1)])
def test_logits_shift_is_the_familys_and_never_written(tmp_path, model_type, shift):
    data = manifest_dict()
    data["model"]["model_type"] = model_type
    manifest = ExportManifest.read(write(tmp_path, data))
    assert manifest.model.logits_shift == shift and manifest.to_dict() == data


def test_keeps_a_quantization_record(tmp_path):
    data = manifest_dict() | {"quantization": {"mode": "fp8", "graphs": {"full": {"nodes": 3}}}}
    assert ExportManifest.read(write(tmp_path, data)).to_dict() == data


def corrupt(path: str, value):
    """The manifest with the field at dotted `path` set to `value` (removed when value is ...)."""
    data = manifest_dict()
    *parents, last = path.split(".")
    section = data
    for key in parents:
        section = section[int(key)] if isinstance(section, list) else section[key]
    if value is ...:
        del section[last]
    else:
        section[last] = value
    return data


@pytest.mark.parametrize("path, value, field", [
    ("format_version", ..., "format_version is missing"),
    ("format_version", "1", "format_version must be an integer"),
    ("model", [], "model must be an object"),
    ("model.vocab_size", ..., "model.vocab_size is missing"),
    ("model.vocab_size", True, "model.vocab_size must be an integer"),
    ("model.num_layers", 0, "model.num_layers must be positive"),
    ("model.name", "", "model.name must be a non-empty string"),
    ("model.block_causal", 1, "model.block_causal must be true or false"),
    ("model.block_grid", -4, "model.block_grid must be positive"),
    ("model.model_type", "gpt2", "model.model_type must be a family dlmrt knows (llada, llada2_moe"),
    ("model.dtype", "int64", "model.dtype must be the name of a torch floating-point dtype"),
    ("model.dtype", "float", "model.dtype must be the name of a torch floating-point dtype"),
    ("model.dtype", "Tensor", "model.dtype must be the name of a torch floating-point dtype"),
    ("model.extra", 1, "model.extra is not a field"),
    ("tokens.mask_id", 100, "tokens.mask_id must be a token id below model.vocab_size"),
    ("tokens.eos_ids", [], "tokens.eos_ids must be a non-empty list"),
    ("tokens.eos_ids", [1, "2"], "tokens.eos_ids must be a non-empty list"),
    ("limits.max_batch", -1, "limits.max_batch must be positive"),
    ("limits.max_length", 4096, "limits.max_length exceeds model.max_positions"),
    ("graphs.full", ..., "graphs.full is missing"),
    ("graphs.decode", {"file": "step_full.onnx", "inputs": [], "outputs": []}, "graphs.decode.inputs"),
    ("graphs.full.file", "other.onnx", "graphs.full.file 'other.onnx' has no hash under files"),
    ("graphs.full.inputs", {}, "graphs.full.inputs must be a non-empty list"),
    ("graphs.full.inputs.0.shape", ["batch", -1], "graphs.full.inputs[0].shape must be a list"),
    ("graphs.full.inputs.0.dtype", None, "graphs.full.inputs[0].dtype must be a non-empty string"),
    ("files.step_full.onnx", "abc", "files.step_full.onnx must be a sha256"),
    ("quantization", "fp8", "quantization must be an object"),
    ("exported_s", "soon", "exported_s must be a non-negative number"),
    ("surprise", 1, "surprise is not a field of this format version"),
])
def test_each_corrupt_field_gets_one_error_naming_it(tmp_path, path, value, field):
    if path.startswith("files."):  # file names hold dots
        data = manifest_dict()
        data["files"][path.removeprefix("files.")] = value
    else:
        data = corrupt(path, value)
    with pytest.raises(ExportManifestError) as error:
        ExportManifest.read(write(tmp_path, data))
    message = str(error.value)
    assert field in message and "dlmrt export" in message and "\n" not in message


def test_a_graph_dlmrt_does_not_know_is_refused(tmp_path):
    data = manifest_dict()
    data["graphs"]["decode"] = copy.deepcopy(data["graphs"]["full"])
    with pytest.raises(ExportManifestError, match="graphs.decode is not a step graph"):
        ExportManifest.read(write(tmp_path, data))


@pytest.mark.parametrize("name", ["../escape.onnx", "sub/step.onnx", MANIFEST_FILE])
def test_file_names_stay_inside_the_export(tmp_path, name):
    data = manifest_dict()
    data["files"][name] = SHA
    with pytest.raises(ExportManifestError, match="is not a file name of the export directory"):
        ExportManifest.read(write(tmp_path, data))


@pytest.mark.parametrize("text, problem", [("{not json", "is not valid JSON"), ("[1, 2]", "must be an object"),
                                           ('{"format_version": 2}', "format version 2, this dlmrt reads 1")])
def test_unreadable_manifests(tmp_path, text, problem):
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(ExportManifestError, match=problem):
        ExportManifest.read(tmp_path)


def test_load_checks_every_file_against_its_hash(tmp_path):
    from dlmrt.core.hashing import sha256_of

    data = manifest_dict()
    for name in data["files"]:
        (tmp_path / name).write_bytes(name.encode())
        data["files"][name] = sha256_of(tmp_path / name)
    write(tmp_path, data)
    assert ExportManifest.load(tmp_path).files == data["files"]
    (tmp_path / "step_cached.onnx").write_bytes(b"changed")
    with pytest.raises(ExportManifestError, match="step_cached.onnx was changed after export"):
        ExportManifest.load(tmp_path)
    (tmp_path / "step_cached.onnx").unlink()
    with pytest.raises(ExportManifestError, match="step_cached.onnx is missing"):
        ExportManifest.load(tmp_path)


def test_not_an_export(tmp_path):
    assert not ExportManifest.present(tmp_path)
    with pytest.raises(ExportManifestError, match=f"is not a dlmrt export \\(no {MANIFEST_FILE}\\)"):
        ExportManifest.read(tmp_path)


def test_only_the_manifest_module_names_the_file():
    """Every other reader goes through ExportManifest: no other code holds the file name as a string
    (docstrings may mention it; tests may open the raw file to check it)."""
    found = subprocess.run(["git", "grep", "--untracked", "-l", "-E", "[\"']dlmrt\\.json[\"']", "--", "*.py"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    code = [path for path in found if not path.startswith("tests/")]
    assert code == ["dlmrt/export/export_manifest.py"], code
