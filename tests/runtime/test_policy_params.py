"""A policy's per-row numbers and step options (`Policy.row_params`, `Policy.step_flags`) reach the step's
buffers and step kinds as the policy states them, with no per-policy code in the batches.

The step's buffers are fixed fields of the bucket's state (a new row parameter needs a new step input, so
a new buffer): what is checked is that every registered policy names exactly those buffers, so that a
joining row overwrites all of a slot's last row, and that the buffers then hold values computed here by
hand (float32 `nextafter` from numpy, the measure codes and the temperature rule written out), for a few
policies, one of them defined in this file.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from dlmrt.models import checkpoint
from dlmrt.runtime import EntropyBound, Factor, GenerationSettings, LLaDA21, ResidualPolicy, Threshold, make_policy
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.device_state import DeviceState
from dlmrt.runtime.policy_registry import POLICIES
from dlmrt.runtime.torch_backend import TorchBackend
from dlmrt.runtime.uniform_state import UniformState

INF = float("inf")
# The step inputs a policy sets, by noise kind; the batch itself writes temperature and seed (mask) or
# seed (uniform), and the minimum commits come from the policy's schedule.
STEP_INPUTS = {
    "mask": (DeviceState, {"threshold", "factor", "measure", "edit_threshold", "max_post_steps"}),
    "uniform": (UniformState, {"temperatures", "last_step", "entropy_bound", "stability_threshold",
                               "confidence_threshold"}),
}
DIFFUSION_GEMMA = Path(__file__).parents[1] / "data" / "diffusion_gemma"


def above(value: float) -> float:
    """The next float32 above `value`'s float32: the threshold that `> value` is as `>=`."""
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_names_exactly_its_step_buffers(name):
    policy = make_policy(name)
    state_class, inputs = STEP_INPUTS[policy.noise]
    assert set(policy.row_params()) == inputs
    assert inputs <= {field.name for field in dataclasses.fields(state_class)}


@dataclasses.dataclass(frozen=True)
class ThresholdAndFactor(Threshold):
    """A policy that only this file knows: both Fast-dLLM rules at once."""

    factor: float = 1.5
    name: ClassVar[str] = "threshold_and_factor"

    def row_params(self) -> dict[str, float | int]:
        return {**super().row_params(), "factor": self.factor}


def placed(backend, settings: GenerationSettings, seed: int):
    """The state and slot of a row that joined an empty batch, after its block's step kinds were chosen."""
    batch = open_batch(backend)
    batch.add(0, [5, 6, 7], settings, seed=seed)
    batch._place_waiting()
    if backend.spec.noise == "mask":
        batch._start_block()
    return batch, batch.rows[0].slot


def row_of(state, slot: int, names) -> dict[str, float]:
    return {name: getattr(state, name)[slot].item() for name in names}


MASK_CASES = [  # model, policy, temperature, seed, the buffers' values, the step kinds' confidence and editing
    ("llada2", LLaDA21(threshold=0.7, edit_threshold=0.5, max_post_steps=3), 0.5, 7,
     {"threshold": above(0.7), "factor": 0.0, "measure": 0, "edit_threshold": above(0.5), "max_post_steps": 3,
      "temperature": 0.5, "seed": 7}, ("prob", True)),
    ("llada2", LLaDA21(threshold=0.7, edit_threshold=1.0, max_post_steps=3), 0.0, 1,
     {"threshold": above(0.7), "factor": 0.0, "measure": 0, "edit_threshold": INF, "max_post_steps": 0,
      "temperature": 0.0, "seed": 1}, ("prob", False)),
    ("llada", Factor(2.0, confidence="margin"), 0.0, 3,
     {"threshold": INF, "factor": 2.0, "measure": 1, "edit_threshold": INF, "max_post_steps": 0,
      "temperature": 0.0, "seed": 3}, ("margin", False)),
    ("llada", ThresholdAndFactor(0.25, confidence="entropy"), 0.0, 4,
     {"threshold": 0.25, "factor": 1.5, "measure": 2, "edit_threshold": INF, "max_post_steps": 0,
      "temperature": 0.0, "seed": 4}, ("entropy", False)),
]


@pytest.mark.parametrize("model_name, policy, temperature, seed, expected, flags", MASK_CASES,
                         ids=["llada21-editing", "llada21-no-editing", "factor-margin", "defined-here"])
def test_a_mask_rows_buffers_hold_its_policys_numbers(request, model_name, policy, temperature, seed, expected,
                                                      flags):
    settings = GenerationSettings(8, 4, policy, temperature=temperature)
    batch, slot = placed(TorchBackend(request.getfixturevalue(model_name), mode="eager"), settings, seed)
    assert row_of(batch.state, slot, expected) == expected  # every expected value is a float32 exactly
    first, later = batch._kinds
    assert (first.confidence, first.editing) == (later.confidence, later.editing) == flags


def test_a_uniform_rows_buffers_hold_its_policys_numbers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = checkpoint.load(DIFFUSION_GEMMA)
    policy = EntropyBound(steps=4, entropy_bound=0.3, t_min=0.2, t_max=0.6, stability_threshold=2,
                          confidence_threshold=0.01)
    batch, slot = placed(TorchBackend(model, mode="eager"), GenerationSettings(8, 8, policy), seed=5)
    state = batch.state
    expected = {"last_step": 3, "entropy_bound": float(np.float32(0.3)), "stability_threshold": 2,
                "confidence_threshold": float(np.float32(0.01)), "seed": 5}
    assert row_of(state, slot, expected) == expected
    # step s of 4 runs at 0.2 + 0.4 * (4 - s) / 4; the rest of a schedule of 64 (the least room) holds 1
    assert state.temperatures[slot].tolist() == pytest.approx([0.6, 0.5, 0.4, 0.3] + [1.0] * 60, rel=1e-6)


def test_a_wrapper_policy_has_its_rules_numbers_and_flags():
    residual = ResidualPolicy(Factor(2.0, confidence="entropy"))
    assert residual.row_params() == {"threshold": INF, "factor": 2.0, "measure": 2, "edit_threshold": INF,
                                     "max_post_steps": 0}
    assert residual.step_flags() == {"confidence": "entropy", "editing": False}
    assert ResidualPolicy(Threshold(0.4)).row_params()["threshold"] == 0.4
