"""The ONNX local function of dlmrt::EntropyBoundStep, run by ONNX Runtime, against the torch semantics."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX path needs the 'onnx' extra")
ort = pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

from dlmrt.ops.entropy_bound import RenoiseParams, entropy, entropy_bound_step  # noqa: E402
from dlmrt.ops.entropy_bound import onnx_function  # noqa: E402


@pytest.fixture(scope="module")
def session():
    onnx_function.register_schema()
    model = onnx_function.standalone_model()
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def params(batch, temperature=1.0, bound=1.0, seed=0, step=0):
    full = lambda value, dtype: (torch.tensor(value, dtype=dtype) if isinstance(value, list)  # noqa: E731
                                 else torch.full((batch,), value, dtype=dtype))
    return RenoiseParams(full(temperature, torch.float32), full(bound, torch.float32), full(seed, torch.long),
                         full(step, torch.long))


def check_same(session, logits, canvas, positions, p: RenoiseParams, finished):
    """The function's outputs against the reference's: tokens and acceptance to the bit, the scaled
    logits too (one float32 division each), the mean entropy within 1e-5."""
    expected = entropy_bound_step(logits, canvas, positions, p, finished=finished)
    feeds = {"logits": logits.numpy(), "canvas": canvas.numpy(), "positions": positions.numpy(),
             "finished": finished.numpy(), **{name: t.numpy() for name, t in p._asdict().items()}}
    next_canvas, argmax, scaled, accepted, mean_entropy = session.run(None, feeds)
    np.testing.assert_array_equal(next_canvas, expected.canvas.numpy())
    np.testing.assert_array_equal(argmax, expected.argmax.numpy())
    np.testing.assert_array_equal(accepted, expected.accepted.numpy())
    np.testing.assert_array_equal(scaled, expected.scaled_logits.numpy())
    assert mean_entropy.dtype == np.float32
    np.testing.assert_allclose(mean_entropy, expected.mean_entropy.numpy(), rtol=0, atol=1e-5)
    return expected


@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 8, 37), (2, 32, 100), (4, 13, 2), (2, 5, 1)])
def test_random_inputs(session, shape):
    batch, width, vocab = shape
    generator = torch.Generator().manual_seed(sum(shape))
    for trial in range(20):
        logits = torch.randn(shape, generator=generator) * (1 + 4 * trial / 20)
        canvas = torch.randint(0, vocab, (batch, width), generator=generator)
        positions = torch.randint(-10, 2**34, (batch, width), generator=generator)
        temperature = 0.2 + 2 * torch.rand(batch, generator=generator)
        h = entropy(logits / temperature[:, None, None]).sum(-1)
        bound = (h * torch.rand(batch, generator=generator) * 1.2).float()
        bound[torch.rand(batch, generator=generator) < 0.2] = 0.0
        p = RenoiseParams(temperature, bound, torch.randint(-2**40, 2**40, (batch,), generator=generator),
                          torch.randint(-1, 50, (batch,), generator=generator))
        finished = torch.rand(batch, generator=generator) < 0.25
        check_same(session, logits, canvas, positions, p, finished)


def tied_rows(batch: int) -> torch.Tensor:
    """[batch, 8, 24]: positions 1, 3, 4 and 6 share one row of logits, 0 and 5 a flatter one, 2 and 7
    each have a single possible token (entropy exactly 0)."""
    g = torch.Generator().manual_seed(21)
    sharp, flat = torch.randn(24, generator=g) * 3, torch.randn(24, generator=g) * 0.3
    one_token = torch.full((24,), -math.inf)
    one_token[5] = 1.0
    return torch.stack([flat, sharp, one_token, sharp, sharp, flat, sharp, one_token.roll(9)]).expand(batch, 8, 24)


def test_ties_are_accepted_in_position_order(session):
    """Ascending entropy: 2 and 7 (0), then the sharp group 1, 3, 4, 6, then the flat pair 0, 5; the
    bounds lie between the sums (ONNX Runtime's entropies need not equal torch's to the bit)."""
    logits = tied_rows(5).clone()
    h = entropy(logits[0])
    sharp, flat = h[1].item(), h[0].item()
    assert 0.1 < sharp < flat
    bounds = [0.0, 0.5 * sharp, 1.5 * sharp, 2.5 * sharp, 4 * sharp + 0.5 * flat]
    finished = torch.zeros(5, dtype=torch.bool)
    result = check_same(session, logits, torch.zeros(5, 8, dtype=torch.long), torch.arange(8).expand(5, 8),
                        params(5, bound=bounds), finished)
    taken = [sorted(row.nonzero().flatten().tolist()) for row in result.accepted]
    assert taken == [[1, 2, 7], [1, 2, 7], [1, 2, 3, 7], [1, 2, 3, 4, 7], [0, 1, 2, 3, 4, 6, 7]]


def test_finished_rows_keep_their_canvas(session):
    logits = torch.randn(3, 6, 11, generator=torch.Generator().manual_seed(3))
    canvas = torch.arange(18).reshape(3, 6) % 11
    result = check_same(session, logits, canvas, torch.arange(6).expand(3, 6), params(3, bound=100.0),
                        torch.tensor([True, False, True]))
    assert torch.equal(result.canvas[[0, 2]], canvas[[0, 2]]) and not result.accepted[[0, 2]].any()
    assert result.accepted[1].all()


def test_sampling_with_a_seed(session):
    logits = torch.zeros(1, 12, 9)  # uniform: the draw decides everything
    canvas = torch.zeros(1, 12, dtype=torch.long)
    positions = torch.arange(12)[None]
    draws = [check_same(session, logits, canvas, positions, params(1, bound=1e6, seed=seed),
                        torch.zeros(1, dtype=torch.bool)).canvas for seed in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_the_node_carries_the_plugin_namespace():
    model = onnx_function.standalone_model()
    node = model.graph.node[0]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.domain, node.op_type) == ("dlmrt", "EntropyBoundStep")
    assert attributes == {"plugin_namespace": b"dlmrt", "plugin_version": b"1"}
    assert [f.name for f in model.functions] == ["ParallelUnmaskMix32", "ParallelUnmaskRowHash",
                                                 "ParallelUnmaskUniform", "EntropyBoundStep"]


# -- a torch graph calling the op, exported with the translation ------------------------------------

@torch.library.custom_op("dlmrt_tests::entropy_bound_step", mutates_args=())
def _entropy_bound_op(logits: torch.Tensor, canvas: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                      entropy_bound: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, finished: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stand-in for a `torch.ops.dlmrt.entropy_bound_step` (a test namespace, so as not to claim the name)."""
    result = entropy_bound_step(logits, canvas, positions, RenoiseParams(temperature, entropy_bound, seed, step),
                                finished=finished)
    return tuple(t.clone() for t in result)


