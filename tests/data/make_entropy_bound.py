"""Make tests/data/entropy_bound: what the public DiffusionGemma generation code computes on crafted inputs.

Dev-only. It runs the public classes of transformers' models/diffusion_gemma/generation_diffusion_gemma.py
(transformers 5.x) in a side environment that has torch, transformers and safetensors; dlmrt itself is
not used, and no model is loaded. The outputs are committed, so the tests need neither. Nothing here
draws random numbers inside the public code: every input is fixed by this script (from seeded
generators) and the public code only computes on it.

Writes into tests/data/entropy_bound/:
- expected.json, with the versions used and:
  - `schedules`: the temperature of each step of LinearTemperatureScheduleLogitsProcessor for a few
    (t_min, t_max, N), the defaults (0.4, 0.8, 48) among them, in step order (steps remaining N..1):
    `generate` as the public generate loop computes it (cur_step an int32 tensor, so float32 on the
    CPU), and for the defaults `python_floats` as a call with a Python int cur_step computes it
    (float64);
  - `accept`: EntropyBoundSampler.accept_canvas on fixed current and denoiser canvases, for logits
    scaled by the public processor at a given cur_step: the accepted mask and canvas, and the
    public entropies (8 significant digits). Every case is checked to have no two entropies of a row within 1e-5 (the
    public sort is not stable) and no bound within 1e-4 of a sum of the smallest entropies;
  - `stopping`: StableAndConfidentStoppingCriteria over a sequence of argmax canvases and logits,
    for stability thresholds 0 to 3, and the public mean entropies;
  - `finalize`: DiffusionGemmaGenerationMixin._finalize_canvas (as a staticmethod, with an EOS
    stopping criterion and a small generation config) on crafted canvases behind a prompt;
- logits.safetensors: the raw logits of each accept case (`accept.<name>`, before the temperature)
  and the stopping sequence (`stopping.argmax` [T, B, W], `stopping.logits` [T, B, W, V]).

Setup and command (from the repository root):

    python3 -m venv /tmp/side-dg
    /tmp/side-dg/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/side-dg/bin/pip install transformers==5.17.0 safetensors
    /tmp/side-dg/bin/python tests/data/make_entropy_bound.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "entropy_bound"
SCHEDULES = ((0.4, 0.8, 48), (0.1, 1.0, 7), (0.25, 1.5, 16), (0.3, 0.7, 1), (0.0, 1.0, 10), (0.2, 0.9, 25))
# name, (B, W, V), entropy bound, (t_min, t_max, N, cur_step), logit scale range per row, -inf entries
ACCEPT_CASES = (
    ("defaults_first_step", (3, 8, 11), 0.1, (0.4, 0.8, 48, 48), ((3.0, 9.0), (0.5, 4.0), (6.0, 12.0)), False),
    ("defaults_last_step", (3, 8, 11), 0.1, (0.4, 0.8, 48, 1), ((1.0, 5.0), (0.3, 2.0), (2.0, 6.0)), False),
    ("wide_bound", (2, 6, 9), 2.5, (0.1, 1.0, 7, 4), ((0.5, 3.0), (2.0, 8.0)), False),
    ("all_accepted", (2, 5, 6), 1000.0, (0.25, 1.5, 16, 9), ((0.2, 2.0), (1.0, 6.0)), False),
    ("one_each", (3, 7, 10), 1e-3, (0.4, 0.8, 48, 20), ((0.2, 1.5), (0.5, 2.0), (0.1, 1.0)), False),
    ("impossible_tokens", (2, 6, 8), 0.5, (0.4, 0.8, 48, 30), ((1.0, 6.0), (0.5, 3.0)), True),
)
STOP_THRESHOLDS = (0, 1, 2, 3)
CONFIDENCE = 0.005
EOS, PAD = [9, 10], 11


class _Divisor:
    """Stands in for the scores: `scores / temperature` then returns the processor's temperature itself."""

    def __truediv__(self, other):
        return other


