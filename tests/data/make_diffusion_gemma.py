"""Make tests/data/diffusion_gemma: a tiny random DiffusionGemma checkpoint and what the public model code
computes with it.

Dev-only. It runs the public DiffusionGemma code of Hugging Face transformers 5.x
(`transformers/models/diffusion_gemma/`) in a side environment with torch and transformers;
dlmrt itself is not used. The outputs are committed, so the tests need neither.

Writes into tests/data/diffusion_gemma/:
- the checkpoint, by the public DiffusionGemmaForBlockDiffusion's save_pretrained (its image tower
  included, which dlmrt must skip): vocab 96, hidden 32, 6 layers (sliding, sliding, full,
  sliding, sliding, full), 4 heads, 2 K/V heads of 8 on sliding layers and 1 of 16 on full ones,
  sliding window 4, dense MLP 48, 4 experts top-2 of width 16, canvas 8, float32, seeded. Every
  matrix is re-randomized large enough for visible logits, and every norm weight, router scale,
  per-expert scale and layer scalar (the encoder's and the decoder's apart) is drawn from
  [0.5, 1.5], away from 0 and 1, so that a `w` / `1 + w` mix-up or a swapped scalar shows.
- expected.safetensors, for a batch of two prompts of 6 tokens (longer than the window):
  - the encoder's cache after the prompt (per layer, as the public cache keeps it: the last
    window - 1 positions on sliding layers, all on full ones);
  - the decoder's logits on a first canvas (no self-conditioning), and on a second step fed the
    first step's logits divided by 0.8 as self-conditioning logits;
  - the cache after encoding that canvas as committed, and the decoder's logits on a next canvas;
  everything called as the public generate calls it (positions counting on from the cache).

Setup and command (from the repository root):

    python3 -m venv /tmp/side-dg
    /tmp/side-dg/bin/pip install torch==2.13.0 transformers==5.17.0 safetensors
    /tmp/side-dg/bin/python tests/data/make_diffusion_gemma.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache, Gemma4VisionConfig

OUT = Path(__file__).parent / "diffusion_gemma"
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, sliding_window=4,
            num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=512,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)
VISION = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
              head_dim=8, patch_size=2, position_embedding_size=4)
CANVAS = 8
PROMPTS = [[2, 17, 42, 5, 63, 11], [2, 9, 22, 31, 8, 77]]
SELF_CONDITIONING_TEMPERATURE = 0.8


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "vision" in name:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or leaf in ("scale", "per_expert_scale", "layer_scalar"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif "embed_tokens" in name:
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            elif tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5)


def cache_tensors(cache: DynamicCache, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for index, layer in enumerate(cache.layers):
        out[f"{prefix}.{index}.k"] = layer.keys.contiguous()
        out[f"{prefix}.{index}.v"] = layer.values.contiguous()
    return out


def main() -> None:
    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=TEXT, vision_config=Gemma4VisionConfig(**VISION),
                                  canvas_length=CANVAS)
    config.text_config._attn_implementation = "eager"
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    randomize(model, torch.Generator().manual_seed(1))
    # the checkpoint stores every layer's two scalars apart: check the draw made them differ
    encoder_scalar = model.model.encoder.language_model.layers[0].layer_scalar
    assert not torch.equal(encoder_scalar, model.model.decoder.layers[0].layer_scalar)
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save_pretrained(OUT)

    generator = torch.Generator().manual_seed(2)
    prompt = torch.tensor(PROMPTS)
    batch, length = prompt.shape
    canvas = torch.randint(0, TEXT["vocab_size"], (batch, CANVAS), generator=generator)
    next_canvas = torch.randint(0, TEXT["vocab_size"], (batch, CANVAS), generator=generator)
    tensors = {"prompt": prompt, "canvas": canvas, "next_canvas": next_canvas}
    with torch.no_grad():
        cache = DynamicCache(config=config.get_text_config(decoder=True))
        model.model.encoder(input_ids=prompt, past_key_values=cache,
                            position_ids=torch.arange(length)[None])
        tensors.update(cache_tensors(cache, "prompt_cache"))
        positions = torch.arange(length, length + CANVAS)[None]
        first = model(past_key_values=cache, decoder_input_ids=canvas, decoder_position_ids=positions).logits
        second = model(past_key_values=cache, decoder_input_ids=canvas, decoder_position_ids=positions,
                       self_conditioning_logits=first / SELF_CONDITIONING_TEMPERATURE).logits
        model.model.encoder(input_ids=canvas, past_key_values=cache, position_ids=positions)
        tensors.update(cache_tensors(cache, "canvas_cache"))
        next_positions = torch.arange(length + CANVAS, length + 2 * CANVAS)[None]
        third = model(past_key_values=cache, decoder_input_ids=next_canvas,
                      decoder_position_ids=next_positions).logits
    tensors.update(first_logits=first, second_logits=second, next_logits=third)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(OUT / "expected.safetensors"))
    (OUT / "expected.json").write_text(json.dumps({
        "transformers": transformers.__version__, "torch": torch.__version__,
        "self_conditioning_temperature": SELF_CONDITIONING_TEMPERATURE,
        "layer_types": TEXT["layer_types"], "sliding_window": TEXT["sliding_window"]}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
