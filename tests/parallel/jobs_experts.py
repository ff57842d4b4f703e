"""Rank jobs for the expert-parallel tests (importable, so that spawned ranks can unpickle them).

`eager_job` and `compiled_job` build each family's random model on every rank (same seed, so the same
weights), run it unsharded, shard its experts and run it again (eager; compiled with
`torch.compile(fullgraph=True, dynamic=False)`). They return plain numbers and numpy arrays: no
torch tensor crosses the process boundary."""

from __future__ import annotations

import contextlib
import gc
import json
import time
import weakref
from pathlib import Path

import torch

from dlmrt import models
from dlmrt.models import diffusion_gemma, llada2_moe
from dlmrt.models.layers import SwiGLU
from dlmrt.parallel.experts import ExpertParallelExperts, ExpertParallelMoE, shard_experts
from dlmrt.parallel.ranks import Ranks
from helpers import LLADA2, random_model

GEMMA_CONFIG = Path(__file__).parents[1] / "data" / "diffusion_gemma" / "config.json"
GEMMA_EXPERTS = 8
PROMPT, CANVAS = 6, 8  # DiffusionGemma: the encoded prompt, then a canvas after it
BATCH, LENGTH = 2, 12  # LLaDA2: one window


def gemma_config() -> dict:
    raw = json.loads(GEMMA_CONFIG.read_text())
    text = raw["text_config"]
    text["num_experts"] = GEMMA_EXPERTS
    text["layer_types"] = ["sliding_attention", "full_attention"]  # 2 layers of 6: a faster compile
    text["num_hidden_layers"] = len(text["layer_types"])
    text["per_layer_config"] = {"1": text["per_layer_config"]["2"]}
    return raw


def random_gemma(seed: int = 0, scale: float = 0.15):
    """A random DiffusionGemma with 8 experts, its weights large enough for routing and logits to vary."""
    model = models.create(gemma_config(), seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                tensor.copy_(1 + 0.1 * noise)
            else:
                tensor.copy_(scale * noise)
    return model


def moe_layers(family: str, model) -> int:
    c = model.config
    if family == "llada2_moe":
        return c.num_hidden_layers - c.first_k_dense_replace
    return c.text.num_hidden_layers


def hidden_size(family: str, model) -> int:
    return model.config.hidden_size if family == "llada2_moe" else model.config.text.hidden_size


def expert_tensors(model) -> dict[str, torch.Tensor]:
    """The routed experts' tensors by state-dict name (LLaDA2: one per expert; DiffusionGemma: stacked)."""
    return {name: tensor for name, tensor in model.state_dict().items()
            if ".experts." in name and "shared_experts" not in name}


def _inputs(family: str, vocab: int):
    generator = torch.Generator().manual_seed(7)
    if family == "llada2_moe":
        return (torch.randint(0, vocab, (BATCH, LENGTH), generator=generator),)
    prompt = torch.randint(0, vocab, (BATCH, PROMPT), generator=generator)
    canvas = torch.randint(0, vocab, (BATCH, CANVAS), generator=generator)
    return prompt, canvas


def _step(family: str, model, inputs):
    """What one forward returns: LLaDA2's logits; DiffusionGemma's cache after the prompt and the
    canvas's logits after that cache (a function of the inputs, so that torch.compile can take it)."""
    if family == "llada2_moe":
        (ids,) = inputs
        return {"logits": model.denoise(ids).logits}
    prompt, canvas = inputs
    cache = model.encode(prompt)
    positions = torch.arange(PROMPT, PROMPT + CANVAS)[None].expand(BATCH, -1)
    logits = model.denoise(canvas, positions=positions, past=cache).logits
    return {"logits": logits, "sliding": cache.sliding, "full": cache.full}


def _max_difference(got: dict, expected: dict) -> float:
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)


def build(family: str):
    return random_model(LLADA2, seed=3) if family == "llada2_moe" else random_gemma(seed=3)


def compile_step(family: str, model):
    return torch.compile(lambda *args: _step(family, model, args), fullgraph=True, dynamic=False)


def _routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (llada2_moe.Router, diffusion_gemma.Router))]


