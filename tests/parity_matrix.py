"""The parity matrix: family x policy x cache mode x backend x mode, generated from the registries
(FAMILIES, POLICIES, CACHE_MODES, BACKENDS, MODES). Each cell must give the tokens of an oracle that
does not share its code path, exactly. The cells are defined here and run by two test files,
tests/runtime/test_parity_matrix_compiled.py (the compile column) and tests/runtime/test_parity_matrix.py
(the rest), so that pytest-xdist's `--dist loadfile` can put them on two workers.

- Subjects: a checkpoint for every family in FAMILIES, LLaDA's twice (with and without ORL's
  residual pathway, so that the `residual` policy has a model). Those of llada2_moe, Dream and SDAR
  are the checkpoints the public code wrote, with its generates recorded (tests/recorded.py).
- Oracles, first that applies: the public code's recorded tokens for the cell's policy and cache; the
  reference loop (LLaDA's algorithm in plain torch) for fixed without a cache; else the torch
  backend's eager loop on the same prompts and settings (held to the first two in its own cells).
- A combination the product must refuse (a policy of the other noise kind, `residual` without a
  residual pathway, the dual cache on a block-causal or uniform-noise model) is held to one clear error.
- ONNX Runtime runs every cell: an export per subject, then a fraction of a second a cell. Compile,
  CUDA graphs and the TensorRT fake run a covering set, chosen so that every subject, every policy and
  every cache mode meets each of them at least once, recorded cells first: a compiled cell costs
  10-30 s on two cores, and the cross product would cost an hour.
- The settings come from the registry's defaults (`make_policy(name)`); greedy, sampled and guided
  decoding and K, the steps per host read, rotate over the cells. The compile column compiles with
  fullgraph=True (a graph break fails the cell), and mode "compile" raises rather than fall back to eager.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from dlmrt.cli.backends import BACKENDS
from dlmrt.runtime import CACHE_MODES, GenerationSettings, Generator, make_policy, reference
from dlmrt.runtime.executor import MODES
from dlmrt.runtime.policy_registry import POLICIES
from recorded import recorded
from shared_exports import SHARED_EXPORTS

ONNX = pytest.importorskip("onnxruntime", reason="the ONNX Runtime and TensorRT columns need the 'onnx' extra")
PROMPTS = ([5, 17, 42, 30], [8, 9])  # ids every subject's vocabulary holds; two lengths, so one row is padded


@dataclass(frozen=True)
class Subject:
    family: str  # a FAMILIES key
    export: str  # its SHARED_EXPORTS name; the torch model is the one that export is made from

    @property
    def model(self):
        return _model(self.export)


SUBJECTS = {"llada": Subject("llada", "tiny"), "llada-orl": Subject("llada", "tiny_orl"),
            "llada2_moe": Subject("llada2_moe", "llada21"), "Dream": Subject("Dream", "dream"),
            "sdar": Subject("sdar", "sdar"),
            # trained: over its default 48 steps, a random DiffusionGemma's near-tied logits let ONNX Runtime's
            # last-bit differences from torch pick other tokens
            "diffusion_gemma": Subject("diffusion_gemma", "tiny_diffusion_gemma")}


@cache
def _model(export: str):
    return SHARED_EXPORTS[export].model()


@dataclass(frozen=True)
class Cell:
    subject: str
    policy: str
    cache: str
    backend: str
    mode: str | None  # the torch backend's; ONNX Runtime and TensorRT run their own way

    def __str__(self) -> str:
        return "-".join(part for part in (self.subject, self.policy, self.cache, self.backend, self.mode) if part)


def refusal(subject: Subject, policy: str, cache_mode: str) -> str | None:
    """What the product must say when it refuses the combination, or None where it runs."""
    model, entry = subject.model, POLICIES[policy]
    if entry.noise != model.noise:  # the only two kinds: one of them is uniform noise
        return "uniform-noise"
    if cache_mode == "dual" and (model.block_causal or model.noise == "uniform"):
        return "cache mode 'dual' does not apply"
    if policy == "residual" and model.residual_config is None:
        return "needs an ORL model"
    return None


def reference_applies(cell: Cell, index: int) -> bool:
    """The reference loop is LLaDA's: greedy (its random stream is not the runtime's), fixed, no cache, on a
    LLaDA model (bidirectional, no shifted logits)."""
    return (SUBJECTS[cell.subject].family, cell.policy, cell.cache) == ("llada", "fixed", "none") and \
        variant(cell, index) == GREEDY


GREEDY, SAMPLED, GUIDED = (0.0, 0.0), (0.8, 0.0), (0.0, 1.5)  # (temperature, cfg_scale)


# In the compile and CUDA-graph columns a subject keeps one variant, so that its cells share their graphs
# (a graph is per bucket, step kind and variant; the policy's numbers are its inputs). The recorded
# subjects decode greedily, as the public code did.
COMPILED_VARIANT = {"llada": GUIDED, "llada-orl": SAMPLED}


def variant(cell: Cell, index: int) -> tuple[float, float]:
    """Greedy, sampled or guided: what the step's inputs carry besides the policy's numbers. The eager
    cells are held to greedy oracles; the shared exports have no guidance graphs, and uniform-noise
    models no guidance, so ONNX Runtime and TensorRT alternate greedy and sampled."""
    if cell.mode == "eager":
        return GREEDY
    if cell.backend == "torch":
        return COMPILED_VARIANT.get(cell.subject, GREEDY)
    return (GREEDY, SAMPLED)[index % 2]


def steps_per_sync(index: int) -> int:
    """K alternates between 1 and 2; a compiled K = 2 is twice the graph, so one cell in four."""
    return 2 if index % 4 == 1 else 1


def covering(cells: list[Cell]) -> list[Cell]:
    """Greedily, the fewest cells in which every subject, policy and cache mode appears; of cells that
    cover as much, one whose subject and cache mode a chosen cell has (its compiled graphs serve it),
    then a recorded one."""
    def values(cell: Cell) -> set:
        return {("subject", cell.subject), ("policy", cell.policy), ("cache", cell.cache)}

    uncovered, chosen = set().union(*map(values, cells)), []
    while uncovered:
        compiled = {(c.subject, c.cache) for c in chosen}
        best = max(cells, key=lambda c: (len(values(c) & uncovered), (c.subject, c.cache) in compiled,
                                         bool(recorded(SUBJECTS[c.subject].family, c.policy, c.cache))))
        chosen.append(best)
        uncovered -= values(best)
    return chosen


def matrix() -> tuple[list[Cell], list[Cell]]:
    """(cells that run, cells the product refuses)."""
    triples = [(s, p, c) for s, p, c in itertools.product(SUBJECTS, POLICIES, CACHE_MODES)]
    runnable = [t for t in triples if refusal(SUBJECTS[t[0]], t[1], t[2]) is None]
    refused = [Cell(*t, "torch", "eager") for t in triples if t not in runnable]
    cells = [Cell(*t, "torch", "eager") for t in runnable
             if recorded(SUBJECTS[t[0]].family, t[1], t[2]) or reference_applies(Cell(*t, "torch", "eager"), 0)]
    for backend in BACKENDS:
        for mode in (MODES if backend == "torch" else (None,)):
            if (backend, mode) == ("torch", "eager"):
                continue
            column = [Cell(*t, backend, mode) for t in runnable]
            cells += column if backend == "ort" else covering(column)
    return cells, refused


CELLS, REFUSED = matrix()


def default_settings(cell: Cell, index: int) -> GenerationSettings:
    model = SUBJECTS[cell.subject].model
    temperature, cfg_scale = variant(cell, index)
    return GenerationSettings(8, 4, make_policy(cell.policy, generation_config=model.generation_config),
                              cache=cell.cache, temperature=temperature, cfg_scale=cfg_scale, seed=3,
                              steps_per_sync=steps_per_sync(index))


@cache
def generator_for(subject: str, backend: str, mode: str | None, export_dir: Path) -> Generator:
    """One generator per subject, backend and mode, so that a compiled graph serves every cell of its shape."""
    if backend == "torch":
        model = SUBJECTS[subject].model
        return Generator(model.to("cuda") if mode == "cudagraph" else model, mode=mode)
    if backend == "ort":
        from dlmrt.runtime.ort_backend import OrtBackend

        return Generator(OrtBackend(export_dir))
    return Generator(_fake_engines(export_dir))


def generator(cell: Cell, exports) -> Generator:
    if cell.mode == "cudagraph" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU (scripts/gpu_check.sh runs this column, marked gpu)")
    export_dir = exports[SUBJECTS[cell.subject].export] if cell.backend != "torch" else None
    return generator_for(cell.subject, cell.backend, cell.mode, export_dir)


def _fake_engines(export_dir: Path):
    """The TensorRT backend over fake sm_90 engines of the export (tests/fake_tensorrt.py): the binding
    contract is the real one, and ONNX Runtime computes what each engine would."""
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.store import EngineStore
    from dlmrt.runtime.trt_backend import TrtBackend
    from fake_tensorrt import FakeTensorRT, engine_builder

    store = EngineStore(export_dir.parent / f"{export_dir.name}-fake-engines")
    plan = make_plan(export_dir, targets.target_named("sm_90"), "bf16", tensorrt="10.13.0", store=store.root)
    if not store.entries():
        build.run(plan, store, device="NVIDIA H200", tensorrt_version="10.13.0", engine_builder=engine_builder)
    trt = FakeTensorRT("10.13.0")
    return TrtBackend(export_dir, store.root, tensorrt=trt, plugins=trt.register_plugins, capability=(9, 0),
                      device="cpu")


@cache
def eager_tokens(subject: str, settings: GenerationSettings) -> torch.Tensor:
    return generator_for(subject, "torch", "eager", None).generate(list(PROMPTS), settings).tokens


def check_cell(cell: Cell, exports) -> None:
    """The cell's tokens are its oracle's."""
    subject, index = SUBJECTS[cell.subject], CELLS.index(cell)
    decoding = generator(cell, exports)
    cases = recorded(subject.family, cell.policy, cell.cache)
    if cases:
        if cell.mode in ("compile", "cudagraph"):  # one canvas: one compilation
            cases = [c for c in cases if (len(c.prompt), c.settings.gen_length) ==
                     (len(cases[0].prompt), cases[0].settings.gen_length)][:4]
        for case in cases:
            settings = dataclasses.replace(case.settings, steps_per_sync=steps_per_sync(index))
            assert case.found(decoding.generate([case.prompt], settings)) == case.tokens, case.name
        return
    settings = default_settings(cell, index)
    found = decoding.generate(list(PROMPTS), settings).tokens
    if reference_applies(cell, index):
        expected = reference.generate(subject.model, list(PROMPTS), settings).tokens
    else:
        expected = eager_tokens(cell.subject, dataclasses.replace(settings, steps_per_sync=1))
    assert torch.equal(found.cpu(), expected)

