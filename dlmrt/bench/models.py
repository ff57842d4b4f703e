"""The named random-weight models of `dlmrt bench --model NAME`: seeded, built in memory, nothing
downloaded. Each is a real family config at a size people benchmark."""

from __future__ import annotations

from pathlib import Path

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt import models
from dlmrt.models import Denoiser, SpecialTokens

_LLADA = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "rope_theta": 500000.0, "block_type": "llama",
          "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False, "weight_tying": False}
RANDOM_CONFIGS = {
    "llada-512x6": {**_LLADA, "d_model": 512, "n_heads": 8, "n_layers": 6, "mlp_hidden_size": 1408,
                    "vocab_size": 2048, "max_sequence_length": 1024},
    "llada-1024x8": {**_LLADA, "d_model": 1024, "n_heads": 16, "n_layers": 8, "mlp_hidden_size": 2816,
                     "vocab_size": 4096, "max_sequence_length": 2048},
    # LLaDA-8B's shapes, for a GPU: 8B parameters, 16 GB in bfloat16.
    "llada-8b": {**_LLADA, "d_model": 4096, "n_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288,
                 "vocab_size": 126464, "max_sequence_length": 4096},
    "llada2-moe-small": {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        "intermediate_size": 1408, "vocab_size": 2048, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
        "rope_theta": 600000.0, "use_qk_norm": True, "max_position_embeddings": 1024},
    # LLaDA2.1-mini's shapes (its public config.json), for a GPU: 16B parameters, about 1.4B active per token.
    "llada2.1-mini": {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 2048,
        "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 5120, "vocab_size": 157184, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 8,
        "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
        "rope_theta": 600000.0, "use_qk_norm": True, "max_position_embeddings": 8192},
}


def open_model(name: str | None, dtype: str, device: str):
    """A model directory (default: the tiny model), or a named random config (dlmrt.bench.models)."""
    import dlmrt
    from dlmrt import TINY_MODEL_DIR
    from dlmrt.bench.models import RANDOM_CONFIGS, random_model
    from dlmrt.models.checkpoint import resolve_dtype

    if name in RANDOM_CONFIGS:
        return random_model(name, dtype=resolve_dtype("float32" if dtype == "auto" else dtype), device=device)
    path = Path(name) if name else TINY_MODEL_DIR
    if name and not path.exists():
        raise ArgumentError(f"--model {name!r} is neither a model directory nor a random config "
                            f"({', '.join(RANDOM_CONFIGS)})")
    return dlmrt.load(path, dtype=dtype, device=device)


def random_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Denoiser:
    """The named config with seeded random weights (mask: the last id; EOS and pad: the one before)."""
    config = _config(name)
    model = models.create(config, tokens=_tokens(config), seed=0, dtype=dtype, device=device)
    model.name = name
    return model


def meta_model(name: str | None, dtype: str) -> Denoiser:
    """The module tree of a named config or a model directory (default: the tiny model) on the meta
    device, in `dtype` ("auto": bfloat16 for a named config, a directory's config.json dtype): the
    shapes of every weight, and none of their values."""
    from pathlib import Path

    from dlmrt import TINY_MODEL_DIR
    from dlmrt.models import checkpoint

    if name in RANDOM_CONFIGS:
        config = _config(name)
        model = models.build(config, "config", _tokens(config), device="meta")
        model.name = name
        return model.to(checkpoint.resolve_dtype("bfloat16" if dtype == "auto" else dtype))
    path = Path(name) if name else TINY_MODEL_DIR
    if name and not path.exists():
        raise ArgumentError(f"--model {name!r} is neither a model directory nor a random config "
                            f"({', '.join(RANDOM_CONFIGS)})")
    return checkpoint.structure(path).to(checkpoint.resolve_dtype(dtype, checkpoint.read_config(path)))


def _config(name: str) -> dict:
    if name not in RANDOM_CONFIGS:
        raise ArgumentError(f"unknown model {name!r}: give a model directory, or one of {', '.join(RANDOM_CONFIGS)}")
    return RANDOM_CONFIGS[name]


def _tokens(config: dict) -> SpecialTokens:
    vocab = config["vocab_size"]
    return SpecialTokens(mask_id=vocab - 1, eos_ids=(vocab - 2,), pad_id=vocab - 2)
