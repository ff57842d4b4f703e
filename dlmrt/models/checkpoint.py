"""Hugging Face model directories: load a denoiser from one, save one as one.

A directory holds config.json, the weights as model.safetensors or as shards
listed in model.safetensors.index.json, and optionally tokenizer.json,
tokenizer_config.json (carried as is, for its chat template) and
generation_config.json. No pickle, no remote code: a weight is read from a
safetensors file or the load fails, and the model is built on the meta device
so that no parameter is ever silently random.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from dlmrt.core import atomic, file_reads, json_files, limits
from dlmrt.core.errors import ArgumentError, CheckpointError
from dlmrt import models
from dlmrt.models import Denoiser, SpecialTokens, generation_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Names of the mask token in public tokenizers (LLaDA, LLaDA2.x), looked up when no config gives the id.
MASK_TOKEN_NAMES = ("<|mdm_mask|>", "<|mask|>")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: Mapping[str, Any] | None = None) -> torch.dtype:
    """A torch dtype from a name; "auto" takes config.json's `dtype` (or `torch_dtype`)."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ArgumentError(f"dtype {dtype} is not supported (use float32, bfloat16 or float16)")
    if dtype == "auto":
        declared = (config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32"
        return resolve_dtype(declared)
    if dtype not in DTYPES:
        raise ArgumentError(f"dtype {dtype!r} is not supported (use one of: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def _read_json(path: Path) -> dict[str, Any]:
    return json_files.read(path, CheckpointError)


def read_config(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise CheckpointError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (expected a Hugging Face model directory)")
    path = root / "config.json"
    if not path.exists():
        raise CheckpointError(f"{root} has no config.json (expected a Hugging Face model directory)")
    return _read_json(path)


def load_tokenizer(root: Path) -> Tokenizer | None:
    path = root / "tokenizer.json"
    if not path.exists():
        return None
    text = file_reads.read_text(path, CheckpointError, most=limits.MAX_DATA_BYTES, what="a tokenizer",
                                too_large="check that it is the model's tokenizer.json")
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"{path}: cannot be parsed by the tokenizers library ({error})") from None


def _token_ids(value: Any, source: str, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{source}: field '{field}' must be an integer or a list of integers, "
                              f"got {json.dumps(value)}")
    return tuple(values)


def resolve_special_tokens(root: Path, config: Mapping[str, Any], generation: Mapping[str, Any],
                           tokenizer: Tokenizer | None, mask_id: int | None = None,
                           eos_id: int | Iterable[int] | None = None,
                           pad_id: int | None = None, *, needs_mask: bool = True
                           ) -> tuple[SpecialTokens, dict[str, str]]:
    """Mask, EOS and pad ids, each from the first place that gives it: the arguments; then
    config.json (its `text_config` after it, where multimodal checkpoints keep the text ids) and
    generation_config.json (for EOS, generation_config.json first, as Hugging Face generation
    does); for the mask, the tokenizer's mask token. Pad falls back to EOS. A uniform-noise model
    (`needs_mask=False`) has no mask token: its mask id is None unless one is given.
    Also returns where each came from ("mask", "eos", "pad" -> a file, or the arguments), for errors."""
    text = config.get("text_config")
    sources = ((config, str(root / "config.json")),
               *(((text, f"{root / 'config.json'} (text_config)"),) if isinstance(text, Mapping) else ()),
               (generation, str(root / "generation_config.json")))
    origins = {"mask": "the arguments", "eos": "the arguments", "pad": "the arguments"}

    def first(field: str, role: str) -> tuple[int, ...]:
        for values, source in (sources[::-1] if field == "eos_token_id" else sources):
            ids = _token_ids(values.get(field), source, field)
            if ids:
                origins[role] = source
                return ids
        return ()

    if mask_id is None and needs_mask:
        found = first("mask_token_id", "mask")
        if found:
            mask_id = found[0]
        elif tokenizer is not None:
            mask_id = next((i for name in MASK_TOKEN_NAMES
                            if (i := tokenizer.token_to_id(name)) is not None), None)
            origins["mask"] = str(root / "tokenizer.json")
    if mask_id is None and needs_mask:
        raise CheckpointError(
            f"{root}: no mask token id: config.json and generation_config.json have no mask_token_id "
            f"and tokenizer.json has none of {', '.join(MASK_TOKEN_NAMES)}; pass mask_id=...")
    if eos_id is None:
        eos_ids = (*first("eos_token_id", "eos"),)
    else:
        eos_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    if pad_id is None:
        pads = first("pad_token_id", "pad")
        if pads:
            pad_id = pads[0]
        else:
            pad_id, origins["pad"] = (eos_ids[0], f"{origins['eos']} (EOS, as no pad id is given)") if eos_ids \
                else (mask_id, f"{origins['mask']} (the mask id, as no pad or EOS id is given)")
    if pad_id is None:
        raise CheckpointError(f"{root}: no pad token id: config.json and generation_config.json have no "
                              f"pad_token_id or eos_token_id; pass pad_id=...")
    return SpecialTokens(mask_id, eos_ids, pad_id), origins


def _open(path: Path):
    # safetensors maps the file itself: a FIFO would hold its open forever, so its type is checked first
    file_reads.check_regular(path, CheckpointError, most=limits.MAX_WEIGHTS_BYTES, what="weights",
                             too_large="shard the checkpoint (model.safetensors.index.json)")
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise CheckpointError(f"{path}: not a valid safetensors file, it may be truncated or corrupt "
                              f"({error}); re-save or re-download it") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error})") from None


