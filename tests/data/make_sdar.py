"""Make tests/data/sdar: a tiny random SDAR checkpoint and what the public SDAR code computes with it.

Dev-only. It runs the public SDAR code of github.com/JetAstra/SDAR (modeling_sdar.py and
configuration_sdar.py of training/model/SDAR-4B-Chat/, the same files as SDAR-8B-Chat's, and the
repository's generate.py), exported as a package `sdar` into a folder, in a side environment that
has torch, transformers 4.52.4 (the version SDAR's config.json names; 4.56 and later lack the
`LossKwargs` modeling_sdar.py imports), einops and safetensors; dlmrt itself is not used. The
outputs are committed, so the tests need neither.

flash-attn and triton do not install there, so this script puts stand-ins into `sys.modules`
before importing the public code (the public files are not edited): `rms_norm_fn` computes
flash-attn's RMSNorm in float32, `flash_attn_func` (the public code's path when a mask allows
everything) is SDPA without a mask, and the fused training loss is absent (training only).

Writes into tests/data/sdar/:
- the checkpoint, by the public SDARForCausalLM's save_pretrained: vocab 64, hidden 32, 2
  layers, 4 heads, 2 KV heads, head_dim 8, MLP 48, rope_theta 10000, block_size 4, mask 63,
  EOS 60, pad 61, float32, seeded; weights re-randomized large enough for visible logits, every
  norm weight away from 1, and the mask token's lm_head row zero;
- expected_logits.safetensors: the public model's float32 logits for one 12-token input under
  the block-causal mask of block 4 built as the public generate builds it
  (`tril(ones(blocks, blocks))` repeated over each block's rows and columns), position ids
  0..11, with the input ids, mask and positions;
- expected.json: the tokens of the public `block_diffusion_generate` (batch 1, block 4,
  temperature 1, top_k 0, top_p 1) with `torch.multinomial` replaced by an argmax during the
  call, so that it is greedy and each position's confidence is its softmax top probability,
  for remasking strategies low_confidence_static and low_confidence_dynamic over a few prompts,
  step counts and thresholds, with the mask count before each denoising forward.

Setup and command (from the repository root):

    python3 -m venv /tmp/side-sdar/venv
    /tmp/side-sdar/venv/bin/pip install torch==2.13.0 transformers==4.52.4 einops safetensors
    mkdir -p /tmp/side-sdar/pub/sdar && touch /tmp/side-sdar/pub/sdar/__init__.py
    for f in modeling_sdar configuration_sdar; do
      git -C /work/.mirror/JetAstra+SDAR/repo show HEAD:training/model/SDAR-4B-Chat/$f.py \\
        > /tmp/side-sdar/pub/sdar/$f.py; done
    git -C /work/.mirror/JetAstra+SDAR/repo show HEAD:generate.py > /tmp/side-sdar/pub/sdar/generate.py
    /tmp/side-sdar/venv/bin/python tests/data/make_sdar.py --public /tmp/side-sdar/pub \\
        --sdar-commit "$(git -C /work/.mirror/JetAstra+SDAR/repo rev-parse HEAD)"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent / "sdar"
VOCAB, MASK, EOS, PAD = 64, 63, 60, 61
BLOCK = 4
SEED = 4321
LOGITS_INPUT = [5, 17, 42, 8, 3, 29, MASK, MASK, 11, MASK, MASK, MASK]
PROMPTS = ([5, 17, 42], [8, 3, 29, 51, 11], [44, 2, 19, 33, 7, 26, 58, 12])
GEN_LENGTHS = (8, 12)


def rms_norm_fn(x, weight, bias, eps, **_):
    """flash-attn's RMSNorm: normalized and scaled in float32, returned in the input's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, **_):
    """flash-attn's layout [B, T, H, D] and grouped K/V heads, by SDPA without a mask."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def install_stand_ins() -> None:
    def module(name, **attributes):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attributes)

    def unavailable(*_, **__):
        raise NotImplementedError("not available in the side environment")

    module("flash_attn", flash_attn_func=flash_attn_func, flash_attn_varlen_func=unavailable)
    module("flash_attn.ops")
    module("flash_attn.ops.triton")
    module("flash_attn.ops.triton.layer_norm", rms_norm_fn=rms_norm_fn)
    module("flash_attn.bert_padding", index_first_axis=unavailable, pad_input=unavailable, unpad_input=unavailable)
    module("sdar.fused_linear_diffusion_cross_entropy", FusedLinearDiffusionCrossEntropyLoss=unavailable)


def build_model(configuration_sdar, modeling_sdar):
    config = configuration_sdar.SDARConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=None,
        block_size=BLOCK, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
        fuse_cross_entropy=False, torch_dtype="float32")
    torch.manual_seed(SEED)
    model = modeling_sdar.SDARForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * noise)
            elif name == "model.embed_tokens.weight":
                tensor.copy_(noise)
            elif name == "lm_head.weight":
                tensor.copy_(0.5 * noise)
            else:
                tensor.copy_(0.2 * noise)
        model.lm_head.weight[MASK].zero_()
    return model


def block_causal_mask(length: int) -> torch.Tensor:
    """The public generate's mask, cut to `length` ([1, length, length], float ones and zeros)."""
    blocks = (length + BLOCK - 1) // BLOCK
    mask = torch.tril(torch.ones(blocks, blocks))
    return mask.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1).unsqueeze(0)[:, :length, :length]


