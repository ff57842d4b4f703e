"""DiffusionGemma's config.json: the text config, its rotary settings per kind of layer, and the
parameter count (`dlmrt.models.diffusion_gemma` is the model it configures).

Full-attention layers have their own head size and K/V heads (`per_layer_config`, or
`global_head_dim` / `num_global_key_value_heads`) and "proportional" rotary; what the parser does not
support it refuses by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dlmrt.core import limits
from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt.models import config as config_parsing

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    sliding_window: int = 512
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    layer_types: list | None = None
    rope_parameters: dict | None = None


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    text: TextConfig
    layer_types: tuple[str, ...]
    full_head_dim: int
    full_kv_heads: int
    rope: dict[str, RopeConfig] = field(default_factory=dict)
    canvas_length: int = 256

    def head_dim(self, layer_type: str) -> int:
        return self.full_head_dim if layer_type == FULL else self.text.head_dim

    def kv_heads(self, layer_type: str) -> int:
        return self.full_kv_heads if layer_type == FULL else self.text.num_key_value_heads


# text_config values that select variants dlmrt does not implement.
SUPPORTED_TEXT_FEATURES = {
    "hidden_activation": ("gelu_pytorch_tanh",),
    "attention_bias": (False,),
    # "vision" changes attention for image tokens only; "all" makes the encoder bidirectional.
    "use_bidirectional_attention": (None, "vision"),
    "tie_word_embeddings": (True,),
}
SUPPORTED_FEATURES = {"tie_word_embeddings": (True,)}


def _default_layer_types(layers: int) -> list[str]:
    """Five sliding layers, then one full, as the public config builds them when none are given."""
    return [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]


def _parse_rope(raw: Any, layer_type: str, source: str) -> RopeConfig:
    where = f"{source}: text_config.rope_parameters.{layer_type}"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be an object with rope_type and rope_theta, got {raw!r}")
    rope_type = raw.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedFeatureError(f"{where}: rope_type {rope_type!r} is not supported by dlmrt "
                                      f"(supported: {', '.join(ROPE_TYPES)})")
    values = {}
    for key, default in (("rope_theta", None), ("partial_rotary_factor", 1.0), ("factor", 1.0)):
        value = raw.get(key, default)
        if not config_parsing.matches(value, float) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{where}.{key} must be a positive number, got {value!r}")
        values[key] = float(value)
    if values["partial_rotary_factor"] > 1:
        raise CheckpointError(f"{where}.partial_rotary_factor must lie in (0, 1], "
                              f"got {values['partial_rotary_factor']}")
    if rope_type == "default" and (values["partial_rotary_factor"] != 1 or values["factor"] != 1):
        raise UnsupportedFeatureError(f"{where}: rope_type 'default' with partial_rotary_factor or factor is not "
                                      f"supported by dlmrt (the public code rotates whole heads there); use "
                                      f"'proportional'")
    return RopeConfig(rope_type, values["rope_theta"], values["partial_rotary_factor"], values["factor"])


def _full_layer_shape(raw_text: dict, text: TextConfig, layer_types: list[str], source: str) -> tuple[int, int]:
    """(head size, K/V heads) of the full-attention layers, from per_layer_config as saved, or from
    global_head_dim and num_global_key_value_heads as written by hand (the public defaults: 512, and
    the sliding layers' K/V heads)."""
    full = [i for i, t in enumerate(layer_types) if t == FULL]
    per_layer = raw_text.get("per_layer_config")
    if per_layer is None:
        head = raw_text.get("global_head_dim", 512)
        kv = raw_text.get("num_global_key_value_heads")
        if raw_text.get("attention_k_eq_v", True) is False or kv is None:
            kv = text.num_key_value_heads
        for name, value in (("global_head_dim", head), ("num_global_key_value_heads", kv)):
            if not config_parsing.matches(value, int):
                raise CheckpointError(f"{source}: text_config.{name} must be an integer, got {value!r}")
        return head, kv
    if not isinstance(per_layer, dict):
        raise CheckpointError(f"{source}: text_config.per_layer_config must be an object, got {per_layer!r}")
    shapes = set()
    for key, override in per_layer.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) in full):
            raise UnsupportedFeatureError(
                f"{source}: text_config.per_layer_config overrides layer {key!r}, which is not a full-attention "
                f"layer; dlmrt implements per-layer overrides of the full-attention layers only ({full})")
        unknown = set(override) - {"head_dim", "num_key_value_heads"} if isinstance(override, dict) else {"?"}
        if unknown:
            raise UnsupportedFeatureError(f"{source}: text_config.per_layer_config[{key}] sets {sorted(unknown)}; "
                                          f"dlmrt implements head_dim and num_key_value_heads overrides only")
        shapes.add((override.get("head_dim", text.head_dim), override.get("num_key_value_heads",
                                                                          text.num_key_value_heads)))
    if len(per_layer) < len(full):
        shapes.add((text.head_dim, text.num_key_value_heads))
    if len(shapes) > 1:
        raise UnsupportedFeatureError(f"{source}: text_config.per_layer_config gives the full-attention layers "
                                      f"different shapes {sorted(shapes)}; dlmrt implements one shape for them all")
    head, kv = shapes.pop() if shapes else (text.head_dim, text.num_key_value_heads)
    if not (config_parsing.matches(head, int) and config_parsing.matches(kv, int)):
        raise CheckpointError(f"{source}: text_config.per_layer_config head_dim and num_key_value_heads must be "
                              f"integers, got {head!r} and {kv!r}")
    return head, kv


