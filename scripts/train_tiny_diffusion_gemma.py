"""Train a tiny DiffusionGemma-shaped model (uniform-noise block diffusion) on the synthetic task suite.

    python scripts/train_tiny_diffusion_gemma.py                       # -> dlmrt/assets/tiny-diffusion-gemma
    python scripts/train_tiny_diffusion_gemma.py --steps 200 --out /tmp/dg   # a quick one

The shape keeps every architectural feature of the family at toy size: sliding-window layers and a
full-attention last layer with its own head size and K/V heads (per_layer_config, no v_proj,
proportional rotary over a quarter of its frequencies), a dense gated-GELU MLP beside a routed MoE,
the self-conditioning MLP, tied embeddings and logits soft-capped at 30. The sliding window (8) is
shorter than the longest prompt (14 tokens), so that it binds in both the encoder and the decoder.

The objective, uniform-noise diffusion with self-conditioning, as DiffusionGemma is trained:

- each row is a prompt and a canvas of GEN_LENGTH (16) target tokens: the answer, then EOS, then
  PAD to the end (after the first EOS everything is padding, as decoded output is post-processed).
  The prompts are left-padded; the causal encoder runs over them (`model.encode`, with the key mask,
  positions counting each row's own tokens from 0) and writes the K/V cache;
- each row draws t ~ U(0, 1); each canvas position independently becomes a token drawn uniformly
  from the whole vocabulary with probability t (there is no mask token). The canvas positions
  continue the row's prompt (prompt length + 0..15);
- self-conditioning: for half the batches (one coin per batch), the decoder first runs without it
  under no_grad, and the trained pass gets `model.soft_tokens(first_logits / T)` with T = 1; the
  other half train the first step, with no signal;
- the loss is the mean cross-entropy of the decoder's logits over all 16 canvas positions against
  the clean targets. The encoder and the decoder share their weights; the encoder's part gets
  gradients through the cache that the decoder reads.

AdamW with linear warmup and a cosine decay, everything seeded. The default run (1,600 steps of 64
rows) took 8.7 minutes on one thread of a 2-core machine that other processes shared; two threads
there made steps 10-50x slower whenever the other core was busy, hence --threads 1.

At the end the script measures training diagnostics on the held-out split, with no decoding loop:
one decoder pass (no self-conditioning) from a canvas noised at t = 1 (all random) and at t = 0.5,
argmax, scored per task as token accuracy (over the 16 positions, and over the answer and its EOS)
and as exact match (the task's verifier on the text before the first EOS). They are not the
decoding result: a runtime loop decodes the model. They go into training_report.json beside the
checkpoint, with the tokenizer and a generation_config.json holding the family's decoding defaults.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from dlmrt.core import tasks
from dlmrt.core.errors import DlmrtError
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.runtime import text

sys.path.insert(0, str(Path(__file__).parent))
from tiny_training import parse_task_names, train_steps  # noqa: E402

GEN_LENGTH = 16
SLIDING, FULL = "sliding_attention", "full_attention"
NOISE_LEVELS = (1.0, 0.5)
# DiffusionGemma's decoding defaults (the public generation config), beside this model's special ids.
DECODING_DEFAULTS = {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "sampler_config": {"entropy_bound": 0.1},
                     "stability_threshold": 1, "confidence_threshold": 0.005}


def model_config(args) -> dict:
    vocab = len(tasks.SPECIAL_TOKENS) + len(tasks.ALPHABET)
    layer_types = [SLIDING] * (args.layers - 1) + [FULL]
    text_config = {
        "model_type": "diffusion_gemma_text", "vocab_size": vocab, "hidden_size": args.hidden,
        "intermediate_size": args.mlp, "num_hidden_layers": args.layers, "layer_types": layer_types,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "per_layer_config": {str(i): {"head_dim": args.full_head_dim, "num_key_value_heads": args.full_kv_heads}
                             for i, kind in enumerate(layer_types) if kind == FULL},
        "num_experts": args.experts, "top_k_experts": args.top_k, "moe_intermediate_size": args.expert_mlp,
        "sliding_window": args.sliding_window, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "attention_dropout": 0.0, "use_bidirectional_attention": None, "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}},
        "pad_token_id": tasks.PAD_ID, "eos_token_id": tasks.EOS_ID, "bos_token_id": None,
    }
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "canvas_length": GEN_LENGTH, "tie_word_embeddings": True, "initializer_range": 0.02,
            "text_config": text_config}


def encode_examples(tokenizer, examples: list[tasks.Example]):
    """Left-padded prompts (ids, key mask, positions from 0 per row, lengths) and the clean canvases."""
    prompts = [tokenizer.encode(e.prompt).ids for e in examples]
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(examples), width), tasks.PAD_ID, dtype=torch.long)
    targets = torch.full((len(examples), GEN_LENGTH), tasks.PAD_ID, dtype=torch.long)
    for row, (prompt, example) in enumerate(zip(prompts, examples)):
        answer = tokenizer.encode(example.answer).ids + [tasks.EOS_ID]
        prompt_ids[row, width - len(prompt):] = torch.tensor(prompt)
        targets[row, :len(answer)] = torch.tensor(answer)
    prompt_mask = prompt_ids != tasks.PAD_ID  # no prompt holds the pad token
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    return prompt_ids, prompt_mask, prompt_positions, prompt_mask.sum(-1), targets


def add_noise(targets: torch.Tensor, t: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Each position replaced, with its row's probability t [B, 1], by a token uniform over the vocabulary."""
    noised = torch.rand(targets.shape, generator=generator) < t
    random_tokens = torch.randint(0, vocab, targets.shape, generator=generator)
    return torch.where(noised, random_tokens, targets)


