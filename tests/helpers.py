"""Test helpers: small configs of each family and random models with visible logits."""

from __future__ import annotations

import copy

import torch

from dlmrt import tasks
from dlmrt.export import models
from dlmrt.export.models import SpecialTokens

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
