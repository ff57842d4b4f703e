"""Test helpers: small configs of each family and random models with visible logits; running Triton
kernel cases in the interpreter; fresh copies of modules."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dlmrt.core import tasks
from dlmrt import models
from dlmrt.models import SpecialTokens

TOKENS = SpecialTokens(mask_id=tasks.MASK_ID, eos_ids=(tasks.EOS_ID,), pad_id=tasks.PAD_ID)
VOCAB = len(tasks.SPECIAL_TOKENS) + len(tasks.ALPHABET)

LLADA = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
    "n_layers": 2, "mlp_hidden_size": 48, "vocab_size": VOCAB, "max_sequence_length": 64,
    "rope_theta": 10000.0, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
    "rope": True, "alibi": False, "weight_tying": False, "mask_token_id": tasks.MASK_ID,
    "eos_token_id": tasks.EOS_ID, "pad_token_id": tasks.PAD_ID,
}

LLADA2 = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 48, "vocab_size": VOCAB, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "moe_router_enable_expert_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 600000.0,
    "use_qk_norm": True, "max_position_embeddings": 64, "mask_token_id": tasks.MASK_ID,
    "eos_token_id": tasks.EOS_ID, "pad_token_id": tasks.PAD_ID,
}

ORL = {"adapter": "mlp", "adapter_hidden_size": 16, "topk": 0}


def config(base: dict, **changes) -> dict:
    raw = copy.deepcopy(base)
    raw.update(changes)
    return raw


def random_model(raw: dict, seed: int = 0, scale: float = 0.15):
    """A random model whose weights are large enough for logits to differ visibly."""
    model = models.create(raw, tokens=TOKENS, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * noise)
            else:
                tensor.copy_(scale * noise)
    model.tokenizer = tasks.build_tokenizer()
    return model


class EOSAt:
    """Wraps a model so that generated position `eos_position` (0-based) predicts EOS with certainty
    (written without data-dependent indexing, so that it compiles)."""

    def __init__(self, model, prompt_length, eos_position):
        self.model, self.target = model, prompt_length + eos_position

    def __getattr__(self, name):
        if name in ("model", "target"):  # not set yet: a copy is being made
            raise AttributeError(name)
        return getattr(self.model, name)

    def denoise(self, ids, *, positions, logits_index=None, **kwargs):
        out = self.model.denoise(ids, positions=positions, **kwargs)
        at_target = (positions == self.target)[..., None]
        eos = torch.arange(out.logits.shape[-1], device=ids.device) == TOKENS.eos_ids[0]
        logits = torch.where(at_target, torch.where(eos, 1e4, -1e4).to(out.logits.dtype), out.logits)
        if logits_index is not None:
            logits = logits.index_select(1, logits_index)
        return out._replace(logits=logits)


@dataclass(frozen=True)
class Loop:
    """How the step loop runs in a parity test: a TorchBackend mode and K, the steps per host read
    (an int, or "block" for a whole block)."""

    mode: str
    steps_per_sync: int | str

    def __str__(self) -> str:
        return f"{self.mode}-K{self.steps_per_sync}"

    def backend(self, model, **options):
        from dlmrt.runtime.torch_backend import TorchBackend

        if self.mode == "cudagraph":
            model = _on_cuda(model)
        return TorchBackend(model, mode=self.mode, **options)

    def settings(self, settings):
        k = settings.block_length if self.steps_per_sync == "block" else self.steps_per_sync
        return dataclasses.replace(settings, steps_per_sync=k)

    def generator(self, model, **options):
        from dlmrt.runtime import Generator

        return _LoopGenerator(Generator(self.backend(model, **options)), self)

    def run(self, model, prompts, settings, **kwargs):
        return self.generator(model).generate(prompts, settings, **kwargs)


class _LoopGenerator:
    """A Generator whose settings get the loop's K."""

    def __init__(self, generator, loop: Loop):
        self.inner, self.loop = generator, loop
        self.backend = generator.backend

    def generate(self, prompts, settings, **kwargs):
        return self.inner.generate(prompts, self.loop.settings(settings), **kwargs)

    def stream(self, prompts, settings, **kwargs):
        return self.inner.stream(prompts, self.loop.settings(settings), **kwargs)


