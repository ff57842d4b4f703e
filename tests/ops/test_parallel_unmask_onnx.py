"""The ONNX local function of dlmrt::ParallelUnmask, run by ONNX Runtime, against the torch semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX path needs the 'onnx' extra")
ort = pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

from dlmrt.ops.parallel_unmask import MEASURE_CODES, EditParams, UnmaskParams, parallel_unmask  # noqa: E402
from dlmrt.ops.parallel_unmask import onnx_function  # noqa: E402

MASK = 6
VOCAB = 7


@pytest.fixture(scope="module")
def session():
    onnx_function.register_schema()
    model = onnx_function.standalone_model(mask_id=MASK)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def params(batch, count=1, threshold=2.0, factor=0.0, temperature=0.0, seed=0, step=0):
    full = lambda value, dtype: torch.full((batch,), value, dtype=dtype)  # noqa: E731
    return UnmaskParams(full(count, torch.long), full(threshold, torch.float32), full(factor, torch.float32),
                        full(temperature, torch.float32), full(seed, torch.long), full(step, torch.long))


def no_edits(ids):
    return EditParams(torch.full((ids.shape[0],), float("inf")), torch.zeros(ids.shape, dtype=torch.bool))


def check_same(session, logits, ids, positions, p: UnmaskParams, measure, edits: EditParams | None = None):
    """The function's outputs against the reference's; without `edits`, the node is fed editing off
    (an infinite threshold) and the reference runs without editing."""
    expected = parallel_unmask(logits, ids, positions, p, mask_id=MASK, confidence=measure, edits=edits)
    edits = edits or no_edits(ids)
    feeds = {"logits": logits.numpy(), "ids": ids.numpy(), "positions": positions.numpy(),
             "measure": measure.numpy(), **{name: t.numpy() for name, t in p._asdict().items()},
             "edit_threshold": edits.threshold.numpy(), "editable": edits.editable.numpy()}
    new_ids, confidence, commit, committed = session.run(None, feeds)
    np.testing.assert_array_equal(new_ids, expected.ids.numpy())
    np.testing.assert_array_equal(commit, expected.commit.numpy())
    np.testing.assert_array_equal(committed, expected.committed.numpy())
    np.testing.assert_allclose(confidence, expected.confidence.numpy(), rtol=0, atol=1e-6)
    return expected


def codes(batch, measure):
    return torch.full((batch,), MEASURE_CODES[measure], dtype=torch.long)


@pytest.mark.parametrize("shape", [(1, 1, VOCAB), (3, 8, VOCAB), (2, 16, 11)])
@pytest.mark.parametrize("sampling", [False, True])
def test_random_inputs(session, shape, sampling):
    batch, width, vocab = shape
    generator = torch.Generator().manual_seed(sum(shape) + sampling)
    for _ in range(20):
        logits = torch.randn(shape, generator=generator) * 3
        ids = torch.randint(0, vocab, (batch, width), generator=generator)
        ids[torch.rand(batch, width, generator=generator) < 0.6] = MASK
        p = UnmaskParams(
            count=torch.randint(0, 4, (batch,), generator=generator),
            threshold=torch.rand(batch, generator=generator),
            factor=torch.rand(batch, generator=generator) * 3,
            temperature=torch.rand(batch, generator=generator) * 2 * sampling,
            seed=torch.randint(0, 2**40, (batch,), generator=generator),
            step=torch.randint(0, 50, (batch,), generator=generator))
        positions = torch.randint(0, 100, (batch, width), generator=generator)
        measure = torch.randint(0, 4, (batch,), generator=generator)
        check_same(session, logits, ids, positions, p, measure)
        edit_threshold = torch.rand(batch, generator=generator)
        edit_threshold[torch.rand(batch, generator=generator) < 0.3] = float("inf")
        editable = torch.rand(batch, width, generator=generator) < 0.7
        check_same(session, logits, ids, positions, p, measure, EditParams(edit_threshold, editable))


def test_edits_overwrite_confident_changed_editable_tokens(session):
    """Hand-made: x0 is token 3 everywhere, with p(3) = 0.8 at positions 0-3 and 0.6 at 4-5."""
    logits = torch.full((1, 6, VOCAB), -20.0)
    logits[0, :4, 3], logits[0, :4, 2] = 2.0, 2.0 - torch.log(torch.tensor(4.0))
    logits[0, 4:, 3], logits[0, 4:, 2] = 1.0, 1.0 - torch.log(torch.tensor(1.5))
    ids = torch.tensor([[1, 3, 1, MASK, 1, 1]])
    editable = torch.tensor([[True, True, False, True, True, True]])
    result = check_same(session, logits, ids, torch.arange(6)[None], params(1, count=1), codes(1, "prob"),
                        EditParams(torch.tensor([0.7]), editable))
    # 0: edited; 1: already x0; 2: not editable; 3: masked, committed; 4, 5: not confident enough
    assert result.ids.tolist() == [[3, 3, 1, 3, 1, 1]]
    assert result.commit.tolist() == [[False, False, False, True, False, False]]


@pytest.mark.parametrize("measure", ["prob", "margin", "entropy", "random"])
def test_ties_commit_the_earlier_positions(session, measure):
    logits = torch.zeros(2, 6, VOCAB)
    logits[:, :, 3] = 2.0  # every position equally confident
    ids = torch.full((2, 6), MASK)
    result = check_same(session, logits, ids, torch.arange(6).repeat(2, 1), params(2, count=2), codes(2, measure))
    if measure != "random":
        assert result.commit[0].tolist() == [True, True, False, False, False, False]


def test_all_masked_and_none_masked(session):
    logits = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[MASK] * 5, [1, 2, 3, 4, 5]])
    result = check_same(session, logits, ids, torch.arange(5).repeat(2, 1), params(2, count=3, threshold=0.2),
                        codes(2, "prob"))
    assert result.committed.tolist()[1] == 0 and result.committed.tolist()[0] >= 3


def test_sampling_with_a_seed(session):
    logits = torch.zeros(1, 12, VOCAB)  # uniform: the draw decides everything
    ids = torch.full((1, 12), MASK)
    positions = torch.arange(12)[None]
    draws = [check_same(session, logits, ids, positions, params(1, count=12, temperature=1.0, seed=seed),
                        codes(1, "prob")).ids for seed in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert (draws[0] != MASK).all()


def test_the_node_carries_the_plugin_namespace():
    node = onnx_function.standalone_model(mask_id=MASK).graph.node[0]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.domain, node.op_type) == ("dlmrt", "ParallelUnmask")
    assert attributes == {"mask_id": MASK, "plugin_namespace": b"dlmrt", "plugin_version": b"1"}
