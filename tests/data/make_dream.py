"""Make tests/data/dream: a tiny random Dream checkpoint and what the public Dream code computes with it.

Dev-only. It runs the public Dream model code (modeling_dream.py, configuration_dream.py and
generation_utils.py of github.com/ZHZisZZ/dllm, dllm/pipelines/dream/models/), exported as a
package `dream` into a folder, in a side environment that has torch, transformers (4.46 to 4.57)
and safetensors; dlmrt itself is not used. The outputs are committed, so the tests need neither.

Writes into tests/data/dream/:
- the checkpoint, by the public DreamModel's save_pretrained: vocab 64, hidden 32, 2 layers, 4
  heads, 2 KV heads, MLP 48, rope_theta 10000, mask 63, EOS 60, pad 61, float32, seeded; every
  weight re-randomized large enough for visible logits, norms and biases away from 1 and 0, and
  the mask token's lm_head row zero, so that the mask token is almost never chosen;
- expected_logits.safetensors: the public model's raw (unshifted) float32 logits for a batch of
  two, the first left-padded, called as the public generate calls it (2-D attention mask,
  position ids `cumsum(mask) - 1` with padding at 1), with the input ids and mask;
- expected.json: the tokens of the public `diffusion_generate` at temperature 0 for algs
  maskgit_plus, topk_margin and entropy, steps = gen_length and gen_length / 2, gen_length 8 and
  12, three prompts (batch 1 each), eps 1e-3, alg_temp None (alg_temp 0 is checked to agree), with
  the mask count after each step, the versions used and the dllm commit.

Setup and command (from the repository root):

    python3 -m venv /tmp/side-dream/venv
    /tmp/side-dream/venv/bin/pip install torch==2.13.0 'transformers>=4.46,<4.58' safetensors
    mkdir -p /tmp/side-dream/pub/dream && touch /tmp/side-dream/pub/dream/__init__.py
    for f in modeling_dream configuration_dream generation_utils; do
      git -C /work/.mirror/ZHZisZZ+dllm/repo show HEAD:dllm/pipelines/dream/models/$f.py \\
        > /tmp/side-dream/pub/dream/$f.py; done
    /tmp/side-dream/venv/bin/python tests/data/make_dream.py --public /tmp/side-dream/pub \\
        --dllm-commit "$(git -C /work/.mirror/ZHZisZZ+dllm/repo rev-parse HEAD)"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "dream"
VOCAB, MASK, EOS, PAD = 64, 63, 60, 61
SEED = 1234
PROMPTS = ([5, 17, 42], [8, 3, 29, 51, 11], [44, 2, 19, 33, 7, 26, 58])
ALGS = ("maskgit_plus", "topk_margin", "entropy")
GEN_LENGTHS = (8, 12)
EPS = 1e-3


def build_model(public):
    config = public.DreamConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, mask_token_id=MASK, pad_token_id=PAD, eos_token_id=EOS, torch_dtype="float32")
    torch.manual_seed(SEED)
    model = public.DreamModel(config).float().eval()
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                tensor.copy_(0.2 * noise)
            elif name == "model.embed_tokens.weight":
                tensor.copy_(noise)
            elif name == "lm_head.weight":
                tensor.copy_(0.3 * noise)
            else:
                tensor.copy_(0.15 * noise)
        model.lm_head.weight[MASK].zero_()
    return model


def expected_logits(model):
    ids = torch.tensor([[PAD, PAD, PAD, 5, 17, 42, MASK, MASK, MASK],
                        [8, 3, 29, 51, 11, 22, MASK, MASK, MASK]])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = mask.cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)  # as the public generate does
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert torch.isfinite(logits[real]).all()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "raw_logits": logits.contiguous()}


def generation_config(public, gen_length, steps, alg, alg_temp):
    # Every field explicit: left out, the public code falls back to temperature 1.0 and top_k 50.
    return public.DreamGenerationConfig(
        temperature=0.0, top_p=None, top_k=None, max_new_tokens=gen_length, steps=steps, eps=EPS, alg=alg,
        alg_temp=alg_temp, num_return_sequences=1, return_dict=False, output_history=False, mask_token_id=MASK,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=EOS)


def generate(public, model, prompt, gen_length, steps, alg, alg_temp):
    masks_after_step = []

    def count_masks(step, x, logits):
        if step is not None:
            masks_after_step.append(int((x == MASK).sum()))
        return x

    with torch.no_grad():
        out = model.diffusion_generate(torch.tensor([prompt]), generation_config(
            public, gen_length, steps, alg, alg_temp), generation_tokens_hook_func=count_masks)
    return out[0].tolist(), masks_after_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", required=True, help="the folder holding the public code as package `dream`")
    parser.add_argument("--dllm-commit", required=True, help="the dllm commit the public files come from")
    args = parser.parse_args()
    sys.path.insert(0, args.public)
    import transformers
    from safetensors.torch import save_file

    from dream import configuration_dream, generation_utils, modeling_dream

    class Public:
        DreamConfig = configuration_dream.DreamConfig
        DreamModel = modeling_dream.DreamModel
        DreamGenerationConfig = generation_utils.DreamGenerationConfig

    model = build_model(Public)
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save_pretrained(OUT, safe_serialization=True)
    # The public code falls back to the model's generation config for unset special tokens (set after
    # saving: its steps and lengths are this script's, not the checkpoint's).
    model.generation_config = generation_config(Public, 8, 8, "maskgit_plus", None)
    save_file(expected_logits(model), str(OUT / "expected_logits.safetensors"))

    cases = []
    for prompt in PROMPTS:
        for gen_length in GEN_LENGTHS:
            for steps in (gen_length, gen_length // 2):
                for alg in ALGS:
                    tokens, masks = generate(Public, model, prompt, gen_length, steps, alg, None)
                    again, _ = generate(Public, model, prompt, gen_length, steps, alg, 0.0)
                    assert again == tokens, "alg_temp 0 and None must both take the top-k branch"
                    assert tokens[:len(prompt)] == prompt and MASK not in tokens, (prompt, alg, tokens)
                    cases.append({"prompt": prompt, "gen_length": gen_length, "steps": steps, "alg": alg,
                                  "generated": tokens[len(prompt):], "masks_after_step": masks})
    expected = {
        "what": "tokens of the public Dream diffusion_generate on this directory's checkpoint",
        "settings": {"temperature": 0.0, "top_p": None, "top_k": None, "eps": EPS, "alg_temp": None,
                     "alg_temp_zero_gives_the_same": True, "output_history": False, "batch": 1},
        "special_tokens": {"mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": PAD},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "dllm_commit": args.dllm_commit,
        "public_files": [f"dllm/pipelines/dream/models/{name}.py"
                         for name in ("modeling_dream", "configuration_dream", "generation_utils")],
        "cases": cases,
    }
    text = json.dumps({**expected, "cases": []}, indent=1)
    one_per_line = ",\n  ".join(json.dumps(case) for case in cases)
    (OUT / "expected.json").write_text(text.replace('"cases": []', f'"cases": [\n  {one_per_line}\n ]') + "\n")
    print(f"wrote {OUT}: {len(cases)} generation cases")


if __name__ == "__main__":
    main()