# id(model) -> (model, its CUDA copy). The model is kept with its copy so that its id cannot pass to
# another model (a module-scoped fixture's, or a test's wrapper) once it is freed.
_CUDA_COPIES: dict[int, tuple[object, object]] = {}


def _on_cuda(model):
    """A CUDA copy of `model`, made once per model. A wrapper (EOSAt) stays one: `.to` moves a module in
    place, and a wrapper hands it to its model, so the copy is moved without taking `.to`'s return value
    (for a wrapper, its inner model)."""
    entry = _CUDA_COPIES.get(id(model))
    if entry is None or entry[0] is not model:
        moved = copy.deepcopy(model)
        moved.to("cuda")
        entry = _CUDA_COPIES[id(model)] = (model, moved)
    return entry[1]


def fresh_module(name: str):
    """A new copy of a module (not entered in sys.modules), imported in the current environment."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Triton's interpreter: `TRITON_INTERPRET=1` has to be set before Triton itself is imported (Triton's
# own standard library is decorated at import, and its lazy imports check the variable at launch), so
# one process cannot switch modes safely. A test file therefore runs its kernel cases once, in a fresh
# process started with the variable: the file itself run as a script, whose `__main__` calls
# `interpret_cases`, and compares what comes back with the reference in the test process.

def run_in_interpreter(script: str, cases: dict, folder: Path) -> dict:
    """The outputs of every case, from `script` run under TRITON_INTERPRET=1."""
    torch.save(cases, folder / "cases.pt")
    path = os.pathsep.join(filter(None, (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))))  # these helpers
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, script, str(folder / "cases.pt"), str(folder / "results.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(folder / "results.pt", weights_only=False)


def interpret_cases(kernels: str, run_case: Callable, cases_path: str, results_path: str) -> None:
    """The worker behind `run_in_interpreter`: run every case with the kernels module `kernels`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    module = importlib.import_module(kernels)
    from dlmrt.ops.parallel_unmask import triton_kernels
    assert triton_kernels.interpreted()
    cases = torch.load(cases_path, weights_only=False)
    torch.save({name: run_case(module, case) for name, case in cases.items()}, results_path)


def cuda_kernels(name: str):
    """The kernels module `name`, compiled for the GPU; skips the test where there is none."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the test process interprets Triton")
    return importlib.import_module(name)


def check_plugin_registration(op: str) -> None:
    """Register the TensorRT plugin of the op package `op` (twice: once counts) and find it in TensorRT's
    registry under its ONNX node's namespace and version; skips where TensorRT is missing."""
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed")
    trt_plugin = importlib.import_module(f"dlmrt.ops.{op}.trt_plugin")
    onnx_function = importlib.import_module(f"dlmrt.ops.{op}.onnx_function")
    trt_plugin.register()
    trt_plugin.register()
    creator = trt.get_plugin_registry().get_creator(onnx_function.OP_TYPE, onnx_function.TENSORRT_PLUGIN_VERSION,
                                                    onnx_function.DOMAIN)
    assert creator is not None, f"dlmrt::{onnx_function.OP_TYPE} is not in TensorRT's plugin registry"


def plan_for(export_dir, tmp_path, target="sm_90", precision="bf16", tensorrt="10.13", **options):
    """The TensorRT build plan of an export for one target (no TensorRT needed)."""
    from dlmrt.engines import targets
    from dlmrt.engines.plan import make_plan

    return make_plan(export_dir, targets.target_named(target), precision, tensorrt=tensorrt,
                     store=tmp_path / "store", **options)


def load_graphs(plan, export_dir):
    import onnx

    return {graph.name: onnx.load(str(export_dir / graph.onnx)) for graph in plan.graphs}
