"""Calibration inputs for a step graph: the feeds the graph really sees in the step loop.

    feeds = calibration_feeds(export_dir, "cached", count=32)   # [{input name: np.ndarray}, ...]

The Generator decodes prompts with the export's graphs in ONNX Runtime (OrtBackend), and every
step that runs the requested graph is recorded, converted by the same code that binds OrtBackend's
inputs. Prompts come from the task suite's train split (so that the test split stays unseen), from
a list of strings, or from a file: `.jsonl` files hold one `{"prompt": ...}` object a line (the
format of `dlmrt eval --data`, whose other keys are ignored), any other file one prompt a line.

Each graph is calibrated under the cache mode that runs it: `full` without a cache (every step
sees the whole canvas), `cached` with the prefix and dual caches in turn (the block with what
follows it over a cached prefix, and the block alone over both sides), the guided graphs with
classifier-free guidance on. The policy unmasks one token a step (LLaDA's schedule with as many
steps as tokens), so the recorded steps span every fraction of the block still masked.

A uniform-noise export (DiffusionGemma) is decoded by its own loop in ONNX Runtime
(OrtBackend) with the model's policy, and each run of the requested graph (`encode`, `decode`
or `soft_tokens`) is recorded.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from dlmrt.core import file_reads, json_files, limits
from dlmrt.core.errors import DlmrtError
from dlmrt.runtime.settings import GenerationSettings

DEFAULT_GEN_LENGTH = 64
GUIDANCE_SCALE = 1.0  # the guided graphs see cfg_scale as an input, so any positive scale exercises them


class CalibrationError(DlmrtError, ValueError):
    """Calibration prompts or options that cannot give calibration inputs."""


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: `.jsonl` (one `{"prompt": ...}` object a line) or text (one prompt a
    line); blank lines are skipped."""
    path = Path(path)
    lines = file_reads.read_text(path, CalibrationError, most=limits.MAX_DATA_BYTES, what="calibration prompts",
                                 too_large="calibration records --calibration-samples inputs (32 by default): keep "
                                           "fewer prompts").splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    if path.suffix == ".jsonl":
        prompts = [_jsonl_prompt(path, number, line) for number, line in numbered]
    else:
        prompts = [line for _, line in numbered]
    if not prompts:
        raise CalibrationError(f"{path} holds no prompts: write one prompt a line, or for a .jsonl file one "
                               f'JSON object a line like {{"prompt": "add:123+456="}}')
    return prompts


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    record = json_files.parse(line, f"{path}:{number}", CalibrationError,
                              'write one JSON object a line, like {"prompt": "add:123+456="}')
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str) or not prompt:
        raise CalibrationError(f'{path}:{number} has no "prompt" string: write one JSON object a line, '
                               f'like {{"prompt": "add:123+456="}}')
    return prompt


