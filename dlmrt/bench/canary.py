"""The absolute canary of the regression gate: a fixed GEMM and a fixed attention call, timed as one
more case in the gate's rounds.

Speed ratios to the reference loop cancel the machine, and with it a regression in code the
reference shares with the steps (the model's forward, a torch op the project wraps). The canary runs
none of the project's code, only torch at fixed shapes on seeded inputs, at the threads torch is set
to (those the gate's cases run on). So in the same rounds:

- a case slowed and the canary did not: the project regressed (`blame` says "project");
- both slowed: the machine did ("machine").

"Slowed" is each one's speed against its own baseline seconds, or, paired within the rounds, the
case's speed over the canary's against the baseline's (`dlmrt.bench.paired`): a drop of that ratio
is a slowdown the machine does not explain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlmrt.bench.case import Case

LABEL = "canary"
SEED = 0
GEMM = (512, 512, 512)  # (m, k, n) float32: about 3 ms on one core of a 2-core CI machine
ATTENTION = (4, 8, 128, 64)  # (batch, heads, length, head dim) float32 query, key and value: about 2 ms
REPEATS = 8  # of each per run: some 40 ms a run, long enough for the clock, short beside a case


def inputs() -> dict[str, torch.Tensor]:
    """The canary's fixed inputs, from SEED: the GEMM's two matrices and the attention's q, k and v."""
    generator = torch.Generator().manual_seed(SEED)
    m, k, n = GEMM
    return {"a": torch.randn(m, k, generator=generator), "b": torch.randn(k, n, generator=generator),
            **{name: torch.randn(*ATTENTION, generator=generator) for name in ("q", "k", "v")}}


def canary_case() -> Case:
    """The canary as a case of the gate's rounds: each run is REPEATS GEMMs and REPEATS attention calls."""
    tensors = inputs()
    a, b, q, k, v = (tensors[name] for name in ("a", "b", "q", "k", "v"))

    @torch.no_grad()
    def run() -> None:
        for _ in range(REPEATS):
            torch.mm(a, b)
            F.scaled_dot_product_attention(q, k, v)
    return Case(LABEL, run)


def blame(case_slowed: bool, canary_slowed: bool) -> str | None:
    """Who slowed: "project" when a case slowed and the canary did not, "machine" when the canary
    slowed (whether or not the case did), None when nothing did."""
    if canary_slowed:
        return "machine"
    return "project" if case_slowed else None
