"""A running batch's provisional progress, and rows cancelled in the middle of a block.

Progress (`BlockProgress`) is read at every K-step boundary for the rows added with `provisional`,
and for no other: it shows the tokens committed so far (None where still masked), never retracts one
(the policies here do not edit), and ends equal to the block's BlockUpdate. A row cancelled in the
middle of a block leaves at the next K-step boundary; the rows that stay decode as alone.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch

from dlmrt.runtime import GenerationSettings, Generator, Threshold
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.running_batch import BlockProgress, RunningBatch
from dlmrt.runtime.torch_backend import TorchBackend

SETTINGS = GenerationSettings(16, 4, Threshold(0.3))


def decode(batch: RunningBatch) -> list:
    """Every block of the batch until it empties: the BlockUpdates, in order."""
    updates = []
    while batch.active:
        updates += batch.run_block()
    batch.close()
    return updates


@pytest.mark.parametrize("settings", [SETTINGS, replace(SETTINGS, cache="dual"),
                                      replace(SETTINGS, temperature=0.8)], ids=["none", "dual", "sampling"])
def test_progress_grows_and_ends_equal_to_the_blocks_update(llada, settings):
    backend = TorchBackend(llada, mode="eager", max_batch=4)
    seen: list[BlockProgress] = []
    batch = open_batch(backend, on_progress=seen.extend)
    batch.add("watched", [5, 6, 7], settings, seed=1, provisional=True)
    batch.add("plain", [8, 9], replace(settings, gen_length=8), seed=2)
    updates = decode(batch)

    assert {progress.row for progress in seen} == {"watched"}  # a row that did not ask gets none
    assert len(seen) == batch.executed  # K is 1 on a CPU: one progress per step
    committed = {update.block: update.token_ids for update in updates if update.row == "watched"}
    assert sorted(committed) == list(range(4))
    for block, final in committed.items():
        shown = [progress.token_ids for progress in seen if progress.block == block]
        assert shown and shown[-1] == final  # provisional ends equal to the committed block
        assert any(None in tokens for tokens in shown)  # a block of 4 at threshold 0.3 takes several steps
        for before, after in zip(shown, shown[1:]):  # a token once shown is never taken back
            assert all(a is None or a == b for a, b in zip(before, after)), (before, after)
            assert sum(t is None for t in after[:len(before)]) <= sum(t is None for t in before)
    alone = Generator(backend).generate([[5, 6, 7]], replace(settings, seed=1))  # reading changes nothing
    assert batch.finished["watched"].tokens == alone.tokens[0].tolist()


def test_no_progress_is_read_when_no_row_asked(llada, monkeypatch):
    reads = []
    monkeypatch.setattr(type(open_batch(TorchBackend(llada, mode="eager"))), "_read_drafts",
                        lambda self, rows: reads.append(rows) or [[] for _ in rows])
    batch = open_batch(TorchBackend(llada, mode="eager", max_batch=4), on_progress=lambda progress: None)
    batch.add("a", [5, 6, 7], SETTINGS, seed=1)
    batch.add("b", [8, 9], SETTINGS, seed=2)
    decode(batch)
    assert batch.executed > 0 and reads == []


class CancelAfter:
    """A cancel token set once the batch has run `steps` steps."""

    def __init__(self, steps: int):
        self.steps, self.taken = steps, 0

    def step(self) -> None:
        self.taken += 1

    def is_set(self) -> bool:
        return self.taken >= self.steps


def block_steps(backend, cancel: CancelAfter | None) -> tuple[RunningBatch, list]:
    """One block of a fast row (threshold 1e-6: it commits its block in one step) beside a slow one
    (threshold 0.99: one position a step), the slow one cancelled after 2 steps when `cancel`."""
    token = cancel or CancelAfter(10 ** 9)
    batch = open_batch(backend, on_step=token.step)
    batch.add("fast", [5, 6, 7], replace(SETTINGS, policy=Threshold(1e-6)), seed=1)
    batch.add("slow", [8, 9], replace(SETTINGS, policy=Threshold(0.99)), seed=2, cancel=token)
    return batch, batch.run_block()


def test_a_cancelled_row_leaves_at_the_next_k_step_boundary(llada):
    backend = TorchBackend(llada, mode="eager", max_batch=4)
    uncancelled, _ = block_steps(backend, None)
    uncancelled.close()
    assert uncancelled.executed == 4  # the slow row holds the block for its 4 positions

    batch, updates = block_steps(backend, CancelAfter(2))
    assert batch.executed == 2  # the block ended once the slow row left: the fast one was done
    assert [(u.row, u.block, u.finish_reason) for u in updates if u.row == "slow"] == [("slow", -1, "cancelled")]
    assert batch.finished["slow"].metrics.nfe == 2
    assert [row.tag for row in batch.rows] == ["fast"]
    decode(batch)
    alone = Generator(backend).generate([[5, 6, 7]], replace(SETTINGS, policy=Threshold(1e-6), seed=1))
    assert batch.finished["fast"].tokens == alone.tokens[0].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_progress_and_a_mid_block_cancel_under_cuda_graphs(llada):
    """K = 2 on captured graphs: the slow row leaves after the first 2 steps, the fast row's progress is
    read at that boundary, and its tokens are those it gets alone, eagerly."""
    model = copy.deepcopy(llada).to("cuda")
    settings = replace(SETTINGS, steps_per_sync=2)
    seen, cancel = [], CancelAfter(2)
    batch = open_batch(TorchBackend(model, mode="cudagraph", max_batch=4), on_step=cancel.step,
                       on_progress=seen.extend)
    batch.add("fast", [5, 6, 7], replace(settings, policy=Threshold(1e-6)), seed=1, provisional=True)
    batch.add("slow", [8, 9], replace(settings, policy=Threshold(0.99)), seed=2, cancel=cancel)
    updates = batch.run_block()
    assert batch.executed == 2 and batch.finished["slow"].metrics.nfe == 2
    assert seen[-1].token_ids == next(u.token_ids for u in updates if u.row == "fast")
    decode(batch)
    alone = Generator(TorchBackend(model, mode="eager")).generate(
        [[5, 6, 7]], replace(SETTINGS, policy=Threshold(1e-6), seed=1))
    assert batch.finished["fast"].tokens == alone.tokens[0].tolist()


def test_the_scheduler_delivers_progress_before_each_block_to_the_tickets_that_asked(llada):
    """Each ticket gets its events in order: a block's progress, then its update, then Finished; only
    the ticket that asked gets progress, and both get the tokens they get alone."""
    from dlmrt.runtime.scheduler import Finished, Scheduler

    backend = TorchBackend(llada, mode="eager", max_batch=4)
    scheduler = Scheduler(backend)
    events = {"watched": [], "plain": []}
    done = {tag: threading.Event() for tag in events}

    def listener(tag):
        def deliver(event):
            events[tag].append(event)
            if isinstance(event, Finished):
                done[tag].set()
        return deliver

    scheduler.submit([5, 6, 7], replace(SETTINGS, seed=1), listener("watched"), provisional=True)
    scheduler.submit([8, 9], replace(SETTINGS, seed=2), listener("plain"))
    assert all(event.wait(60) for event in done.values())
    scheduler.stop()

    assert not any(isinstance(event, BlockProgress) for event in events["plain"])
    watched = events["watched"]
    assert isinstance(watched[-1], Finished) and not any(isinstance(e, Finished) for e in watched[:-1])
    shown, blocks = [], 0
    for event in watched[:-1]:
        if isinstance(event, BlockProgress):
            assert event.block == blocks
            shown.append(event.token_ids)
        else:  # the block's update: the last progress before it holds its tokens
            assert shown and shown[-1] == event.token_ids and event.block == blocks
            shown, blocks = [], blocks + 1
    assert blocks == 4 and shown == []
    generator = Generator(backend)
    for tag, prompt, seed in (("watched", [5, 6, 7], 1), ("plain", [8, 9], 2)):
        alone = generator.generate([prompt], replace(SETTINGS, seed=seed))
        assert events[tag][-1].row.tokens == alone.tokens[0].tolist(), tag


def test_uniform_noise_progress_ends_on_the_block_and_a_cancel_leaves_mid_block():
    """DiffusionGemma: progress is the block's draft, equal to the block's update once its steps are
    over (none after the completion's end-of-sequence: ignore_eos decodes on); a row cancelled after 3
    steps of a 12-step block leaves then, and the other decodes as alone."""
    import dlmrt
    from dlmrt.runtime import EntropyBound, text

    gemma = dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")
    settings = GenerationSettings(16, 8, EntropyBound(steps=12), ignore_eos=True)
    backend = TorchBackend(gemma, mode="eager", max_batch=4)
    prompts = {"watched": text.encode(gemma, "sort:3142="), "gone": text.encode(gemma, "sort:97=")}
    seen, cancel = [], CancelAfter(3)
    batch = open_batch(backend, on_step=cancel.step, on_progress=seen.extend)
    batch.add("watched", prompts["watched"], settings, seed=1, provisional=True)
    batch.add("gone", prompts["gone"], settings, seed=2, cancel=cancel)
    updates = decode(batch)

    assert batch.finished["gone"].finish_reason == "cancelled" and batch.finished["gone"].metrics.nfe == 3
    committed = {update.block: update.token_ids for update in updates if update.row == "watched"}
    assert sorted(committed) == [0, 1]
    for block, final in committed.items():
        shown = [progress.token_ids for progress in seen if progress.block == block]
        assert len(shown) > 1 and shown[-1] == final
    assert committed[0]  # the first block has output to compare (the second follows an end-of-sequence)
    alone = Generator(backend).generate([prompts["watched"]], replace(settings, seed=1))
    assert batch.finished["watched"].tokens == alone.tokens[0].tolist()