def tensor_files(root: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor, from the shard index or the single file."""
    index_path = root / INDEX_FILE
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: field 'weight_map' must be an object mapping tensor "
                                  f"names to shard file names")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(f"{index_path}: shard {shard[:100]!r} is not a file name: shards are read "
                                      f"from the model directory itself, never from another")
            if not (root / shard).exists():
                raise CheckpointError(f"{index_path}: lists shard {shard}, which is missing from {root}")
        return {name: root / shard for name, shard in weight_map.items()}
    if (root / SINGLE_FILE).exists():
        with _open(root / SINGLE_FILE) as f:
            return {name: root / SINGLE_FILE for name in f.keys()}
    hint = ""
    if any((root / name).exists() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        hint = "; dlmrt reads safetensors only (no pickle): convert the .bin weights to safetensors"
    raise CheckpointError(f"{root} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _check_weights(root: Path, expected: Mapping[str, tuple[int, ...]], files: Mapping[str, Path],
                   family: str) -> None:
    """One error listing every missing, unexpected and mis-shaped tensor."""
    problems = []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in sorted(by_file.items()):
        with _open(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    problems.append(f"tensor '{name}' is listed in {INDEX_FILE} but missing from {path.name}")
                elif name not in expected:
                    problems.append(f"unexpected tensor '{name}' in {path.name} (not part of a {family} "
                                    f"model with this config.json)")
                elif tuple(shape := f.get_slice(name).get_shape()) != expected[name]:
                    problems.append(f"tensor '{name}' in {path.name} has shape {list(shape)}, but "
                                    f"config.json implies {list(expected[name])}")
            if len(by_file) > 1:
                for name in sorted(present - set(names)):
                    problems.append(f"tensor '{name}' is in {path.name} but not listed in {INDEX_FILE}")
    for name in sorted(set(expected) - set(files)):
        problems.append(f"missing tensor '{name}' (shape {list(expected[name])} from config.json)")
    if problems:
        shown = "\n  - ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointError(f"{root}: the weights do not match config.json:\n  - {shown}{more}")


def structure(path: str | os.PathLike, *, dtype: str | torch.dtype = "float32") -> Denoiser:
    """The module tree of a Hugging Face model directory on the meta device, config and special tokens
    checked, without reading a weight: what a check of its shapes needs (a parallel plan, before any
    rank starts)."""
    return _structure(Path(path), dtype, "cpu", None, None, None)[0]


def _structure(root: Path, dtype, device: str, mask_id, eos_id, pad_id):
    raw = read_config(root)
    source = str(root / "config.json")
    family = models.family_of(raw, source)
    torch_dtype = resolve_dtype(dtype, raw)
    tokenizer = load_tokenizer(root)
    generation = generation_config.read(root)
    tokens, origins = resolve_special_tokens(root, raw, generation, tokenizer, mask_id, eos_id, pad_id,
                                             needs_mask=family.model_class.noise == "mask")
    model = models.build(raw, source, tokens, dtype=torch_dtype, device=device, token_origins=origins)
    model.name = root.resolve().name
    return model, tokenizer, generation, torch_dtype


def load(path: str | os.PathLike, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
         mask_id: int | None = None, eos_id: int | Iterable[int] | None = None,
         pad_id: int | None = None) -> Denoiser:
    """Load the denoiser of a Hugging Face model directory, ready for inference."""
    root = Path(path)
    model, tokenizer, generation, torch_dtype = _structure(root, dtype, device, mask_id, eos_id, pad_id)
    family = models.family_of(model.raw_config, str(root / "config.json"))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    files = tensor_files(root)
    ignored = {name for name in files if name.startswith(model.ignored_tensor_prefixes)}
    if ignored:
        parts = sorted({p for p in model.ignored_tensor_prefixes if any(n.startswith(p) for n in ignored)})
        warnings.warn(f"{root}: {len(ignored)} tensors of parts dlmrt does not run are not loaded (under "
                      f"{', '.join(parts)}): the {family.model_type} family runs text only", stacklevel=2)
        files = {name: path for name, path in files.items() if name not in ignored}
    _check_weights(root, expected, files, family.model_type)

    state = {}
    for shard in sorted(set(files.values())):
        with _open(shard) as f:
            for name in f.keys():
                if name in ignored:
                    continue
                state[name] = tensor = f.get_tensor(name).to(device=device, dtype=torch_dtype)
                _require_finite(tensor, name, shard)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False).eval()
    model.tokenizer = tokenizer
    tokenizer_config = root / TOKENIZER_CONFIG_FILE
    # Read by `dlmrt.core.chat_template` when serving; only its bytes travel with the model, into saves and exports.
    model.tokenizer_config = file_reads.read_bytes(tokenizer_config, CheckpointError, most=limits.MAX_CONFIG_BYTES,
                                                   what="JSON") if tokenizer_config.exists() else None
    model.generation_config = generation
    model.name = root.resolve().name
    return model


def copy_tokenizer_config(model: Denoiser, directory: Path) -> None:
    """Write the tokenizer_config.json `model` was loaded with, if any, into `directory`."""
    if model.tokenizer_config is not None:
        atomic.write_bytes(directory / TOKENIZER_CONFIG_FILE, model.tokenizer_config)


def _require_finite(tensor: torch.Tensor, name: str, shard: Path) -> None:
    """NaN or inf in a weight (as loaded: a float16 load can overflow) would decode to junk. One min-max
    reduction tells (NaN propagates through it); it runs at memory speed, far faster than isfinite."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return
    low, high = torch.aminmax(tensor)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        bad = int((~torch.isfinite(tensor)).sum())
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise CheckpointError(f"{shard}: tensor '{name}' holds {bad} NaN or infinite values (loaded as {dtype}): "
                              f"the checkpoint is corrupt, or its values overflow {dtype}; re-save or re-download "
                              f"it, or load it in another dtype")


def _shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU in storage of its own: safetensors refuses tensors that share one (the state dict
    names each of a MoE's stacked experts apart, as views of the stack)."""
    tensor = tensor.detach().contiguous().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def save(model: Denoiser, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
         extra_files: Mapping[str, bytes] | None = None) -> Path:
    """Write `model` as a Hugging Face directory (atomically: all of it or, on failure, none), with
    `extra_files` (name -> contents, e.g. a training state or report) written in the same step."""
    path = Path(path)
    state = {name: _own_tensor(t) for name, t in model.state_dict().items()}
    config = dict(model.raw_config)
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    if model.tokens is not None and model.tokens.mask_id is not None:
        config.setdefault("mask_token_id", model.tokens.mask_id)
    with atomic.directory(path, replaces=lambda found: (found / "config.json").is_file(),
                          what="a model directory") as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if max_shard_bytes is None:
            save_file(state, str(staging / SINGLE_FILE), metadata={"format": "pt"})
        else:
            shards = _shards(state, max_shard_bytes)
            weight_map = {}
            for number, shard in enumerate(shards, start=1):
                name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        generation = dict(model.generation_config)
        if model.tokens is not None:
            generation.update(pad_token_id=model.tokens.pad_id, eos_token_id=list(model.tokens.eos_ids))
            if model.tokens.mask_id is not None:  # uniform-noise models have none
                generation["mask_token_id"] = model.tokens.mask_id
        if generation:
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if model.tokenizer is not None:
            model.tokenizer.save(str(staging / "tokenizer.json"))
        copy_tokenizer_config(model, staging)
        for name, contents in (extra_files or {}).items():
            (staging / name).write_bytes(contents)
    return path