@_entropy_bound_op.register_fake
def _(logits, canvas, positions, temperature, entropy_bound, seed, step, finished):
    return (torch.empty_like(canvas), torch.empty_like(canvas), torch.empty_like(logits),
            torch.empty(canvas.shape, dtype=torch.bool, device=canvas.device),
            torch.empty(canvas.shape[:1], dtype=torch.float32, device=canvas.device))


class _Step(torch.nn.Module):
    def forward(self, logits, canvas, positions, temperature, entropy_bound, seed, step, finished):
        return torch.ops.dlmrt_tests.entropy_bound_step(logits * 2.0, canvas, positions, temperature, entropy_bound,
                                                        seed, step, finished)


def test_a_torch_graph_exports_to_one_node_that_runs():
    pytest.importorskip("onnxscript")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 10, generator=g)
    inputs = (logits, torch.randint(0, 10, (2, 6), generator=g), torch.arange(6).expand(2, 6).clone(),
              torch.tensor([0.7, 1.3]), torch.tensor([2.0, 0.5]), torch.tensor([5, 6]), torch.tensor([1, 2]),
              torch.tensor([False, True]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_Step(), inputs, dynamo=True, opset_version=18, custom_translation_table={
            torch.ops.dlmrt_tests.entropy_bound_step.default: onnx_function.entropy_bound_step_translation})
    model = program.model_proto
    nodes = [n for n in model.graph.node if n.domain == "dlmrt"]
    assert [n.op_type for n in nodes] == ["EntropyBoundStep"]
    model.functions.extend(onnx_function.function_protos())
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {value.name: tensor.numpy() for value, tensor in zip(model.graph.input, inputs)}
    outputs = session.run(None, feeds)
    expected = entropy_bound_step(inputs[0] * 2.0, inputs[1], inputs[2], RenoiseParams(*inputs[3:7]),
                                  finished=inputs[7])
    for name, value in zip(("canvas", "argmax", "scaled_logits", "accepted"), outputs):
        np.testing.assert_array_equal(value, getattr(expected, name).numpy())
    np.testing.assert_allclose(outputs[4], expected.mean_entropy.numpy(), rtol=0, atol=1e-5)
