"""The task suite: the four shipped tasks unchanged, the headroom tasks' generators, checks and split,
and the canvas-fit check that refuses a task before any training step."""

import hashlib
import itertools
import json
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import dlmrt
from dlmrt.core import tasks
from dlmrt.core.errors import ArgumentError

SCRIPTS = Path(__file__).parents[2] / "scripts"


class ScriptedRng(random.Random):
    """Answers randrange with the given values in turn, so a generator's example can be worked by hand."""

    def __init__(self, values):
        super().__init__(0)
        self.values = iter(values)

    def randrange(self, *args, **kwargs):
        return next(self.values)


# sha256 of "task|prompt|answer\n" per example, computed with dlmrt/core/tasks.py as it was before the
# headroom tasks were added (commit 83f7532): the shipped models were trained and scored on these prompts.
@pytest.mark.parametrize("split, seed, digest", [
    ("test", 1234, "c3a56c0a1183a50819e7be93318390f6b5a78fab1f760566a9514d4669e0eb01"),
    ("train", 0, "08951a942108055496aa89dbc378a8193e9b1ae794f51cc77300310a6d749a29"),
])
def test_the_shipped_suite_draws_the_same_examples_as_before(split, seed, digest):
    drawn = tasks.examples(split, 50, seed)
    assert tuple(tasks.TASKS) == ("rev", "sort", "add", "same") and len(drawn) == 200
    assert hashlib.sha256("".join(f"{e.task}|{e.prompt}|{e.answer}\n" for e in drawn).encode()).hexdigest() == digest


def test_the_shipped_tokenizer_still_covers_the_alphabet():
    shipped = json.loads((dlmrt.TINY_MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    assert shipped == {token: i for i, token in enumerate((*tasks.SPECIAL_TOKENS, *tasks.ALPHABET))}
    example = tasks.sample("mul", "test", random.Random(3))
    tokenizer = tasks.build_tokenizer()
    assert tokenizer.decode(tokenizer.encode(example.prompt + example.answer).ids) == example.prompt + example.answer


def test_running_sums_by_hand():
    # 31 nines: the running sums are 9, 18, 27, ... mod 10.
    question, answer = tasks.HEADROOM_TASKS["psum"](ScriptedRng([9] * 31))
    assert question == "9" * 31 and answer == "9876543210" * 3 + "9"
    question, answer = tasks.HEADROOM_TASKS["psum"](ScriptedRng([1, 2, 3, 4] + [0] * 27))
    assert answer == "1360" + "0" * 27  # 1, 1+2, 1+2+3, 10 -> 0, then nothing more is added


def test_multiplication_by_hand():
    question, answer = tasks.HEADROOM_TASKS["mul"](ScriptedRng([10 ** 30 - 1, 9]))
    assert question == "9" * 30 + "x9" and answer == "8" + "9" * 29 + "1"  # 9 * (10^30 - 1) = 9 * 10^30 - 9
    question, answer = tasks.HEADROOM_TASKS["mul"](ScriptedRng([1, 7]))
    assert question == "0" * 29 + "1x7" and answer == "0" * 30 + "7"


def worked_answer(prompt: str) -> str:
    """A headroom prompt's answer, by plain arithmetic."""
    task, question = prompt.removesuffix("=").split(":")
    if task == "psum":
        return "".join(str(s % 10) for s in itertools.accumulate(int(d) for d in question))
    number, digit = question.split("x")
    return str(int(number) * int(digit)).zfill(31)


@pytest.mark.parametrize("task", tasks.HEADROOM_TASKS)
def test_headroom_answers_agree_with_plain_arithmetic(task):
    for example in tasks.examples("train", 100, seed=5, tasks=(task,)):
        expected = worked_answer(example.prompt)
        assert example.answer == expected and len(example.answer) == tasks.HEADROOM_DIGITS
        assert tasks.is_correct(example, expected)
        wrong = expected[:-1] + str((int(expected[-1]) + 1) % 10)
        assert not tasks.is_correct(example, wrong) and not tasks.is_correct(example, expected[:-1])


@pytest.mark.parametrize("task", tasks.HEADROOM_TASKS)
def test_headroom_splits_are_the_crc_rule_and_disjoint(task):
    test = {e.prompt for e in tasks.examples("test", 200, seed=1, tasks=(task,))}
    train = {e.prompt for e in tasks.examples("train", 200, seed=1, tasks=(task,))}
    assert all(zlib.crc32(p.encode()) % 5 == 0 for p in test)
    assert all(zlib.crc32(p.encode()) % 5 != 0 for p in train)
    assert len(test) == len(train) == 200 and not test & train


@pytest.mark.parametrize("task", tasks.ALL_TASKS)
def test_the_declared_longest_prompt_and_answer_bound_every_example(task):
    drawn = tasks.examples("train", 300, seed=2, tasks=(task,))
    assert max(len(e.prompt) for e in drawn) == tasks.LONGEST_PROMPT[task]
    assert max(len(e.answer) for e in drawn) == tasks.LONGEST_ANSWER[task]


@pytest.mark.parametrize("names, gen_length, context, message", [
    (("rev", "psum"), 16, None, r"task 'psum' answers in up to 31 tokens, and with end-of-sequence needs a "
                                r"generation length of 32, got 16"),
    (("add",), 4, None, r"task 'add' answers in up to 4 tokens, .* length of 5, got 4"),
    (("mul",), 32, 64, r"task 'mul' has prompts of up to 37 tokens: with 32 generated that is 69, more than the "
                       r"model's context of 64"),
    (("rev", "div"), 16, None, r"unknown task 'div': tasks are rev, sort, add, same, psum, mul"),
])
def test_a_task_that_cannot_fit_the_canvas_is_refused(names, gen_length, context, message):
    with pytest.raises(ArgumentError, match=message):
        tasks.check_canvas(names, gen_length, context)


@pytest.mark.parametrize("names, gen_length, context", [
    (tuple(tasks.TASKS), 16, 64), (("psum", "mul"), 32, 69), (("add",), 5, None)])
def test_tasks_that_fit_pass(names, gen_length, context):
    tasks.check_canvas(names, gen_length, context)


@pytest.mark.parametrize("options, message", [
    (["--tasks", "psum"], "task 'psum' answers in up to 31 tokens"),
    (["--tasks", "psum,mul", "--gen-length", "32", "--block-length", "32"], "more than the model's context of 64"),
    (["--gen-length", "20"], "--gen-length (20) must be a positive multiple of --block-length (8)"),
])
def test_train_tiny_refuses_a_canvas_that_cannot_fit_before_training(tmp_path, options, message):
    result = subprocess.run([sys.executable, str(SCRIPTS / "train_tiny.py"), "--out", str(tmp_path / "out"),
                             *options], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and "training" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


def test_training_rows_fill_the_requested_canvas():
    import torch

    from dlmrt.orl.supervised import masked_batch

    tokenizer = tasks.build_tokenizer()
    generator = torch.Generator().manual_seed(0)
    inputs, key_mask, targets, masked, width = masked_batch(random.Random(0), tokenizer, 6, generator,
                                                            ("psum", "mul"), gen_length=32, block_length=32)
    assert targets.shape == masked.shape == (6, 32) and inputs.shape == (6, width + 32)
    for row in range(6):
        prompt = tokenizer.decode(inputs[row, :width][key_mask[row, :width]].tolist())
        assert tokenizer.decode(targets[row, :31].tolist()) == worked_answer(prompt)
        assert targets[row, 31].item() == tasks.EOS_ID
        assert torch.equal(inputs[row, width:][masked[row]], torch.full((int(masked[row].sum()),), tasks.MASK_ID))