def _choices(model, family: str, inputs) -> list[torch.Tensor]:
    """The experts each MoE layer's router chose, `[N, k]` per call, over one forward."""
    chosen = []
    hooks = [router.register_forward_hook(lambda module, args, out: chosen.append(out[0].clone()))
             for router in _routers(model)]
    try:
        _step(family, model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


@contextlib.contextmanager
def _first_half_chosen(model):
    """LLaDA2: every router's choice pushed onto the first half of the experts (rank 0's), then restored."""
    saved = [router.expert_bias.clone() for router in _routers(model)]
    for router in _routers(model):
        router.expert_bias[: router.expert_bias.shape[0] // 2] += 100.0
    try:
        yield
    finally:
        for router, bias in zip(_routers(model), saved):
            router.expert_bias.copy_(bias)


def _split_shared_experts(model, ranks: Ranks) -> None:
    """What TP does to LLaDA2's shared experts: gate and up split by output rows, down by input columns,
    no collective of their own; `shared_is_partial` then makes every rank add its part."""
    for module in model.modules():
        if isinstance(module, ExpertParallelMoE) and module.shared_experts is not None:
            shared = module.shared_experts
            part = ranks.shard(shared.gate_proj.out_features)
            split = SwiGLU(shared.gate_proj.in_features, part.stop - part.start)
            split.gate_proj.weight.copy_(shared.gate_proj.weight[part])
            split.up_proj.weight.copy_(shared.up_proj.weight[part])
            split.down_proj.weight.copy_(shared.down_proj.weight[:, part])
            module.shared_experts, module.shared_is_partial = split, True


def eager_job(ranks: Ranks, families: tuple[str, ...]) -> dict:
    """Per family: the unsharded and the EP-sharded model in eager, the collectives, the kept experts."""
    return {family: _eager(ranks, family) for family in families}


def _eager(ranks: Ranks, family: str) -> dict:
    model = build(family)
    inputs = _inputs(family, model.vocab_size)
    full_experts = {name: tensor.clone() for name, tensor in expert_tensors(model).items()}
    full_parameters = sum(p.numel() for p in model.parameters())
    result = {}
    with torch.no_grad():
        expected = _step(family, model, inputs)
        choices = _choices(model, family, inputs)
        if family == "llada2_moe":
            with _first_half_chosen(model):
                expected_idle = _step(family, model, inputs)
        old_experts = [weakref.ref(p) for name, p in model.named_parameters()
                       if ".experts." in name and "shared_experts" not in name]
        shard_experts(model, ranks)
        ranks.count()
        eager = _step(family, model, inputs)
        result["calls"] = list(ranks.log.calls)
        if family == "llada2_moe":  # rank 1 computes nothing, yet joins each all-reduce
            with _first_half_chosen(model):
                ranks.count()
                idle = _step(family, model, inputs)
            result["idle_calls"] = list(ranks.log.calls)
            result["idle_difference"] = _max_difference(idle, expected_idle)
    gc.collect()
    result["old_expert_parameters_alive"] = sum(p().numel() for p in old_experts if p() is not None)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    if family == "llada2_moe":
        with torch.no_grad():
            _split_shared_experts(model, ranks)  # as TP would, then every rank adds its part
            ranks.count()
            split = _step(family, model, inputs)
            result["split_shared_calls"] = list(ranks.log.calls)
            result["split_shared_difference"] = _max_difference(split, expected)
    kept = expert_tensors(model)
    half = model_experts(family, model) // ranks.world
    return result | {
        "eager_difference": _max_difference(eager, expected),
        "logits_spread": float(expected["logits"].std()),
        "logits": eager["logits"].numpy(),
        # (token, layer) pairs whose k experts lie on both ranks: their sum needs the all-reduce
        "split_choices": sum(int(((c < half).any(-1) & (c >= half).any(-1)).sum()) for c in choices),
        "choices": sum(c.shape[0] for c in choices),
        "tokens": {name: tensor.numel() for name, tensor in zip(("prompt", "canvas"), inputs)}
        if family == "diffusion_gemma" else {"window": inputs[0].numel()},
        "moe_layers": moe_layers(family, model),
        "hidden_size": hidden_size(family, model),
        "num_experts": model_experts(family, model),
        "kept_experts": _kept_experts(model),
        # each kept tensor is the full model's tensor of the same name (LLaDA2), or its rows (DiffusionGemma)
        "kept_match": all(torch.equal(tensor, _full_part(full_experts[name], family, ranks))
                          for name, tensor in kept.items()),
        "kept_names": sorted(kept),
        "full_names": sorted(full_experts),
        # the kept tensors' storages hold just the kept experts (LLaDA2 names rows of its stacks apart)
        "kept_own_storage": sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                 for t in kept.values()}.values()) == sum(t.nbytes for t in kept.values()),
        "full_parameters": full_parameters,
        "expert_parameters": sum(t.numel() for t in kept.values()),
        "full_expert_parameters": sum(t.numel() for t in full_experts.values()),
    }


def compiled_job(ranks: Ranks, families: tuple[str, ...]) -> dict:
    """Per family: the largest difference of the compiled EP-sharded step from the unsharded model's
    eager step, and its logits."""
    results = {}
    for family in families:
        model = build(family)
        inputs = _inputs(family, model.vocab_size)
        with torch.no_grad():
            expected = _step(family, model, inputs)
            shard_experts(model, ranks)
            started = time.perf_counter()
            compiled = compile_step(family, model)(*inputs)
        results[family] = {"difference": _max_difference(compiled, expected), "logits": compiled["logits"].numpy(),
                           "seconds": time.perf_counter() - started}
    return results


def model_experts(family: str, model) -> int:
    return model.config.num_experts if family == "llada2_moe" else model.config.text.num_experts


def _full_part(full: torch.Tensor, family: str, ranks: Ranks) -> torch.Tensor:
    return full if family == "llada2_moe" else full[ranks.shard(full.shape[0])]


def _kept_experts(model) -> list[list[int]]:
    """Each MoE layer's kept experts, by global index."""
    kept = []
    for module in model.modules():
        if isinstance(module, ExpertParallelMoE):
            assert module.experts.first == module.start
            assert module.experts.gate_proj.weight.shape[0] == module.stop - module.start
            kept.append(list(range(module.start, module.stop)))
        elif isinstance(module, ExpertParallelExperts):
            assert module.gate_up_proj.shape[0] == module.down_proj.shape[0] == module.stop - module.start
            kept.append(list(range(module.start, module.stop)))
    return kept

