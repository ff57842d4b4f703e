"""The Generator against the reference loop and an independent LLaDA2 generate; cache modes, batching,
end-of-sequence, streaming, cancellation and metrics."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from dlmrt.runtime.batch_resources import resources
from dlmrt.runtime import (Factor, Fixed, GenerationSettings, Generator, LLaDA2, ResidualPolicy, Threshold,
                           reference)
from dlmrt.runtime.torch_backend import TorchBackend
from helpers import TOKENS, EOSAt

MASK, EOS = TOKENS.mask_id, TOKENS.eos_ids[0]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]






def record_steps(backend, what):
    """Call `what(state, kind)` before every step `backend` runs (the run of K steps counts K)."""
    original = resources(backend).executor.run

    def run(state, kind, steps):
        for _ in range(steps):
            what(state, kind)
            original(state, kind, 1)
    resources(backend).executor.run = run
    return backend


# -- the fixed policy is the reference loop ------------------------------------------------------
@pytest.mark.parametrize("model_name", ["llada", "orl"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["single", "batched"])
@pytest.mark.parametrize("settings", [
    GenerationSettings(12, 4, Fixed(12), ignore_eos=True),
    GenerationSettings(12, 6, Fixed(4), ignore_eos=True),
    GenerationSettings(8, 8, Fixed(8), cfg_scale=1.5, ignore_eos=True),
    GenerationSettings(8, 4, Fixed(8, "random"), seed=3, ignore_eos=True),
], ids=["one-per-step", "three-per-step", "guidance", "random-remasking"])
def test_fixed_policy_gives_the_reference_tokens(request, loop, model_name, prompts, settings):
    model = request.getfixturevalue(model_name)
    expected = reference.generate(model, prompts, settings).tokens
    got = loop.run(model, prompts, settings).tokens
    if settings.policy.remasking == "random":  # the two loops draw their random numbers differently
        assert got.shape == expected.shape and not (got == MASK).any()
    else:
        assert torch.equal(got, expected)


def test_sampling_is_reproducible_and_seeded(llada, loop):
    settings = GenerationSettings(12, 4, Threshold(0.5), temperature=1.0, seed=7, ignore_eos=True)
    first, second = loop.run(llada, PROMPTS, settings).tokens, loop.run(llada, PROMPTS, settings).tokens
    other = loop.run(llada, PROMPTS, GenerationSettings(12, 4, Threshold(0.5), temperature=1.0, seed=8,
                                                   ignore_eos=True)).tokens
    greedy = loop.run(llada, PROMPTS, GenerationSettings(12, 4, Threshold(0.5), ignore_eos=True)).tokens
    assert torch.equal(first, second)
    assert not torch.equal(first, other) and not torch.equal(first, greedy)


# -- LLaDA2's own generate, written independently ---------------------------------------------------
@torch.no_grad()
def llada2_generate(model, prompt, gen_length, block_length, steps, threshold):
    """LLaDA2.x's public generate for one prompt, in plain Python over full forwards (the mask token is
    never a candidate: a trained model never predicts it, a random one may)."""
    n = len(prompt)
    num_blocks = -(-(n + gen_length) // block_length)
    x = list(prompt) + [MASK] * (num_blocks * block_length - n)
    steps = min(steps, gen_length)
    schedule = [block_length // steps + (i < block_length % steps) for i in range(steps)]
    for block in range(n // block_length, num_blocks):
        start, end = block * block_length, (block + 1) * block_length
        for step in range(steps):
            masked = [i for i in range(start, end) if x[i] == MASK]
            if not masked:
                break
            logits = model.denoise(torch.tensor([x[:end]]), positions=torch.arange(end)[None],
                                   block_length=block_length).logits[0].float()
            probs = F.softmax(logits, dim=-1)
            x0 = probs.index_fill(-1, torch.tensor([MASK]), -1.0).argmax(-1).tolist()
            p = {i: float(probs[i, x0[i]]) for i in masked}
            above = [i for i in masked if p[i] > threshold]
            wanted = schedule[step]
            chosen = above if len(above) >= wanted else \
                sorted(masked, key=lambda i: (-p[i], i))[:min(wanted, len(masked))]
            for i in chosen:
                x[i] = x0[i]
        if EOS in x[n:end]:
            break
    out = x[n:n + gen_length]
    return out[:out.index(EOS)] if EOS in out else out


@pytest.mark.parametrize("cache", ["none", "prefix"])
@pytest.mark.parametrize("gen_length, threshold, steps", [(12, 0.95, 4), (12, 0.2, 4), (12, 0.05, 2),
                                                         (10, 0.2, 4)])
def test_llada2_policy_decodes_as_llada2s_generate(llada2, loop, cache, gen_length, threshold, steps):
    settings = GenerationSettings(gen_length, 4, LLaDA2(threshold, steps), cache=cache)
    for prompt in ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13]):
        got = loop.run(llada2, [prompt], settings).rows[0].token_ids
        assert got == llada2_generate(llada2, prompt, gen_length, 4, steps, threshold), prompt


@pytest.mark.parametrize("policy", [LLaDA2(0.3, 4), Threshold(0.3), Fixed(12), Factor(2.0)],
                         ids=["llada2", "threshold", "fixed", "factor"])
@pytest.mark.parametrize("variant", ["base", "orl", "guided"])
def test_block_causal_cache_modes_give_the_tokens_of_no_cache(llada2, llada2_orl, loop, policy, variant):
    model = llada2_orl if variant == "orl" else llada2
    cfg_scale = 1.0 if variant == "guided" else 0.0
    settings = GenerationSettings(12, 4, policy, ignore_eos=True, cfg_scale=cfg_scale)
    expected = loop.run(model, PROMPTS, settings).tokens
    cached = loop.run(model, PROMPTS, GenerationSettings(12, 4, policy, ignore_eos=True, cfg_scale=cfg_scale,
                                                    cache="prefix")).tokens
    assert torch.equal(cached, expected)


def test_batched_rows_decode_as_alone(llada2, llada, loop):
    for model in (llada, llada2):
        for cache in ("none", "prefix"):
            settings = GenerationSettings(12, 4, Threshold(0.3), cache=cache)
            batched = loop.run(model, PROMPTS, settings).rows
            for prompt, row in zip(PROMPTS, batched):
                assert row.token_ids == loop.run(model, [prompt], settings).rows[0].token_ids


def test_block_causal_cache_writes_each_finished_block_once(llada2):
    windows = []
    backend = record_steps(TorchBackend(llada2, mode="eager"),
                           lambda state, kind: windows.append((kind.window, kind.writes > 0)))
    Generator(backend).generate([[5, 6, 7, 8, 9]], GenerationSettings(12, 4, Fixed(12), cache="prefix",
                                                                      ignore_eos=True))
    # prompt of 5: blocks [4, 8) (3 masked: 3 steps), [8, 12), [12, 16), [16, 20) (4 steps each). The
    # first step prefills [0, 8) and writes [0, 4); each next block's first step covers the previous
    # block too, and writes it.
    assert windows == [(8, True)] + [(4, False)] * 2 + ([(8, True)] + [(4, False)] * 3) * 3


# -- bidirectional caches are approximations; with one step per block they are exact -----------------
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("model_name, cfg_scale", [("llada", 0.0), ("orl", 0.0), ("llada", 1.0)])
def test_bidirectional_caches_refresh_at_each_block(request, loop, cache, model_name, cfg_scale):
    model = request.getfixturevalue(model_name)
    settings = GenerationSettings(12, 4, Fixed(3), ignore_eos=True, cfg_scale=cfg_scale)  # one step per block
    expected = loop.run(model, PROMPTS, settings).tokens
    got = loop.run(model, PROMPTS, GenerationSettings(12, 4, Fixed(3), cache=cache, ignore_eos=True,
                                                 cfg_scale=cfg_scale)).tokens
    assert torch.equal(got, expected)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_fresh_cache_gives_the_logits_of_a_full_forward(llada, cache):
    """Right after a refresh, a windowed step over the cached K/V sees exactly what a full forward sees."""
    from dlmrt.models.denoiser import PastKV

    ids = torch.tensor([[5, 6, 7, MASK, MASK, MASK, MASK, MASK, MASK, MASK, MASK]])
    full = llada.denoise(ids, return_kv=True)
    start, end = 3, 7
    if cache == "prefix":
        keys = torch.arange(start)
        window = slice(start, ids.shape[1])
    else:
        keys = torch.cat((torch.arange(start), torch.arange(end, ids.shape[1])))
        window = slice(start, end)
    positions = torch.arange(ids.shape[1])[None]
    out = llada.denoise(ids[:, window], positions=positions[:, window],
                        past=PastKV(full.kv.index_select(4, keys), positions[:, keys]))
    torch.testing.assert_close(out.logits, full.logits[:, window], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_bidirectional_cache_windows(llada, cache):
    kinds = []
    backend = record_steps(TorchBackend(llada, mode="eager"), lambda state, kind: kinds.append(kind))
    Generator(backend).generate([[5, 6, 7]], GenerationSettings(8, 4, Fixed(8), cache=cache, ignore_eos=True))
    # 3 + 8 positions on a canvas of whole blocks (12): blocks [4, 8) and [8, 12), 4 steps each
    full = [(k.window, k.start, k.cached, k.writes) for k in kinds[::4]]
    assert full == [(12, 0, False, 12)] * 2  # each block starts with a full forward that refreshes the cache
    windowed = [(k.window, k.start, k.cached, k.writes) for i, k in enumerate(kinds) if i % 4]
    if cache == "prefix":  # the block and what follows it
        assert windowed == [(8, 4, True, 0)] * 3 + [(4, 8, True, 0)] * 3
    else:  # the block alone, wherever it is
        assert windowed == [(4, None, True, 0)] * 6


# -- end of sequence, streaming, cancellation ---------------------------------------------------------
def test_a_row_stops_after_the_block_holding_eos(llada, loop):
    model = EOSAt(llada, 3, 5)  # EOS in the second block of 4
    settings = GenerationSettings(16, 4, Fixed(16))
    stopped = loop.run(model, [[5, 6, 7]], settings)
    full = loop.run(model, [[5, 6, 7]], GenerationSettings(16, 4, Fixed(16), ignore_eos=True))
    row = stopped.rows[0]
    assert row.finish_reason == "eos" and len(row.token_ids) == 5
    assert row.token_ids == full.rows[0].token_ids
    assert stopped.tokens[0, 8:].tolist() == [EOS] * 8  # the rest is filled with EOS
    assert stopped.metrics.nfe == 8 and full.metrics.nfe == 16
    assert stopped.metrics.generated_tokens == 8


def test_finished_rows_leave_the_batch(llada, loop):
    model = EOSAt(llada, 9, 1)  # the longest prompt's row stops after its first block
    batches = []
    backend = record_steps(loop.backend(model), lambda state, kind: batches.append(state.bucket.batch))
    result = Generator(backend).generate(PROMPTS, loop.settings(GenerationSettings(8, 4, Fixed(8))))
    finished_early = [r.finish_reason == "eos" and r.metrics.nfe == 4 for r in result.rows]
    # 3 rows run in the bucket of 4; the 2 left then fit the bucket of 2
    assert finished_early[2] and batches[:4] == [4] * 4 and set(batches[4:]) <= {2, 1}
    assert result.metrics.sequence_forwards == sum(r.metrics.nfe for r in result.rows) < 3 * 8


def test_stream_yields_the_completion_block_by_block(llada, loop):
    settings = GenerationSettings(12, 4, Threshold(0.3), ignore_eos=True)
    stream = loop.generator(llada).stream(PROMPTS, settings)
    pieces = {row: [] for row in range(len(PROMPTS))}
    blocks = {row: [] for row in range(len(PROMPTS))}
    for update in stream:
        pieces[update.row] += update.token_ids
        blocks[update.row].append(update.block)
    for row, output in enumerate(stream.result.rows):
        assert pieces[row] == output.token_ids
        assert blocks[row] == sorted(blocks[row])


def test_cancellation_stops_at_the_next_host_read(llada, loop):
    cancel = threading.Event()
    steps = []

    def on_step():
        steps.append(1)
        if len(steps) == 3:
            cancel.set()

    settings = GenerationSettings(12, 4, Fixed(12))
    result = loop.run(llada, PROMPTS, settings, cancel=cancel, on_step=on_step)
    k = loop.settings(settings).steps_per_sync
    assert result.metrics.nfe == -(-3 // k) * k  # the K steps in flight finish; no more start
    assert all(r.finish_reason == "cancelled" for r in result.rows)
    assert (result.tokens == MASK).any()
    for row in result.rows:
        assert MASK not in row.token_ids


def test_closing_the_stream_stops_compute(llada, loop):
    steps = []
    stream = loop.generator(llada).stream([[5, 6]], GenerationSettings(12, 4, Fixed(12), ignore_eos=True),
                                     on_step=lambda: steps.append(1))
    next(stream)
    stream.close()
    assert len(steps) == 4


# -- residual ---------------------------------------------------------------------------------------
def test_residual_policy_carries_z(orl, loop):
    settings = GenerationSettings(12, 12, ResidualPolicy(Threshold(0.3)), ignore_eos=True)
    with_z = loop.run(orl, PROMPTS, settings).tokens
    assert torch.equal(with_z, loop.run(orl, PROMPTS, GenerationSettings(12, 12, Threshold(0.3),
                                                                         ignore_eos=True)).tokens)
    certainties = []
    backend = record_steps(TorchBackend(orl, mode="eager"),
                           lambda state, kind: certainties.append(float(state.certainty.abs().sum())))
    Generator(backend).generate(PROMPTS, settings)
    assert certainties[0] == 0 and all(c > 0 for c in certainties[1:])  # z = 0 only before the first step


# -- metrics --------------------------------------------------------------------------------------------
def test_metrics_count_forwards_including_cache_refreshes(llada, loop):
    result = loop.run(llada, [[5, 6, 7], [8, 9]], GenerationSettings(8, 4, Fixed(8), cache="dual", ignore_eos=True))
    m = result.metrics
    assert m.nfe == 8 and m.sequence_forwards == 16 and m.generated_tokens == 16 and m.prompt_tokens == 5
    assert m.tpf == 1.0 and 0 < m.backend_s <= m.latency_s and m.peak_memory_bytes > 0
    assert [r.metrics.generated_tokens for r in result.rows] == [8, 8]
    payload = m.to_dict()
    assert payload["host_s"] == pytest.approx(m.latency_s - m.backend_s)
