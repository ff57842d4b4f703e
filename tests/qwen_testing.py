"""What the Qwen-based families' tests share (Dream, SDAR): special tokens, and random models
whose norms and biases sit far from their initial values, so that a mix-up cannot pass."""

from __future__ import annotations

import torch

from dlmrt import models
from dlmrt.models import SpecialTokens

PAD, MASK, EOS = 0, 1, 2
TOKENS = SpecialTokens(MASK, (EOS,), PAD)
FIRST_WORD = 3


def make_model(raw: dict, seed: int = 0):
    """A random model whose norms and biases sit far from their initial 1 and 0."""
    model = models.create(raw, tokens=TOKENS, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                tensor.copy_(0.2 * noise)
            elif name == "model.embed_tokens.weight":
                tensor.copy_(noise)
            else:
                tensor.copy_(0.15 * noise)
    return model


def random_ids(raw: dict, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD, raw["vocab_size"], (batch, length), generator=generator)


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


def left_padded(raw: dict, pad: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(raw, 2, length, seed)
    ids[0, :pad] = PAD
    key_mask = torch.ones(2, length, dtype=torch.bool)
    key_mask[0, :pad] = False
    return ids, key_mask

# The tiny configs of the Qwen-based families.
DREAM = {
    "architectures": ["DreamModel"], "model_type": "Dream", "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 48,
    "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "rope_scaling": None,
    "attention_dropout": 0.0, "mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": PAD,
}

SDAR = {
    "architectures": ["SDARForCausalLM"], "model_type": "sdar", "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 48,
    "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    "rope_scaling": None, "attention_dropout": 0.0, "block_size": 4, "mask_token_id": MASK, "eos_token_id": EOS,
    "pad_token_id": PAD,
}
