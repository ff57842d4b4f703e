"""Continuous batching: a row's tokens are those it gets alone, whatever joins or leaves around it.

The reference is each request decoded alone by `Generator.generate` (itself held to the reference
loop in test_generator.py); the batch admits requests at different block boundaries, so rows run
at different blocks and canvas offsets, the bucket grows and shrinks under them, and some
requests are cancelled midway.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch

from dlmrt.runtime import Factor, Fixed, GenerationSettings, Generator, LLaDA2, ResidualPolicy, Threshold
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.torch_backend import TorchBackend

# (tag, prompt, gen_length, seed, the block boundary it joins at, the boundary it is cancelled at)
REQUESTS = [
    ("a", [5, 6, 7, 8, 9], 16, 0, 0, None),
    ("b", [10, 11], 8, 1, 1, None),
    ("gone", [12, 13, 14], 16, 2, 1, 2),
    ("c", [12, 13, 14, 15, 16, 17, 18, 19, 20], 12, 3, 2, None),
    ("d", [21, 22, 23], 16, 4, 2, None),
    ("e", [7, 7, 7, 7], 8, 5, 4, None),
]

CASES = {
    "bidirectional": ("llada", GenerationSettings(16, 4, Threshold(0.3))),
    "bidirectional-prefix": ("llada", GenerationSettings(16, 4, Threshold(0.3), cache="prefix")),
    "bidirectional-dual": ("llada", GenerationSettings(16, 4, Threshold(0.3), cache="dual")),
    "fixed-sampling": ("llada", GenerationSettings(16, 4, Fixed(), temperature=0.8)),
    "orl": ("orl", GenerationSettings(16, 4, ResidualPolicy(Threshold(0.3)))),
    "block-causal": ("llada2", GenerationSettings(16, 4, LLaDA2(0.3, 4))),
    "block-causal-cache": ("llada2", GenerationSettings(16, 4, LLaDA2(0.3, 4), cache="prefix")),
    "block-causal-orl-cache": ("llada2_orl", GenerationSettings(16, 4, Threshold(0.3), cache="prefix")),
}


def run_staggered(backend, settings, requests=REQUESTS, own=None):
    """Decode `requests` in one RunningBatch, each joining and cancelled at its boundary, with the
    settings `own[tag]` replaces for it; returns the finished rows, the blocks the rows were at in each
    block, and the buckets used."""
    batch = open_batch(backend)
    cancels = {tag: threading.Event() for tag, *_ in requests}
    blocks_seen, buckets, boundary = [], [], 0
    while boundary == 0 or batch.active or any(joins >= boundary for *_, joins, _ in requests):
        for tag, prompt, gen_length, seed, joins, cancelled_at in requests:
            if joins == boundary:
                batch.add(tag, prompt, row_settings(settings, tag, gen_length, seed, own), seed=seed,
                          cancel=cancels[tag])
            if cancelled_at == boundary:
                cancels[tag].set()
        batch.run_block()
        if batch.state is not None:
            buckets.append(batch.state.bucket)
        blocks_seen.append(sorted(row.block for row in batch.rows))
        boundary += 1
    batch.close()
    return batch.finished, blocks_seen, buckets


def row_settings(settings, tag, gen_length, seed, own=None):
    return replace(settings, gen_length=gen_length, seed=seed, **(own or {}).get(tag, {}))


def assert_each_row_as_alone(generator, finished, settings, own=None, requests=REQUESTS):
    """Every request not cancelled finished with the tokens and finish reason `generator` gives it alone."""
    for tag, prompt, gen_length, seed, _, cancelled_at in requests:
        if cancelled_at is None:
            alone = generator.generate([prompt], row_settings(settings, tag, gen_length, seed, own))
            assert finished[tag].tokens == alone.tokens[0].tolist(), tag
            assert finished[tag].finish_reason == alone.rows[0].finish_reason, tag


@pytest.mark.parametrize("case", list(CASES))
def test_a_row_decodes_as_alone_whatever_joins_or_leaves(request, case):
    model_name, settings = CASES[case]
    backend = TorchBackend(request.getfixturevalue(model_name), mode="eager", max_batch=4)
    finished, blocks_seen, buckets = run_staggered(backend, settings)
    assert any(len(set(blocks)) > 1 for blocks in blocks_seen)  # rows really ran at different blocks
    assert len({bucket.batch for bucket in buckets}) > 1 and len({bucket.canvas for bucket in buckets}) > 1
    assert finished["gone"].finish_reason == "cancelled"
    assert_each_row_as_alone(Generator(backend), finished, settings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["bidirectional-dual", "orl", "block-causal-cache"])
def test_a_row_decodes_as_alone_under_cuda_graphs(request, case):
    model_name, settings = CASES[case]
    model = copy.deepcopy(request.getfixturevalue(model_name)).to("cuda")
    backend = TorchBackend(model, mode="cudagraph", max_batch=4)
    finished, _, _ = run_staggered(backend, replace(settings, steps_per_sync=2))
    assert_each_row_as_alone(Generator(TorchBackend(model, mode="eager", max_batch=4)), finished, settings)


def test_a_cancelled_row_leaves_the_batch_at_the_next_boundary(llada):
    backend = TorchBackend(llada, mode="eager", max_batch=4)
    settings = GenerationSettings(16, 4, Threshold(0.3), ignore_eos=True)
    batch = open_batch(backend)
    cancel = threading.Event()
    batch.add("stays", [5, 6, 7], settings, seed=0)
    batch.add("goes", [8, 9], settings, seed=1, cancel=cancel)
    batch.run_block()
    assert {row.tag for row in batch.rows} == {"stays", "goes"}
    cancel.set()
    updates = batch.run_block()
    assert {row.tag for row in batch.rows} == {"stays"} and batch.state.bucket.batch == 1
    assert [u.finish_reason for u in updates if u.row == "goes"] == ["cancelled"]
    while batch.active:
        batch.run_block()
    batch.close()
    assert batch.finished["stays"].finish_reason == "length"


def test_rows_wait_while_the_largest_canvas_cannot_hold_them(llada):
    backend = TorchBackend(llada, mode="eager", max_batch=4)
    backend.ladder = replace(backend.ladder, max_canvas=32)
    long_prompt = list(range(5, 21))
    batch = open_batch(backend)
    batch.add("first", long_prompt, GenerationSettings(16, 4, Threshold(0.3), ignore_eos=True), seed=0)
    batch.run_block()
    # 16 + 4 positions before its current block and 12 after: a second 16 + 16 row does not fit beside it
    batch.add("second", long_prompt, GenerationSettings(16, 4, Threshold(0.3), ignore_eos=True), seed=0)
    batch.run_block()
    assert [row.tag for row in batch.rows] == ["first"] and [row.tag for row in batch.waiting] == ["second"]
    while batch.active:
        batch.run_block()
    batch.close()
    assert batch.finished["first"].tokens == batch.finished["second"].tokens


def test_a_row_with_other_settings_is_refused(llada):
    batch = open_batch(TorchBackend(llada, mode="eager"))
    batch.add("a", [5, 6], GenerationSettings(8, 4, Threshold(0.3)), seed=0)
    for own in (GenerationSettings(16, 4, Threshold(0.3), seed=9, ignore_eos=True),
                GenerationSettings(8, 4, Threshold(0.5), temperature=0.7)):
        assert batch.accepts(own)
    for other in (GenerationSettings(8, 8, Threshold(0.3)), GenerationSettings(8, 4, Threshold(0.3), cache="dual"),
                  GenerationSettings(8, 4, Threshold(0.3, "margin")), GenerationSettings(8, 4, Factor(1.0)),
                  GenerationSettings(8, 4, Threshold(0.3), cfg_scale=1.5)):
        assert not batch.accepts(other), other
    with pytest.raises(Exception, match="settings differ"):
        batch.add("b", [5, 6], GenerationSettings(8, 4, Factor(1.0)), seed=0)


# Each row's own temperature and threshold (or factor); "b" and "d" stay greedy among sampled rows.
OWN = {"a": {"temperature": 0.9}, "b": {"temperature": 0.0}, "gone": {"temperature": 1.3},
       "c": {"temperature": 0.5}, "d": {"temperature": 0.0}, "e": {"temperature": 1.0}}
OWN_POLICIES = {
    "threshold": ("llada", GenerationSettings(16, 4, Threshold(0.3), cache="dual"),
                  {"a": Threshold(0.2), "b": Threshold(0.9), "c": Threshold(0.5), "e": Threshold(1.0)}),
    "factor-orl": ("orl", GenerationSettings(16, 4, ResidualPolicy(Factor(1.0))),
                   {"a": ResidualPolicy(Factor(0.5)), "c": ResidualPolicy(Factor(3.0))}),
    "block-causal": ("llada2", GenerationSettings(16, 4, LLaDA2(0.3, 4), cache="prefix"),
                     {"b": LLaDA2(0.8, 4), "d": LLaDA2(0.1, 4)}),
}


@pytest.mark.parametrize("case", list(OWN_POLICIES))
def test_rows_with_their_own_temperature_and_threshold_share_a_batch(request, case):
    model_name, settings, policies = OWN_POLICIES[case]
    own = {tag: {**values, **({"policy": policies[tag]} if tag in policies else {})} for tag, values in OWN.items()}
    backend = TorchBackend(request.getfixturevalue(model_name), mode="eager", max_batch=4)
    finished, blocks_seen, _ = run_staggered(backend, settings, own=own)
    assert max(len(blocks) for blocks in blocks_seen) >= 3  # rows of different settings ran side by side
    assert_each_row_as_alone(Generator(backend), finished, settings, own)


def test_a_batch_that_emptied_takes_new_rows_as_fresh(orl):
    backend = TorchBackend(orl, mode="eager", max_batch=4)
    settings = GenerationSettings(8, 4, ResidualPolicy(Threshold(0.3)), ignore_eos=True)
    batch, cancel = open_batch(backend), threading.Event()
    batch.add("a", [5, 6, 7], replace(settings, gen_length=16), seed=0, cancel=cancel)
    batch.run_block()
    assert batch.state.z.abs().sum() > 0  # a's residual
    cancel.set()
    batch.run_block()
    assert not batch.rows and batch.finished["a"].finish_reason == "cancelled"
    batch.add("c", [12, 13, 14], settings, seed=2)  # a's canvas could still hold c where it is
    batch._place_waiting()
    assert batch.state.z.abs().sum() == 0 and batch.state.certainty.abs().sum() == 0
    while batch.active:
        batch.run_block()
    batch.close()
    alone = Generator(backend).generate([[12, 13, 14]], replace(settings, seed=2))
    assert batch.finished["c"].tokens == alone.tokens[0].tolist()


@pytest.mark.parametrize("case", ["bidirectional-dual", "block-causal-cache"])
def test_k_v_is_written_before_it_is_read_when_rows_join(request, case):
    """K/V storage is never cleared: an earlier batch's, or a left row's, must not be read. Poison the
    whole storage at every boundary where rows join: every row's tokens are still those it gets alone."""
    model_name, settings = CASES[case]
    backend = TorchBackend(request.getfixturevalue(model_name), mode="eager", max_batch=4)
    batch = open_batch(backend)
    noise = torch.Generator().manual_seed(0)
    requests = [("a", [5, 6, 7, 8, 9], 16, 0, 0, None), ("b", [10, 11], 8, 1, 1, None),
                ("c", [12, 13, 14], 12, 2, 2, None)]
    for boundary in range(8):
        joining = [r for r in requests if r[4] == boundary]
        for tag, prompt, gen_length, seed, *_ in joining:
            batch.add(tag, prompt, replace(settings, gen_length=gen_length, seed=seed), seed=seed)
        if joining:
            batch._place_waiting()
            batch.state.kv.copy_(torch.randn(batch.state.kv.shape, generator=noise) * 1e4)
        batch.run_block()
    assert not batch.active
    batch.close()
    assert_each_row_as_alone(Generator(backend), batch.finished, settings, requests=requests)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_onnx_runtime_rows_decode_as_alone_whatever_joins_or_leaves(tiny_export, cache):
    """The ORT backend binds each bucket's buffers once: rows moving between buckets, and joining
    into free slots, must keep their tokens, each at its own temperature."""
    from dlmrt.runtime.ort_backend import OrtBackend

    backend = OrtBackend(tiny_export)
    settings = GenerationSettings(16, 4, Threshold(0.5), cache=cache)
    own = {**OWN, "c": {"temperature": 0.5, "policy": Threshold(0.95)}}  # its own temperature, and threshold
    finished, blocks_seen, buckets = run_staggered(backend, settings, own=own)
    assert any(len(set(blocks)) > 1 for blocks in blocks_seen)
    assert len({bucket.batch for bucket in buckets}) > 1 and len({bucket.canvas for bucket in buckets}) > 1
    assert_each_row_as_alone(Generator(backend), finished, settings, own)