def decoder_logits(model, prompt, canvas: torch.Tensor, self_condition: bool) -> torch.Tensor:
    """Encode the prompt, then the decoder's logits over `canvas` (after a first no_grad pass whose
    soft tokens condition it, when `self_condition`)."""
    prompt_ids, prompt_mask, prompt_positions, lengths, _ = prompt
    cache = model.encode(prompt_ids, positions=prompt_positions, key_mask=prompt_mask)
    positions = lengths[:, None] + torch.arange(GEN_LENGTH)
    key_mask = torch.cat((prompt_mask, torch.ones_like(canvas, dtype=torch.bool)), dim=1)
    kwargs = {"positions": positions, "key_mask": key_mask, "past": cache}
    residual = None
    if self_condition:
        with torch.no_grad():
            first = model.denoise(canvas, **kwargs).logits
            residual = model.soft_tokens(first / 1.0)  # temperature 1
    return model.denoise(canvas, **kwargs, residual=residual).logits


def train(args) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = tasks.build_tokenizer()
    # No special tokens at creation: a uniform-noise model has no mask id, and the ids live in
    # text_config and generation_config.json (the loader reads them from there).
    model = models.create(model_config(args), seed=args.seed).train()
    model.requires_grad_(True)
    parameters = sum(p.numel() for p in model.parameters())

    def denoising_loss() -> torch.Tensor:
        rows = [tasks.sample(rng.choice(args.tasks), "train", rng) for _ in range(args.batch_size)]
        prompt = encode_examples(tokenizer, rows)
        targets = prompt[-1]
        t = torch.rand(args.batch_size, 1, generator=generator)
        canvas = add_noise(targets, t, model.vocab_size, generator)
        self_condition = torch.rand((), generator=generator).item() < args.self_conditioning
        logits = decoder_logits(model, prompt, canvas, self_condition)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    smoothed, train_seconds = train_steps(model, denoising_loss, args.steps, args.lr, args.weight_decay)
    model.eval().requires_grad_(False)
    model.tokenizer = tokenizer
    # The task suite's answers fit one canvas of 16, which is also what generate should ask by default.
    model.generation_config = {"pad_token_id": tasks.PAD_ID, "eos_token_id": [tasks.EOS_ID],
                               "gen_length": GEN_LENGTH, "trained_gen_length": GEN_LENGTH, "block_length": 16,
                               **DECODING_DEFAULTS}
    return {"model": model, "parameters": parameters, "train_seconds": train_seconds, "final_loss": smoothed}


