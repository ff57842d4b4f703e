"""The parity matrix (tests/parity_matrix.py) but for its compile column: the eager cells, ONNX Runtime's and
the TensorRT fake's, the CUDA-graph cells where a GPU is, and the combinations the product refuses."""

from __future__ import annotations

import pytest

from dlmrt.cli.backends import BACKENDS
from dlmrt.core.errors import ArgumentError
from dlmrt.models import FAMILIES
from dlmrt.runtime import CACHE_MODES
from dlmrt.runtime.executor import MODES
from dlmrt.runtime.policy_registry import POLICIES
from parity_matrix import CELLS, PROMPTS, REFUSED, SUBJECTS, check_cell, default_settings, generator_for, refusal


def test_the_matrix_covers_every_registered_value():
    assert {s.family for s in SUBJECTS.values()} == set(FAMILIES)  # a family added without a subject fails
    eager = {(c.subject, c.policy, c.cache) for c in CELLS if (c.backend, c.mode) == ("torch", "eager")}
    assert {(s, "fixed", "none") for s in SUBJECTS if SUBJECTS[s].family == "llada"} <= eager
    assert {("llada2_moe", "llada21", "prefix"), ("Dream", "dream", "none"), ("sdar", "llada2", "prefix")} <= eager
    for backend, mode in [("torch", m) for m in MODES if m != "eager"] + [(b, None) for b in BACKENDS if b != "torch"]:
        column = [c for c in CELLS if (c.backend, c.mode) == (backend, mode)]
        assert {c.policy for c in column} == set(POLICIES), (backend, mode)
        assert {c.cache for c in column} == set(CACHE_MODES), (backend, mode)
        assert {c.subject for c in column} == set(SUBJECTS), (backend, mode)


@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.gpu) if c.mode == "cudagraph" else c
                                  for c in CELLS if c.mode != "compile"], ids=str)
def test_the_cell_gives_the_oracles_tokens(cell, exports):
    check_cell(cell, exports)


@pytest.mark.parametrize("cell", REFUSED, ids=str)
def test_a_combination_the_product_cannot_run_gets_one_clear_error(cell):
    subject = SUBJECTS[cell.subject]
    message = refusal(subject, cell.policy, cell.cache)
    with pytest.raises(ArgumentError, match=message):
        generator_for(cell.subject, "torch", "eager", None).generate(list(PROMPTS), default_settings(cell, 0))