def test_uniform_noise_rows_decode_as_alone_whatever_joins_or_leaves():
    """DiffusionGemma rows at different blocks: the bucket grows (batch, prompt region, blocks) and
    shrinks under them, a row's committed blocks move with its storage, and one is cancelled."""
    import dlmrt
    from dlmrt.runtime import EntropyBound, text

    gemma = dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")
    requests = [(tag, text.encode(gemma, prompt), gen_length, seed, joins, cancelled_at)
                for tag, prompt, gen_length, seed, joins, cancelled_at in [
                    ("a", "sort:3142=", 24, 0, 0, None), ("long", "sort:9182736455463728=", 8, 1, 0, None),
                    ("b", "add:12+34=", 8, 2, 1, None), ("gone", "sort:97=", 32, 3, 2, 3),
                    ("d", "add:5+6=", 32, 4, 2, None), ("e", "sort:21=", 8, 5, 3, None),
                    ("g", "sort:5=", 16, 6, 3, None)]]
    settings = GenerationSettings(8, 8, EntropyBound(steps=12))
    own = {tag: {"ignore_eos": True} for tag in ("a", "gone", "d", "g")}  # the rest stop at their EOS
    backend = TorchBackend(gemma, mode="eager", max_batch=4)
    finished, blocks_seen, buckets = run_staggered(backend, settings, requests, own)
    assert any(len(set(blocks)) > 1 for blocks in blocks_seen)  # rows really ran at different blocks
    for size in ("batch", "prompt", "blocks"):
        assert len({getattr(bucket, size) for bucket in buckets}) > 1, size
    assert finished["gone"].finish_reason == "cancelled"
    assert_each_row_as_alone(Generator(backend), finished, settings, own, requests)