def suite_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` prompts from the task suite's train split, the tasks taking turns."""
    from dlmrt.core import tasks

    per_task = math.ceil(count / len(tasks.TASKS))
    by_task = [tasks.examples("train", per_task, seed, (task,)) for task in tasks.TASKS]
    interleaved = [example.prompt for group in zip(*by_task) for example in group]
    return interleaved[:count]


def _encoded(model, prompts: str | Path | Sequence[str] | None, suite_count: int, seed: int) -> list[list[int]]:
    """The calibration prompts' ids: the task suite's (`suite_count` of them) when `prompts` is None."""
    from dlmrt.runtime import text

    if prompts is None:
        prompts = suite_prompts(suite_count, seed)
    elif isinstance(prompts, (str, Path)):
        prompts = load_prompts(prompts)
    elif not prompts:
        raise CalibrationError("no calibration prompts were given: pass at least one, or None for the task suite")
    return [text.encode(model, prompt) for prompt in prompts]


def _record_canvas(backend, feeds: list, export_dir: str | Path, prompts, count: int, seed: int, batch_size: int,
                   settings: GenerationSettings | None) -> None:
    """Decode until `feeds` holds `count` inputs of a uniform-noise export's graph (`encode`, `decode` or
    `soft_tokens`), recorded by `backend` from the uniform-noise loop; the policy is the model's own (its
    generation_config.json, else the public defaults), over as many whole canvases as fit."""
    from dlmrt.runtime import GenerationSettings, Generator, make_policy
    from dlmrt.runtime.exported_model import ExportedModel

    model = ExportedModel.load(export_dir)
    ids = _encoded(model, prompts, count * batch_size, seed)
    if settings is None:
        room = backend.spec.max_positions - max(map(len, ids))
        canvas = model.default_block_length
        if room < canvas:
            raise CalibrationError(f"a prompt of {max(map(len, ids))} tokens leaves no room for a canvas of {canvas} "
                                   f"in the export's context of {backend.spec.max_positions}: use shorter "
                                   f"calibration prompts")
        policy = make_policy("entropy_bound", generation_config=model.generation_config)
        settings = GenerationSettings(gen_length=canvas * min(room // canvas, 2), block_length=canvas, policy=policy)
    settings = replace(settings, seed=seed)
    _decode_until(count, feeds, Generator(backend), ids, min(batch_size, backend.ladder.max_batch),
                  lambda: settings)


def _decode_until(count: int, feeds: list, generator, ids: list[list[int]], batch_size: int, settings_of_batch) -> None:
    """Decode `ids` a batch at a time, each batch with `settings_of_batch()`, until `feeds` holds `count`."""
    for start in range(0, len(ids), batch_size):
        stream = generator.stream(ids[start:start + batch_size], settings_of_batch())
        for _ in stream:
            if len(feeds) >= count:
                stream.close()
                break
        if len(feeds) >= count:
            break


def default_settings(generation_config: dict, default_block_length: int | None, max_length: int,
                     longest_prompt: int) -> GenerationSettings:
    """One token unmasked a step, over the model's usual lengths (generation_config.json) cut to
    what the export's context leaves after the longest prompt; a block-causal model's blocks on
    its grid (`default_block_length`)."""
    from dlmrt.runtime import Fixed

    room = max_length - longest_prompt
    if room <= 0:
        raise CalibrationError(f"a prompt of {longest_prompt} tokens leaves no room to generate in the export's "
                               f"context of {max_length}: use shorter calibration prompts")
    gen_length = min(generation_config.get("gen_length", DEFAULT_GEN_LENGTH), room)
    block = min(default_block_length or generation_config.get("block_length") or gen_length, gen_length)
    return GenerationSettings(gen_length=gen_length - gen_length % block, block_length=block, policy=Fixed())


def _cache_modes(graph: str, block_causal: bool) -> tuple[str, ...]:
    if graph.startswith("full"):
        return ("none",)
    return ("prefix",) if block_causal else ("prefix", "dual")


def calibration_feeds(export_dir: str | Path, graph: str = "full", prompts: str | Path | Sequence[str] | None = None,
                      count: int = 32, seed: int = 0, *, batch_size: int = 8,
                      settings: GenerationSettings | None = None) -> list[dict[str, np.ndarray]]:
    """Up to `count` input dicts of `graph` (`full`, `cached`, or a guided graph of the export), as
    the step loop feeds it, in the graph's input names and dtypes.

    prompts: None for the task suite (train split, picked with `seed`), a list of prompt strings,
    or the path of a prompts file (see `load_prompts`). They are decoded `batch_size` at a time
    until `count` steps of the graph were recorded or the prompts run out.
    settings: the lengths and policy to decode with (default: `default_settings`); the cache mode
    and guidance scale always follow from `graph`.
    """
    from dlmrt.runtime import Generator
    from dlmrt.runtime.exported_model import ExportedModel
    from dlmrt.runtime.ort_backend import OrtBackend

    if count <= 0:
        raise CalibrationError(f"the calibration count must be positive, got {count}")
    if batch_size <= 0:
        raise CalibrationError(f"the calibration batch size must be positive, got {batch_size}")
    feeds: list[dict[str, np.ndarray]] = []

    def record(name: str, inputs) -> None:
        if name == graph and len(feeds) < count:  # copies: the loop updates the state in place
            feeds.append({key: tensor.numpy().copy() for key, tensor in inputs.items()})

    backend = OrtBackend(export_dir, observe=record)
    uniform = backend.spec.noise == "uniform"
    if graph not in backend.sessions:
        hint = "" if uniform else (": pick one of those, or re-export with `dlmrt export --guidance` for the guided "
                                   "graphs")
        raise CalibrationError(f"{export_dir} has no {graph!r} graph (it has {', '.join(backend.sessions)}){hint}")
    if uniform:
        _record_canvas(backend, feeds, export_dir, prompts, count, seed, batch_size, settings)
        return feeds
    model = ExportedModel.load(export_dir)
    batch_size = min(batch_size, backend.ladder.max_batch)
    ids = _encoded(model, prompts, count * batch_size, seed)
    if settings is None:
        settings = default_settings(model.generation_config, model.default_block_length, backend.spec.max_positions,
                                    max(map(len, ids)))
    settings = replace(settings, seed=seed, cfg_scale=GUIDANCE_SCALE if graph.endswith("_guided") else 0.0)
    modes = itertools.cycle(_cache_modes(graph, backend.spec.block_causal))
    _decode_until(count, feeds, Generator(backend), ids, batch_size, lambda: replace(settings, cache=next(modes)))
    return feeds
