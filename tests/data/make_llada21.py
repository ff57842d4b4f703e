"""Make tests/data/llada21: a tiny random LLaDA2.1 checkpoint and the tokens that the PUBLIC
LLaDA2.1 model code's own token-editing `generate` decodes with it.

DEV-ONLY. This script is not run by the tests and dlmrt never imports it: its outputs are
committed, so the tests need neither transformers nor the public code. It needs

  * a side environment (never dlmrt's venv) with torch, transformers 4.57 and safetensors, and
  * the public LLaDA2.1 model code, the dllm repository (github.com/ZHZisZZ/dllm, commit
    ca176752fbceec49c6b4777a2c18ae88e4eb10ed): its two files
    dllm/pipelines/llada21/models/{modeling,configuration}_llada21_moe.py, exported into a package
    directory `llada21/` under --public (`--dllm-repo` does the export from a clone or a bare
    mirror, with `git show`, and records the commit).

Rerun it, from the repository root, with:

  python3 -m venv /tmp/side-llada21/venv
  /tmp/side-llada21/venv/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors
  /tmp/side-llada21/venv/bin/python tests/data/make_llada21.py \\
      --dllm-repo PATH/TO/dllm --public /tmp/side-llada21/pub --out tests/data/llada21

It writes into --out:

  config.json, generation_config.json, model.safetensors
      the tiny model, written by the public code's `save_pretrained(safe_serialization=True)`;
      config.json's model_type is then renamed from the dllm port's "llada21_moe" to "llada2_moe"
      (the name dlmrt knows, and which the published LLaDA2.x checkpoints use; dllm renamed it
      only to register its own Auto classes): nothing else in the file is touched.
  expected.json
      per case: prompt, gen_length, block_length, threshold, editing_threshold, max_post_steps,
      tokens (the public generate's output as returned: after the prompt, up to and including
      the first EOS), tokens_editing_off (the same call with editing_threshold=1.0, which no
      probability exceeds), and, counted by watching the model's inputs (never by a copy of the
      decoding loop): forwards (model calls), edits (a committed token replaced by another, in
      the whole canvas) and edits_in_output (those at positions the output covers).
  expected_logits.safetensors
      the public model's float32 logits for one 12-token input (input_ids, positions 0..11, and
      the block-causal mask for block_length 4 built exactly as generate builds it).

The public generate builds its block mask in bfloat16, which torch's SDPA refuses next to float32
queries, so the model runs with attn_implementation="eager" (the mask's 0/-inf values are exact
in bfloat16, so this changes no number).

After writing, unless --no-check, it runs dlmrt's own interpreter (--dlmrt-python, by default
.venv/bin/python beside this repository) to load the checkpoint with dlmrt.load and compare
dlmrt's logits with the recorded ones.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import torch

PUBLIC_FILES = ("modeling_llada21_moe.py", "configuration_llada21_moe.py")
PUBLIC_DIR = "dllm/pipelines/llada21/models"
KNOWN_COMMIT = "ca176752fbceec49c6b4777a2c18ae88e4eb10ed"

MASK_ID, EOS_ID, PAD_ID = 63, 60, 61
BLOCK = 4
SEED = 0
INIT_STD = 0.05  # every matrix and the embedding; large enough that the tiny model is sometimes confident
HEAD_STD = 0.4  # the output projection: spreads the logits so that low thresholds commit and edit
EOS_HEAD_SCALE = 3.0  # the EOS row of the output projection, scaled so that a few cases end at an EOS

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, first_k_dense_replace=1, num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=16, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    partial_rotary_factor=0.5, use_qk_norm=True, use_qkv_bias=False, use_bias=False, rope_theta=600000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=128, initializer_range=INIT_STD,
    pad_token_id=PAD_ID, eos_token_id=EOS_ID, mask_token_id=MASK_ID,
)

# Prompts (ids in [0, 56)) and generation lengths: aligned to the block (4) and not (6, 3).
PROMPTS = (([17, 5, 42, 30], 12), ([9, 51, 3, 28, 44, 12], 10), ([33, 0, 21], 12))
# (threshold, editing_threshold): 1.0 turns editing off (a probability never exceeds 1).
THRESHOLDS = ((0.95, 0.9), (0.7, 0.5), (0.5, 1.0), (0.3, 0.2), (0.2, 0.05))
MAX_POST_STEPS = (16, 2, 0)

# The logits input: a prompt of 6 and a partly unmasked canvas, as in the middle of a decode.
LOGITS_IDS = [9, 51, 3, 28, 44, 12, 7, MASK_ID, MASK_ID, 40, MASK_ID, MASK_ID]

OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "expected.json",
                "expected_logits.safetensors")


def export_public(repo: Path, public: Path) -> str:
    """Write the two public files into public/llada21 (a package), from a git clone or mirror."""
    package = public / "llada21"
    package.mkdir(parents=True, exist_ok=True)
    for name in PUBLIC_FILES:
        text = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{PUBLIC_DIR}/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (package / name).write_text(text)
    (package / "__init__.py").write_text("")
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    (package / "DLLM_COMMIT").write_text(commit + "\n")
    return commit


def build_model(config_class, model_class):
    torch.manual_seed(SEED)
    config = config_class(**CONFIG, attn_implementation="eager")
    model = model_class(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, HEAD_STD, generator=generator)
        # A zero row gives the mask token logit 0 everywhere: (almost surely) never the argmax, so the
        # public generate, which could commit the mask token, never does (dlmrt never commits it).
        model.lm_head.weight[MASK_ID] = 0.0
        model.lm_head.weight[EOS_ID] *= EOS_HEAD_SCALE
        norms = 0
        for module in model.modules():
            if type(module).__name__ == "LLaDA2MoeRMSNorm":  # away from their init of ones
                module.weight.copy_(torch.empty_like(module.weight).uniform_(0.5, 1.5, generator=generator))
                norms += 1
        gates = 0
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # away from its init of zeros: it changes which experts are chosen
                gate.expert_bias.copy_(torch.randn(gate.expert_bias.shape, generator=generator) * 0.2)
                gates += 1
    assert norms == 2 * CONFIG["num_hidden_layers"] * 2 + 1, norms  # input/post per layer, q/k per layer, final
    assert gates == CONFIG["num_hidden_layers"] - CONFIG["first_k_dense_replace"], gates
    return model


def block_mask(length: int) -> torch.Tensor:
    """The block-causal additive mask `[1, 1, T, T]`, built as the public generate builds it."""
    blocks = length // BLOCK
    tril = torch.tril(torch.ones(blocks, blocks))
    return (tril.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
            .unsqueeze(0).unsqueeze(0).log().to(torch.bfloat16))


class InputWatcher:
    """Records the canvas each model call sees (the public generate calls `self.forward`, which
    calls `self.model`, so a hook on `model.model` sees every step), to count edits afterwards."""

    def __init__(self, model):
        self.snapshots: list[torch.Tensor] = []
        self.canvas: torch.Tensor | None = None
        self.handle = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.snapshots.append(ids[0].clone())
        self.canvas = ids._base if ids._base is not None else ids  # generate's x: cur_x is a view of it

    def reset(self):
        self.snapshots, self.canvas = [], None

    def edits(self, prompt_length: int, output_end: int) -> tuple[int, int]:
        """(all edits, edits at positions < output_end): a non-mask token replaced by another.
        Also checks that prompt tokens and tokens of finished blocks never change."""
        states = self.snapshots + [self.canvas[0, :self.snapshots[-1].shape[0]].clone()]
        total = in_output = 0
        for before, after in zip(states, states[1:]):
            after = after[:before.shape[0]]
            changed = (before != after)
            edited = changed & (before != MASK_ID)
            assert not changed[:prompt_length].any(), "a prompt token changed"
            block_start = (before.shape[0] - 1) // BLOCK * BLOCK
            assert not changed[:block_start].any(), "a token outside the current block changed"
            total += int(edited.sum())
            in_output += int(edited[:output_end].sum())
        return total, in_output


def generate(model, prompt, gen_length, threshold, editing_threshold, max_post_steps):
    out = model.generate(torch.tensor([prompt]), temperature=0.0, block_length=BLOCK, gen_length=gen_length,
                         threshold=threshold, editing_threshold=editing_threshold,
                         max_post_steps=max_post_steps, eos_id=EOS_ID, mask_id=MASK_ID, num_to_transfer=1)
    tokens = out[0].tolist()
    assert MASK_ID not in tokens, f"the public generate committed the mask token: {tokens}"
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--public", type=Path, required=True,
                        help="directory holding the exported public package llada21/")
    parser.add_argument("--dllm-repo", type=Path,
                        help="a dllm git clone or mirror: export the public files from its HEAD into --public")
    parser.add_argument("--out", type=Path, default=Path("tests/data/llada21"))
    parser.add_argument("--dlmrt-python", type=Path,
                        default=Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python")
    parser.add_argument("--no-check", action="store_true", help="skip the dlmrt load-and-compare check")
    args = parser.parse_args()

    commit = export_public(args.dllm_repo, args.public) if args.dllm_repo else None
    commit_file = args.public / "llada21" / "DLLM_COMMIT"
    if commit is None:
        commit = commit_file.read_text().strip() if commit_file.is_file() else f"{KNOWN_COMMIT} (assumed)"
    sys.path.insert(0, str(args.public.resolve()))
    configuration = importlib.import_module("llada21.configuration_llada21_moe")
    modeling = importlib.import_module("llada21.modeling_llada21_moe")
    import safetensors
    import transformers
    from safetensors.torch import save_file

    model = build_model(configuration.LLaDA2MoeConfig, modeling.LLaDA2MoeModelLM)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    for key, value in (("mask_token_id", MASK_ID), ("eos_token_id", EOS_ID), ("pad_token_id", PAD_ID)):
        assert config.get(key) == value, (key, config.get(key))
    assert config["model_type"] == "llada21_moe", config["model_type"]
    config["model_type"] = "llada2_moe"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    watcher = InputWatcher(model)
    cases = []
    for prompt, gen_length in PROMPTS:
        for threshold, editing_threshold in THRESHOLDS:
            for max_post_steps in MAX_POST_STEPS:
                watcher.reset()
                tokens = generate(model, prompt, gen_length, threshold, editing_threshold, max_post_steps)
                forwards = len(watcher.snapshots)
                edits, edits_in_output = watcher.edits(len(prompt), len(prompt) + len(tokens))
                watcher.reset()
                off = generate(model, prompt, gen_length, threshold, 1.0, max_post_steps)
                assert watcher.edits(len(prompt), len(prompt) + len(off)) == (0, 0)
                cases.append(dict(prompt=prompt, gen_length=gen_length, block_length=BLOCK, threshold=threshold,
                                  editing_threshold=editing_threshold, max_post_steps=max_post_steps,
                                  tokens=tokens, tokens_editing_off=off, forwards=forwards, edits=edits,
                                  edits_in_output=edits_in_output))
    watcher.handle.remove()

    ids = torch.tensor([LOGITS_IDS])
    positions = torch.arange(len(LOGITS_IDS))[None]
    with torch.no_grad():
        logits = model(ids, attention_mask=block_mask(len(LOGITS_IDS)), position_ids=positions).logits
    save_file({"input_ids": ids.contiguous(), "positions": positions.contiguous(),
               "logits": logits.float().contiguous()}, str(out / "expected_logits.safetensors"),
              metadata={"block_length": str(BLOCK)})

    changed = sum(c["tokens"] != c["tokens_editing_off"] for c in cases)
    expected = {
        "about": "tokens from the public LLaDA2.1 generate (dllm, modeling_llada21_moe.py) on the tiny model "
                 "in this directory; made by tests/data/make_llada21.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "dllm_commit": commit},
        "generate_fixed": {"temperature": 0.0, "eos_id": EOS_ID, "mask_id": MASK_ID, "num_to_transfer": 1,
                           "attn_implementation": "eager", "dtype": "float32"},
        "mask_id": MASK_ID, "eos_id": EOS_ID, "pad_id": PAD_ID,
        "logits_file": "expected_logits.safetensors",
        "cases_where_editing_changed_tokens": changed,
        "cases_ending_at_eos": sum(EOS_ID in c["tokens"] or EOS_ID in c["tokens_editing_off"] for c in cases),
        "cases": cases,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{len(cases)} cases, {changed} where editing changed the tokens, "
          f"{sum(c['edits'] > 0 for c in cases)} with edits, {expected['cases_ending_at_eos']} ending at an EOS")
    for name in OUTPUT_FILES:
        print(f"  {out / name}: {(out / name).stat().st_size} bytes")

    if not args.no_check:
        check = (
            "import sys, torch, dlmrt\n"
            "from safetensors.torch import load_file\n"
            "m = dlmrt.load(sys.argv[1])\n"
            "r = load_file(sys.argv[1] + '/expected_logits.safetensors')\n"
            "got = m.denoise(r['input_ids'], positions=r['positions'], block_length=4).logits\n"
            "print('dlmrt logits max abs diff', float((got - r['logits']).abs().max()))\n"
        )
        subprocess.run([str(args.dlmrt_python), "-c", check, str(out)], check=True)


if __name__ == "__main__":
    main()