def expected_logits(model):
    ids = torch.tensor([LOGITS_INPUT])
    mask = block_causal_mask(ids.shape[1])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    assert torch.isfinite(logits).all()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "logits": logits.contiguous()}


def generate(public_generate, model, prompt, gen_length, strategy, steps, threshold):
    masks_before_step = []

    def count_masks(module, args, kwargs):
        if not kwargs.get("store_kv"):
            masks_before_step.append(int((args[0] == MASK).sum()))

    hook = model.register_forward_pre_hook(count_masks, with_kwargs=True)
    multinomial = torch.multinomial
    torch.multinomial = lambda probs, num_samples: probs.argmax(-1, keepdim=True)
    try:
        out = public_generate.block_diffusion_generate(
            model, {"input_ids": torch.tensor([prompt])}, MASK, gen_length=gen_length, block_length=BLOCK,
            denoising_steps=steps, temperature=1.0, top_k=0, top_p=1.0, remasking_strategy=strategy,
            confidence_threshold=threshold, stopping_criteria_idx=None)
    finally:
        torch.multinomial = multinomial
        hook.remove()
    return out[0].tolist(), masks_before_step


def cases(public_generate, model):
    found = []
    for prompt in PROMPTS:
        for gen_length in GEN_LENGTHS:
            # Steps below the block length are only run where the public rule never asks for more
            # positions than are masked (it would then overwrite prompt or decoded tokens).
            for steps in (BLOCK, BLOCK // 2) if len(prompt) % BLOCK == 0 else (BLOCK,):
                settings = [("low_confidence_static", None)]
                settings += [("low_confidence_dynamic", t) for t in (0.3, 0.6)] if steps == BLOCK else []
                for strategy, threshold in settings:
                    tokens, masks = generate(public_generate, model, prompt, gen_length, strategy, steps, threshold)
                    assert tokens[:len(prompt)] == prompt and MASK not in tokens, (prompt, strategy, tokens)
                    found.append({"prompt": prompt, "gen_length": gen_length, "steps_per_block": steps,
                                  "remasking_strategy": strategy, "confidence_threshold": threshold,
                                  "generated": tokens[len(prompt):], "masks_before_step": masks})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", required=True, help="the folder holding the public code as package `sdar`")
    parser.add_argument("--sdar-commit", required=True, help="the JetAstra/SDAR commit the public files come from")
    args = parser.parse_args()
    sys.path.insert(0, args.public)
    import transformers
    import transformers.modeling_flash_attention_utils  # noqa: F401  (asks whether flash-attn is installed)
    import transformers.modeling_utils  # noqa: F401
    from safetensors.torch import save_file

    install_stand_ins()  # after transformers has seen that flash-attn is absent

    from sdar import configuration_sdar, modeling_sdar
    from sdar import generate as public_generate

    model = build_model(configuration_sdar, modeling_sdar)
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save_pretrained(OUT, safe_serialization=True)
    save_file(expected_logits(model), str(OUT / "expected_logits.safetensors"))
    found = cases(public_generate, model)
    expected = {
        "what": "tokens of the public SDAR block_diffusion_generate (generate.py) on this directory's checkpoint",
        "settings": {"block_length": BLOCK, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "batch": 1,
                     "sampling": "torch.multinomial replaced by argmax: greedy, confidence = softmax top probability",
                     "stopping_criteria_idx": None},
        "special_tokens": {"mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": PAD},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "sdar_commit": args.sdar_commit,
        "public_files": ["training/model/SDAR-4B-Chat/modeling_sdar.py",
                         "training/model/SDAR-4B-Chat/configuration_sdar.py", "generate.py"],
        "cases": [],
    }
    text = json.dumps(expected, indent=1)
    one_per_line = ",\n  ".join(json.dumps(case) for case in found)
    (OUT / "expected.json").write_text(text.replace('"cases": []', f'"cases": [\n  {one_per_line}\n ]') + "\n")
    print(f"wrote {OUT}: {len(found)} generation cases")


if __name__ == "__main__":
    main()