@torch.no_grad()
def denoising_accuracy(model, per_task: int, t: float, seed: int, batch_size: int = 200) -> dict[str, dict]:
    """Per task: token accuracy (over the whole canvas, and over the answer and its EOS) and exact match
    of one decoder pass, argmax, from the clean canvas noised at `t` (a training diagnostic, not
    decoding). For `same`, the token accuracies compare with one right answer of several."""
    held_out = tasks.examples("test", per_task, seed=1234)
    generator = torch.Generator().manual_seed(seed)
    counts = {task: dict.fromkeys(("tokens", "answer_tokens", "answer_length", "right", "rows"), 0)
              for task in tasks.TASKS}
    for start in range(0, len(held_out), batch_size):
        batch = held_out[start:start + batch_size]
        prompt = encode_examples(model.tokenizer, batch)
        targets = prompt[-1]
        canvas = add_noise(targets, torch.full((len(batch), 1), t), model.vocab_size, generator)
        predicted = decoder_logits(model, prompt, canvas, self_condition=False).argmax(-1)
        for example, row, target in zip(batch, predicted.tolist(), targets.tolist()):
            count = counts[example.task]
            answer = target.index(tasks.EOS_ID) + 1  # the answer and its EOS
            count["rows"] += 1
            count["tokens"] += sum(p == q for p, q in zip(row, target))
            count["answer_tokens"] += sum(p == q for p, q in zip(row[:answer], target[:answer]))
            count["answer_length"] += answer
            count["right"] += tasks.is_correct(example, text.decode(model, text.completion(row, (tasks.EOS_ID,))))
    scores = {task: {"token_accuracy": c["tokens"] / (GEN_LENGTH * c["rows"]),
                     "answer_token_accuracy": c["answer_tokens"] / c["answer_length"],
                     "exact_match": c["right"] / c["rows"]} for task, c in counts.items() if c["rows"]}
    scores["mean"] = {key: sum(s[key] for s in scores.values()) / len(scores) for key in next(iter(scores.values()))}
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("dlmrt/assets/tiny-diffusion-gemma"))
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="the last is full attention, the others sliding")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="of the sliding layers")
    parser.add_argument("--head-dim", type=int, default=16, help="of the sliding layers")
    parser.add_argument("--full-kv-heads", type=int, default=1)
    parser.add_argument("--full-head-dim", type=int, default=32)
    parser.add_argument("--mlp", type=int, default=128, help="the dense MLP's (and self-conditioning's) width")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-mlp", type=int, default=32, help="each expert's width")
    parser.add_argument("--sliding-window", type=int, default=8)
    parser.add_argument("--self-conditioning", type=float, default=0.5,
                        help="share of batches trained on a first pass's soft tokens")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-per-task", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1,
                        help="1 by default: two threads on 2 shared cores slowed steps 10-50x here")
    parser.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated task names to train on")
    args = parser.parse_args()
    args.tasks = parse_task_names(parser, args.tasks)
    try:
        tasks.check_canvas(args.tasks, GEN_LENGTH)
    except DlmrtError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)

    result = train(args)
    model = result["model"]
    shape = ("hidden", "layers", "heads", "kv_heads", "head_dim", "full_kv_heads", "full_head_dim", "mlp", "experts",
             "top_k", "expert_mlp", "sliding_window")
    report = {
        "parameters": result["parameters"], "train_seconds": round(result["train_seconds"], 1),
        "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
        "config": {**{k: getattr(args, k) for k in (*shape, "self_conditioning", "lr", "weight_decay")},
                   "tasks": list(args.tasks)},
        "final_loss": round(result["final_loss"], 4),
        "denoising_accuracy_note": "one decoder pass from the held-out canvas noised at t, argmax, no "
                                   "self-conditioning: a training diagnostic, not the decoding result",
        "denoising_accuracy": {},
    }
    for t in NOISE_LEVELS:
        report["denoising_accuracy"][f"t={t}"] = denoising_accuracy(model, args.eval_per_task, t, args.seed)
    report_file = (json.dumps(report, indent=2) + "\n").encode()
    checkpoint.save(model, args.out, extra_files={"training_report.json": report_file})

    table = Table(title=f"tiny DiffusionGemma: {report['parameters']:,} parameters, "
                        f"{report['train_seconds'] / 60:.1f} min of training, loss {report['final_loss']:.3f}")
    table.add_column("one pass, argmax: answer token accuracy / exact match")
    for task in (*tasks.TASKS, "mean"):
        table.add_column(task, justify="right")
    for name, scores in report["denoising_accuracy"].items():
        table.add_row(name, *(f"{scores[t]['answer_token_accuracy']:.1%} / {scores[t]['exact_match']:.1%}"
                              for t in (*tasks.TASKS, "mean")))
    Console().print(table)


if __name__ == "__main__":
    main()