def parse_config(raw: dict, source: str) -> DiffusionGemmaConfig:
    for key, allowed in SUPPORTED_FEATURES.items():
        if key in raw and raw[key] not in allowed:
            raise UnsupportedFeatureError(f"{source}: {key}={raw[key]!r} is not supported by dlmrt "
                                          f"(DiffusionGemma ties its embedding and head)")
    raw_text = raw.get("text_config")
    if not isinstance(raw_text, dict):
        raise CheckpointError(f"{source}: required field 'text_config' is missing or not an object "
                              f"(DiffusionGemma keeps its language model's sizes there)")
    where = f"{source} (text_config)"
    text = config_parsing.parse(TextConfig, raw_text, where, SUPPORTED_TEXT_FEATURES)
    config_parsing.require_sizes(text, where, {
        "hidden_size": limits.MAX_WIDTH, "intermediate_size": limits.MAX_WIDTH,
        "moe_intermediate_size": limits.MAX_WIDTH, "num_hidden_layers": limits.MAX_LAYERS,
        "num_attention_heads": limits.MAX_HEADS, "num_key_value_heads": limits.MAX_HEADS,
        "head_dim": limits.MAX_WIDTH, "num_experts": limits.MAX_EXPERTS, "top_k_experts": limits.MAX_EXPERTS,
        "vocab_size": limits.MAX_VOCAB, "max_position_embeddings": limits.MAX_POSITIONS,
        "sliding_window": limits.MAX_POSITIONS})
    require = config_parsing.require
    require(text.top_k_experts <= text.num_experts, where,
            f"top_k_experts ({text.top_k_experts}) must not exceed num_experts ({text.num_experts})")
    require(0 < text.rms_norm_eps < 1, where, f"rms_norm_eps must lie in (0, 1), got {text.rms_norm_eps}")
    require(text.final_logit_softcapping is None or text.final_logit_softcapping > 0, where,
            f"final_logit_softcapping must be positive or null, got {text.final_logit_softcapping}")
    layer_types = text.layer_types if text.layer_types is not None else _default_layer_types(text.num_hidden_layers)
    require(len(layer_types) == text.num_hidden_layers, where,
            f"layer_types lists {len(layer_types)} layers, but num_hidden_layers is {text.num_hidden_layers}")
    unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)}, key=str)
    if unknown:
        raise UnsupportedFeatureError(f"{where}: layer type {unknown[0]!r} is not supported by dlmrt "
                                      f"(supported: {SLIDING}, {FULL})")
    require(layer_types[-1] == FULL, where, f"the last layer must be {FULL} (the public config forces it), "
                                            f"got {layer_types[-1]}")
    full_head, full_kv = _full_layer_shape(raw_text, text, layer_types, where)
    rope_raw = text.rope_parameters if text.rope_parameters is not None else {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    rope = {t: _parse_rope(rope_raw.get(t), t, source) for t in sorted(set(layer_types))}
    config = DiffusionGemmaConfig(text, tuple(layer_types), full_head, full_kv, rope,
                                  raw.get("canvas_length", 256))
    for t in set(layer_types):
        heads, kv, head = text.num_attention_heads, config.kv_heads(t), config.head_dim(t)
        require(1 <= kv <= limits.MAX_HEADS and heads % kv == 0, where,
                f"num_attention_heads ({heads}) must be divisible by the {t} layers' K/V heads ({kv})")
        require(1 <= head <= limits.MAX_WIDTH and head % 2 == 0, where,
                f"the {t} layers' head size must be even for rotary embeddings, got {head}")
    require(config_parsing.matches(config.canvas_length, int) and 1 <= config.canvas_length <= limits.MAX_POSITIONS,
            source, f"canvas_length must be a positive integer, got {config.canvas_length!r}")
    return config


def parameter_count(c: DiffusionGemmaConfig) -> int:
    """The embedding (tied with the head), the layers' matrices and experts, and the self-conditioning MLP."""
    t = c.text
    total = t.vocab_size * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    for layer_type in c.layer_types:
        heads, kv, head = t.num_attention_heads, c.kv_heads(layer_type), c.head_dim(layer_type)
        projections = heads + kv * (2 if layer_type == SLIDING else 1)
        attention = t.hidden_size * projections * head + heads * head * t.hidden_size
        experts = t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size + t.num_experts * t.hidden_size
        total += attention + 3 * t.hidden_size * t.intermediate_size + experts
    return total
