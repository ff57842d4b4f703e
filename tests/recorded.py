"""The public code's recorded generates (tests/data/<family>/expected.json, written by make_<family>.py)
as dlmrt settings and the tokens dlmrt must return: one reader per family, shared by the family's own
tests and the parity matrix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dlmrt.runtime import Dream, GenerationSettings, LLaDA2, LLaDA21

DATA = Path(__file__).parent / "data"
LLADA21 = json.loads((DATA / "llada21" / "expected.json").read_text())
DREAM = json.loads((DATA / "dream" / "expected.json").read_text())
SDAR = json.loads((DATA / "sdar" / "expected.json").read_text())
# Dream's algorithms and the confidence measures they are in dlmrt
DREAM_ALGORITHMS = {"maskgit_plus": "prob", "topk_margin": "margin", "entropy": "entropy"}


@dataclass(frozen=True)
class Recorded:
    """One recorded generate of one prompt."""

    prompt: list[int]
    settings: GenerationSettings
    tokens: list[int]  # what dlmrt returns for the row: its completion, or all gen_length ids with ignore_eos
    name: str

    def found(self, result) -> list[int]:
        return result.tokens[0].tolist() if self.settings.ignore_eos else result.rows[0].token_ids


def until_eos(tokens: list[int], eos: int = LLADA21["eos_id"]) -> list[int]:
    """The public generate returns its output up to and including the first EOS; dlmrt's completion excludes it."""
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def llada21_name(case: dict) -> str:
    return (f"p{len(case['prompt'])}-g{case['gen_length']}-t{case['threshold']}-e{case['editing_threshold']}"
            f"-m{case['max_post_steps']}")


def llada21_settings(case: dict, *, editing: bool = True, **extra) -> GenerationSettings:
    policy = LLaDA21(case["threshold"], case["editing_threshold"] if editing else 1.0, case["max_post_steps"])
    return GenerationSettings(case["gen_length"], case["block_length"], policy, **extra)


def dream_name(case: dict) -> str:
    return f"p{len(case['prompt'])}-g{case['gen_length']}-s{case['steps']}-{case['alg']}"


def dream_settings(case: dict, **extra) -> GenerationSettings:
    policy = Dream(case["steps"], DREAM["settings"]["eps"], DREAM_ALGORITHMS[case["alg"]])
    return GenerationSettings(case["gen_length"], case["gen_length"], policy, ignore_eos=True, **extra)


def sdar_settings(case: dict, **extra) -> GenerationSettings:
    """The public generate's rule per step (n_k from the schedule over the block length; every masked
    position with p > threshold if at least n_k, else the n_k most confident) is dlmrt's `llada2`
    policy; its low_confidence_static strategy is that rule with no threshold (1.0: nothing is above)."""
    policy = LLaDA2(threshold=case["confidence_threshold"] or 1.0, steps=case["steps_per_block"])
    return GenerationSettings(case["gen_length"], 4, policy, ignore_eos=True, **extra)


def recorded(family: str, policy: str, cache: str) -> list[Recorded]:
    """The generates recorded for a family's checkpoint in tests/data under `policy` and `cache`; the
    public code has no cache, so a cache mode that is exact for the family reuses its records (the
    dual cache is not exact, and DiffusionGemma's records are logits, not generates)."""
    if family == "llada2_moe" and policy == "llada21" and cache in ("none", "prefix"):
        return [Recorded(c["prompt"], llada21_settings(c, cache=cache), until_eos(c["tokens"]), llada21_name(c))
                for c in LLADA21["cases"] if c["editing_threshold"] < 1]
    if family == "Dream" and policy == "dream" and cache == "none":
        return [Recorded(c["prompt"], dream_settings(c), c["generated"], dream_name(c)) for c in DREAM["cases"]]
    if family == "sdar" and policy == "llada2" and cache in ("none", "prefix"):
        return [Recorded(c["prompt"], sdar_settings(c, cache=cache), c["generated"][:c["gen_length"]],
                         f"p{len(c['prompt'])}-g{c['gen_length']}") for c in SDAR["cases"]]
    return []