def short(values):
    """Nested lists of the values to 8 significant digits (the tests compare them with a tolerance)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, list):
        return [short(v) for v in values]
    return float(f"{values:.8g}")


def schedules(public):
    out = []
    for t_min, t_max, n in SCHEDULES:
        processor = public.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
        generate, python_floats = [], []
        for cur_step in range(n, 0, -1):
            t = processor(None, _Divisor(), cur_step=torch.tensor(cur_step, dtype=torch.int32))
            assert t.dtype == torch.float32 and t.dim() == 0
            generate.append(float(t))
            python_floats.append(processor(None, _Divisor(), cur_step=cur_step))
        case = {"t_min": t_min, "t_max": t_max, "steps": n, "generate": generate}
        if (t_min, t_max, n) == SCHEDULES[0]:
            case["python_floats"] = python_floats
        out.append(case)
    return out


def crafted_logits(shape, scales, impossible, generator):
    b, w, v = shape
    rows = []
    for lo, hi in scales:
        scale = lo + (hi - lo) * torch.rand(w, 1, generator=generator)
        rows.append(torch.randn(w, v, generator=generator) * scale)
    logits = torch.stack(rows)
    if impossible:
        logits[0, 1, 1:] = float("-inf")  # one possible token: entropy 0
        logits[0, 3, :v // 2] = float("-inf")
        logits[1, 2, ::2] = float("-inf")
    return logits


def well_separated(entropies, bound):
    for row in entropies.double().tolist():
        ranked = sorted(row)
        if min(b - a for a, b in zip(ranked, ranked[1:])) <= 1e-5:
            return False
        before = 0.0
        for e in ranked:
            if abs(before - bound) <= 1e-4:
                return False
            before += e
    return True


def accept_cases(public):
    cases, tensors = [], {}
    for index, (name, shape, bound, (t_min, t_max, n, cur_step), scales, impossible) in enumerate(ACCEPT_CASES):
        b, w, v = shape
        processor = public.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
        generator = torch.Generator().manual_seed(1000 + index)
        for _ in range(1000):
            logits = crafted_logits(shape, scales, impossible, generator)
            scaled = processor(None, logits, cur_step=torch.tensor(cur_step, dtype=torch.int32))
            entropies = torch.distributions.Categorical(logits=scaled).entropy()
            if well_separated(entropies, bound):
                break
        else:
            raise RuntimeError(f"no well separated logits for {name}")
        # every position differs between the two canvases, so the accepted canvas shows the mask
        current = torch.arange(b * w).reshape(b, w) % v
        denoiser = (current + 1 + torch.arange(w) % (v - 1)) % v
        assert (current != denoiser).all()
        sampler = public.EntropyBoundSampler(config=public.EntropyBoundSamplerConfig(entropy_bound=bound),
                                             canvas_length=w, vocab_size=v, max_denoising_steps=n)
        accepted = sampler.accept_canvas(current.clone(), denoiser.clone(), scaled.clone(), cur_step)
        mask = sampler.accepted_token_mask
        tensors[f"accept.{name}"] = logits.contiguous()
        cases.append({"name": name, "entropy_bound": bound, "t_min": t_min, "t_max": t_max, "steps": n,
                      "cur_step": cur_step, "current_canvas": current.tolist(), "denoiser_canvas": denoiser.tolist(),
                      "accepted_mask": mask.tolist(), "accepted_canvas": accepted.tolist(),
                      "accepted_per_row": mask.sum(-1).tolist(), "entropy": short(entropies)})
    return cases, tensors


def stopping(public):
    t_steps, b, w, v = 6, 3, 4, 6
    first, second, third = [1, 2, 3, 4], [5, 0, 2, 2], [5, 0, 2, 3]
    argmax = torch.tensor([
        [first, first, first, first, first, first],  # never changes
        [first, second, second, second, third, third],  # changes after steps 0 and 3
        [first, second, first, second, first, second],  # changes every step
    ]).transpose(0, 1).contiguous()  # [T, B, W]
    generator = torch.Generator().manual_seed(7)
    flat = torch.randn(t_steps, b, w, v, generator=generator)
    sharp = torch.full((t_steps, b, w, v), 0.0).scatter(-1, argmax[..., None], 25.0)
    confident = torch.tensor([[False, True, True], [False, True, True], [True, True, True],
                              [True, True, True], [True, False, True], [True, True, True]])  # [T, B]
    logits = torch.where(confident[..., None, None], sharp, flat).contiguous()
    out = {"confidence_threshold": CONFIDENCE, "steps": t_steps, "stop": {}}
    for threshold in STOP_THRESHOLDS:
        criteria = public.StableAndConfidentStoppingCriteria(stability_threshold=threshold,
                                                             confidence_threshold=CONFIDENCE)
        out["stop"][str(threshold)] = [criteria(argmax[t].clone(), logits[t].clone()).tolist() for t in range(t_steps)]
    entropies = torch.distributions.Categorical(logits=logits).entropy().mean(-1)
    assert ((entropies < CONFIDENCE) == confident).all()
    assert ((entropies - CONFIDENCE).abs() > 1e-3).all()
    out["mean_entropy"] = short(entropies)
    return out, {"stopping.argmax": argmax, "stopping.logits": logits}


def finalize(public, stopping_criteria_list, eos_criteria):
    prompt = [7, 9, 8]  # an EOS in the prompt, which no rule touches
    cases = []
    crafted = (
        ("mixed", EOS, [
            ([1, 2, 3, 4, 5, 6], False),  # no EOS
            ([9, 2, 3, 4, 5, 6], False),  # EOS first
            ([1, 10, 3, 9, 5, 6], False),  # two EOS
            ([1, 2, 3, 4, 5, 6], True),  # finished in an earlier canvas
            ([1, 9, 3, 4, 5, 6], True),  # finished earlier, with an EOS
            ([1, 2, 3, 4, 5, 10], False),  # EOS last
            ([9, 9, 3, 9, 5, 6], False),  # the same EOS thrice
        ]),
        ("none_finished", EOS, [([1, 2, 3, 4, 5, 6], False), ([6, 5, 4, 3, 2, 1], False)]),
        ("one_eos_id", 9, [([1, 10, 3, 9, 5, 9], False), ([10, 2, 3, 4, 5, 6], True), ([4, 4, 4, 4, 4, 4], False)]),
    )
    for name, eos, rows in crafted:
        canvas = torch.tensor([tokens for tokens, _ in rows])
        finished = torch.tensor([done for _, done in rows])
        input_ids = torch.cat([torch.tensor([prompt] * len(rows)), canvas], dim=-1)
        config = public.DiffusionGemmaGenerationConfig(pad_token_id=PAD, eos_token_id=eos)
        criteria = stopping_criteria_list([eos_criteria(eos_token_id=eos)])
        out_ids, out_finished = public.DiffusionGemmaGenerationMixin._finalize_canvas(
            input_ids=input_ids.clone(), finished_sequences=finished.clone(), generation_config=config,
            stopping_criteria=criteria, canvas_length=canvas.shape[1], eos_tensor=torch.tensor(eos))
        cases.append({"name": name, "eos_token_id": eos, "pad_token_id": PAD, "prompt": prompt,
                      "canvas": canvas.tolist(), "finished_before": finished.tolist(),
                      "output_ids": out_ids.tolist(), "finished": out_finished.tolist()})
    return cases


def main() -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers.generation import EosTokenCriteria, StoppingCriteriaList
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as public

    torch.use_deterministic_algorithms(True)
    accept, tensors = accept_cases(public)
    stop, stop_tensors = stopping(public)
    tensors.update(stop_tensors)
    expected = {
        "what": "outputs of the public DiffusionGemma generation classes (transformers "
                "models/diffusion_gemma/generation_diffusion_gemma.py) on crafted inputs, made by "
                "tests/data/make_entropy_bound.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "schedules": schedules(public),
        "accept": accept,
        "stopping": stop,
        "finalize": finalize(public, StoppingCriteriaList, EosTokenCriteria),
    }
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    save_file(tensors, str(OUT / "logits.safetensors"))
    (OUT / "expected.json").write_text(json.dumps(expected, separators=(",", ":")) + "\n")
    counts = {case["name"]: case["accepted_per_row"] for case in accept}
    print(f"wrote {OUT}: accepted per row {counts}")


if __name__ == "__main__":
    main()
